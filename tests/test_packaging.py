"""What a regular (non-editable) install of the package holds."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_directory_is_installed():
    """``[tool.setuptools] packages`` lists every package of ``kdn_compile`` (an editable
    install finds a missing one anyway; a wheel leaves it out)."""
    tomllib = pytest.importorskip("tomllib")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "kdn_compile").rglob("__init__.py")}
    found.add("kdn_compile.lowering")  # from lowering/ ([tool.setuptools.package-dir])
    assert found == listed
