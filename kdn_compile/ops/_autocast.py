"""Autocast leaves the ``kdn`` ops alone.

Under ``torch.autocast`` an op without an autocast rule runs with autocast still on,
so the PyTorch calls inside it (the references' matmuls, the kernels' glue) would
autocast: float32 inputs computed in bfloat16 (silently less exact) or a solve with no
bfloat16 CPU kernel (an error from deep inside). Each op instead gets an autocast
kernel that turns autocast off and calls the op with its inputs as given: the ops
choose their own precisions (see the public functions' docstrings), in and out of
autocast alike.
"""

from __future__ import annotations

import functools
import operator

import torch

_KEYS = (torch._C.DispatchKey.AutocastCPU, torch._C.DispatchKey.AutocastCUDA)
_EXCLUDED = functools.reduce(operator.or_, map(torch._C.DispatchKeySet, _KEYS))
_LIB = torch.library.Library("kdn", "IMPL")  # noqa: TOR901 (kept for the process)


def _register(name: str) -> None:
    op = getattr(torch.ops.kdn, name).default

    def run(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDED):
            return op(*args, **kwargs)

    for key in _KEYS:
        op.py_impl(key)(run)  # the Python dispatcher (tracing)
        _LIB.impl(name, lambda _keys, *args, **kwargs: run(*args, **kwargs), key.name,
                  with_keyset=True)


def outside_autocast() -> None:
    """Give every registered ``kdn`` op the autocast kernel of this module."""
    for name in torch.ops.kdn:
        _register(name)
