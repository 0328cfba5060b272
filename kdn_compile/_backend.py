"""The backend switch: which implementation the public functions call.

``"auto"`` (default): Triton kernels for CUDA tensors the kernels cover, the
exact references otherwise. ``"reference"``: always the references.
``"triton"``: the kernel ops wherever they can launch, including CPU tensors
under ``TRITON_INTERPRET=1`` in eager mode (how CPU CI tests the kernels);
shapes or dtypes the kernels do not cover still fall back to the references.

The switch is a module global read by the public functions while Dynamo traces
them, so ``torch.compile`` guards on it: changing it recompiles.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

BACKENDS = ("auto", "reference", "triton")
_backend = "auto"


def get_backend() -> str:
    """The active backend name, one of ``BACKENDS``."""
    return _backend


def set_backend(name: str) -> None:
    """Select the backend for later calls.

    Raises:
        ValueError: if ``name`` is not one of ``"auto"``, ``"reference"``, ``"triton"``.
    """
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    _backend = name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Context manager form of :func:`set_backend`; restores the previous backend."""
    previous = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def prefer_kernels(device_type: str) -> bool:
    """Whether a public function should call the kernel op for tensors on ``device_type``."""
    return _backend == "triton" or (_backend == "auto" and device_type == "cuda")
