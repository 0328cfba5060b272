"""``kdn_compile`` imported from a source checkout uses that checkout's ``lowering/``.

``kdn_compile/lowering`` is a symlink to the checkout's top-level ``lowering/``, so a
second checkout (another worktree) imported from its own directory runs its own kernels
even where an editable install of another checkout is present, and the kernels have one
module name.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kdn_compile

ROOT = Path(kdn_compile.__file__).resolve().parent.parent


def test_second_checkout_imports_its_own_lowering(tmp_path):
    copy = tmp_path / "checkout"
    for name in ("kdn_compile", "lowering"):
        shutil.copytree(ROOT / name, copy / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    assert (copy / "kdn_compile" / "lowering").is_symlink()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", "import sys, kdn_compile.ops, kdn_compile.lowering as m, "
         "kdn_compile as k; print(m.__file__); print(k.__file__); "
         "print(sorted(n for n in sys.modules if n.split('.')[0] == 'lowering'))"],
        cwd=copy, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lowering_file, package_file, top_level = done.stdout.splitlines()[-3:]
    assert Path(package_file).resolve().is_relative_to(copy.resolve())
    assert Path(lowering_file).resolve() == (copy / "lowering" / "__init__.py").resolve()
    assert top_level == "[]"


def test_lowering_has_one_module_name():
    """Imported as a top-level ``lowering`` (Python started in the checkout), the folder
    refuses, instead of defining its kernels a second time."""
    sys.path.insert(0, str(ROOT))
    try:
        with pytest.raises(ImportError, match="kdn_compile.lowering"):
            __import__("lowering")
    finally:
        sys.path.remove(str(ROOT))
        sys.modules.pop("lowering", None)
