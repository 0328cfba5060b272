"""Eager launches of compiled Triton kernels without Triton's per-call binding.

``kernel[grid](*args)`` binds every argument, builds Triton's specialization key and
checks the kernel's globals at each call: tens of microseconds of host time, more than a
decode step's GPU time at small batches. :class:`DirectKernel` keeps each compiled
variant under a cheaper key of its own, taken from the very properties Triton
specializes on (each tensor's dtype and 16-byte alignment, each integer's being 1, its
divisibility by 16 and its width, which arguments are None, the constexprs and launch
options), so that two calls under one key always get the same compiled kernel. The first
call of a key launches through ``kernel[grid]`` (compiling as usual); later ones call the
compiled kernel's launcher directly on the current stream. With a launch hook installed
(profilers such as Proton) every call takes Triton's own path.

Only for eager tensors: a launch seen by ``torch.compile`` or ``torch.export`` goes
through ``wrap_triton`` (see :func:`kdn_compile.lowering.recurrent._launch`).
"""

from __future__ import annotations

import torch
from triton import knobs

__all__ = ["DirectKernel", "launch_hooked", "launch_key"]

_Tensor = torch.Tensor


def _arg_key(a):
    """What Triton's specialization sees of a runtime argument."""
    if isinstance(a, _Tensor):
        return a.dtype, a.data_ptr() & 15 == 0
    if isinstance(a, bool):
        return a
    if a is None or isinstance(a, float):  # floats are not specialized on their value
        return a.__class__
    # an int: 1 is a constant; divisibility by 16; i32, i64 or u64
    return a == 1, a & 15 == 0, -(1 << 31) <= a < 1 << 31, a >= 1 << 63


def launch_hooked() -> bool:
    """Whether a launch hook is installed: Triton keeps its launch hooks in a chain
    (``knobs.runtime.launch_enter_hook``, empty by default; older releases a callable or
    None)."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


def launch_key(args: tuple, kwargs: dict) -> tuple:
    """The key under which :class:`DirectKernel` keeps a compiled kernel: equal keys
    (on one device, in one debug mode) mean equal Triton specializations."""
    return tuple([_arg_key(a) for a in args]), tuple(kwargs.items())


class DirectKernel:
    """A ``@triton.jit`` kernel launched from eager code with little host time.

    ``DirectKernel(kernel)[grid](*args, **constexprs_and_options)``: ``args`` are the
    kernel's runtime parameters in order (tensors, ints, floats or None), the keywords its
    constexprs and launch options (``num_warps``, ...), always the same names at a call
    site. Tensors must be on the current CUDA device.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self._compiled: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def run(self, grid, args: tuple, kwargs: dict) -> None:
        device = torch.cuda.current_device()
        key = launch_key(args, kwargs), device, knobs.runtime.debug
        compiled = self._compiled.get(key)
        if compiled is None or launch_hooked():
            self._compiled[key] = self.kernel[grid](*args, **kwargs)
            return
        grid = tuple(grid) + (1, 1)
        params = [*args, *(kwargs[n] for n in self.kernel.arg_names[len(args):])]
        compiled.run(grid[0], grid[1], grid[2],
                     torch._C._cuda_getCurrentRawStream(device),
                     compiled.function, compiled.packed_metadata, None, None, None, *params)
