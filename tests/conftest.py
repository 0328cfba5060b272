"""Test session set-up.

Without CUDA the Triton kernels run in the interpreter: ``TRITON_INTERPRET``
must be set before any kernel module is imported (``@triton.jit`` reads it).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _kernel_bounds():
    """In the interpreter, fail a test whose kernels load or store outside their buffers."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    try:
        import triton.runtime.interpreter  # noqa: F401
    except ImportError:  # the package runs without Triton (references only)
        yield
        return
    from _bounds import VIOLATIONS, install

    install()
    before = len(VIOLATIONS)
    yield
    found = VIOLATIONS[before:]
    assert not found, f"kernel accesses outside their buffers: {found[:5]}"
