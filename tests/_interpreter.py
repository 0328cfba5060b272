"""Two speed-ups of Triton's interpreter (CPU CI); the kernels compute the same.

* The language patch. On every kernel launch and on every call of a ``@triton.jit`` helper,
  the interpreter patches the builtins of ``triton.language`` (``_patch_builtin``:
  ``inspect.getmembers`` of the module, of ``tensor`` and of ``math``, keeping the members
  that are builtins). For kernels built from small helpers that scan is a fifth of the
  interpreted run time. Here each of them is scanned once, and each call patches the same
  members the scan would find: those of the first scan that are builtins at the time of the
  call (a member already patched by an enclosing launch is not a builtin and is left alone,
  as before).
* The frame stack. CPython 3.11 keeps frames in chunks of 16 KiB: a call that does not fit in
  the current chunk maps a new one, and the return to that chunk's first frame unmaps it. An
  interpreted kernel makes hundreds of thousands of calls a few frames deep; where the depth
  of the launch puts a chunk's end among them, every one of them maps and unmaps a chunk
  (``test_properties.py`` spent 20 to 27 s of its 60 s in the kernel doing so, in system
  time). Here each launch is entered through a frame of about 3,100 slots, which takes a
  chunk of its own (64 KiB: that frame and some 40 KiB free), so the kernel's calls start at
  the same place in a fresh chunk whatever the depth of the test.

``conftest.py`` installs both with the bounds check; processes that a test spawns to run
kernels install them with :func:`install`.
"""

from __future__ import annotations

import inspect


def install() -> None:
    """Both speed-ups (idempotent); either is left out in a Triton without what it replaces."""
    import triton.runtime.interpreter as interp

    if getattr(interp, "_kdn_faster", False):
        return
    if hasattr(interp, "_patch_builtin") and hasattr(interp, "_patch_attr"):
        _scan_builtins_once(interp)
    if hasattr(interp, "GridExecutor"):
        _launch_on_a_fresh_chunk(interp)
    interp._kdn_faster = True


def _scan_builtins_once(interp) -> None:
    import triton.language as tl

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


def _launch_on_a_fresh_chunk(interp, slots: int = 3100) -> None:
    # a function whose frame holds ``slots`` locals (never assigned) and calls fn(*args)
    names = " = ".join(f"_{i}" for i in range(slots))
    namespace: dict = {}
    exec(f"def call(fn, args, kwargs):\n    if fn is None:\n        {names} = None\n"
         f"    return fn(*args, **kwargs)\n", namespace)
    call, launch = namespace["call"], interp.GridExecutor.__call__

    def launch_on_a_fresh_chunk(self, *args, **kwargs):
        return call(launch, (self, *args), kwargs)

    interp.GridExecutor.__call__ = launch_on_a_fresh_chunk
