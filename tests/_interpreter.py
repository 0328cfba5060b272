"""A faster language patch for Triton's interpreter (CPU CI), same result.

On every kernel launch and on every call of a ``@triton.jit`` helper, the interpreter
patches the builtins of ``triton.language`` (``_patch_builtin``: ``inspect.getmembers`` of
the module, of ``tensor`` and of ``math``, keeping the members that are builtins). For
kernels built from small helpers that scan is a fifth of the interpreted run time.
:func:`install` makes it scan each of them once and then patch, on each call, the same
members the scan would find: those of the first scan that are builtins at the time of
the call (a member already patched by an enclosing launch is not a builtin and is left
alone, as before). ``conftest.py`` installs it with the bounds check.
"""

from __future__ import annotations

import inspect


def install() -> None:
    """Replace ``_patch_builtin`` (idempotent); left as it is in a Triton without it."""
    import triton.language as tl
    import triton.runtime.interpreter as interp

    if getattr(interp, "_kdn_fast_patch", False) or not (
            hasattr(interp, "_patch_builtin") and hasattr(interp, "_patch_attr")):
        return
    builtin_names: dict = {}

    def patch_builtin(pkg, builder, scope):
        names = builtin_names.get(pkg)
        if names is None:
            names = builtin_names[pkg] = [name for name, member in inspect.getmembers(pkg)
                                          if tl.core.is_builtin(member)]
        for name in names:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interp._patch_attr(pkg, name, member, builder, scope)

    interp._patch_builtin = patch_builtin
    interp._kdn_fast_patch = True
