"""``kdn_compile`` imported from a source checkout uses that checkout's ``lowering/``.

An editable install maps ``kdn_compile.lowering`` to the checkout it was made
from; a second checkout (another worktree) imported from its own directory must
not run the first checkout's kernels.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import kdn_compile

ROOT = Path(kdn_compile.__file__).resolve().parent.parent


def test_second_checkout_imports_its_own_lowering(tmp_path):
    copy = tmp_path / "checkout"
    for name in ("kdn_compile", "lowering"):
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", "import kdn_compile.lowering as m, kdn_compile as k; "
         "print(m.__file__); print(k.__file__)"],
        cwd=copy, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lowering_file, package_file = done.stdout.split()[-2:]
    assert Path(package_file).resolve().is_relative_to(copy.resolve())
    assert Path(lowering_file).resolve().is_relative_to(copy.resolve()), lowering_file
