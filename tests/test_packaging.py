"""What a regular (non-editable) install of the package holds."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_directory_is_installed():
    """``[tool.setuptools] packages`` lists every package of ``kdn_compile`` (an editable
    install finds a missing one anyway; a wheel leaves it out)."""
    tomllib = pytest.importorskip("tomllib")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"])
    found = {".".join(Path(folder).relative_to(ROOT).parts)
             for folder, _, files in os.walk(ROOT / "kdn_compile", followlinks=True)
             if "__init__.py" in files}  # kdn_compile/lowering: a link to lowering/
    assert found == listed


def test_wheel_holds_the_kernels_as_files(tmp_path):
    """The wheel built from a checkout holds every file of ``lowering/`` as a regular file
    under ``kdn_compile/lowering/`` (setuptools copies through the symlink), and no
    top-level ``lowering``."""
    build_meta = pytest.importorskip("setuptools.build_meta")
    source = tmp_path / "source"
    for name in ("kdn_compile", "lowering"):
        shutil.copytree(ROOT / name, source / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    done = subprocess.run(
        [sys.executable, "-c", f"import {build_meta.__name__} as b; print(b.build_wheel("
         f"{str(tmp_path / 'dist')!r}))"],
        cwd=source, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with zipfile.ZipFile(tmp_path / "dist" / done.stdout.split()[-1]) as wheel:
        entries = {i.filename: i for i in wheel.infolist()}
        kernels = sorted(p.name for p in (ROOT / "lowering").glob("*.py"))
        assert sorted(n.rsplit("/", 1)[1] for n in entries
                      if n.startswith("kdn_compile/lowering/")) == kernels
        for name in kernels:
            entry = entries[f"kdn_compile/lowering/{name}"]
            assert stat.S_ISREG(entry.external_attr >> 16), name
            assert wheel.read(entry) == (ROOT / "lowering" / name).read_bytes(), name
        assert not any(n.startswith("lowering/") for n in entries)


def test_importing_the_package_builds_no_layer():
    """``import kdn_compile`` stops at the functions and ops; ``kdn_compile.fla`` and
    ``kdn_compile.layers`` (the nn.Module classes) load on first use."""
    code = ("import sys, kdn_compile; assert 'kdn_compile.layers' not in sys.modules; "
            "assert kdn_compile.fla.chunk_kda and 'kdn_compile.layers' in sys.modules; "
            "import kdn_compile.fla as f; assert f is kdn_compile.fla; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
