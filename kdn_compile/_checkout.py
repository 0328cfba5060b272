"""Make ``kdn_compile.lowering`` importable from a source checkout.

The kernels live in ``lowering/`` at the repository root and install as
``kdn_compile.lowering`` (``[tool.setuptools.package-dir]``). Python started in
the checkout finds ``kdn_compile/`` in the working directory first; depending on
the setuptools version, the editable install's mapping then never applies, or it
points at another checkout (a second worktree of an editable install). So when
``kdn_compile`` is imported from a checkout (``pyproject.toml`` and ``lowering/``
beside it), load that checkout's ``lowering/`` under its installed name; an
installed package keeps its own ``kdn_compile.lowering``.
"""

from __future__ import annotations

import importlib.util
import os
import sys

_NAME = "kdn_compile.lowering"


def _map_checkout_lowering() -> None:
    if _NAME in sys.modules:
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    init = os.path.join(root, "lowering", "__init__.py")
    if not (os.path.isfile(init) and os.path.isfile(os.path.join(root, "pyproject.toml"))):
        return
    spec = importlib.util.spec_from_file_location(
        _NAME, init, submodule_search_locations=[os.path.dirname(init)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module
    spec.loader.exec_module(module)


_map_checkout_lowering()
