"""Bounds check for kernels run by Triton's interpreter (CPU CI).

A masked-off lane never touches memory, but an unmasked load or store past the end
of a buffer reads or writes someone else's memory: the interpreter does not notice,
a GPU may fault (illegal memory access) or silently corrupt. :func:`install` wraps
the interpreter so that every launch records the storages of its tensor arguments and
every load and store checks its active addresses against them; :data:`VIOLATIONS`
collects ``(kernel, "load" | "store", count, first addresses)`` for each access that
leaves them. ``conftest.py`` installs it and fails a test that adds a violation.

Limits: an access is checked against the union of all argument storages, so one
that lands inside another argument's buffer (or past a view's end but inside its
storage) is not reported; atomics are not checked.
"""

from __future__ import annotations

import numpy as np

VIOLATIONS: list = []
_RANGES: list = []
_KERNEL = ["?"]


def _check(kind, ptrs, mask, itemsize):
    active = np.broadcast_to(mask.data, ptrs.data.shape)
    addr = ptrs.data[active].astype(np.uint64)
    if addr.size == 0:
        return
    inside = np.zeros(addr.shape, dtype=bool)
    for lo, hi in _RANGES:
        inside |= (addr >= lo) & (addr + itemsize <= hi)
    if not inside.all():
        first = [hex(int(a)) for a in addr[~inside][:3]]
        VIOLATIONS.append((_KERNEL[0], kind, int((~inside).sum()), first))


def install() -> None:
    """Wrap the interpreter (idempotent); needs ``TRITON_INTERPRET=1`` kernels to matter."""
    import triton.runtime.interpreter as interp

    if getattr(interp, "_kdn_bounds", False):
        return
    init, load = interp.GridExecutor._init_args_hst, interp.InterpreterBuilder.create_masked_load
    store = interp.InterpreterBuilder.create_masked_store

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = init(self, args_dev, kwargs)
        _RANGES.clear()
        pending = [*args_hst, *kwargs_hst.values()]
        while pending:
            arg = pending.pop()
            if isinstance(arg, tuple):
                pending.extend(arg)
            elif hasattr(arg, "base") and hasattr(arg.base, "untyped_storage"):
                pending.append(arg.base)  # a tensor descriptor
            elif hasattr(arg, "untyped_storage"):
                storage = arg.untyped_storage()
                _RANGES.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        _KERNEL[0] = getattr(self.fn, "__name__", "?")
        return args_hst, kwargs_hst

    def masked_load(self, ptrs, mask, other, *args, **kwargs):
        dtype = np.dtype(interp._get_np_dtype(ptrs.get_element_ty()))
        _check("load", ptrs, mask, dtype.itemsize)
        return load(self, ptrs, mask, other, *args, **kwargs)

    def masked_store(self, ptrs, value, mask, *args, **kwargs):
        _check("store", ptrs, mask, value.data.dtype.itemsize)
        return store(self, ptrs, value, mask, *args, **kwargs)

    interp.GridExecutor._init_args_hst = init_args
    interp.InterpreterBuilder.create_masked_load = masked_load
    interp.InterpreterBuilder.create_masked_store = masked_store
    interp._kdn_bounds = True
