"""The interpreter bounds check of ``conftest.py`` catches an out-of-buffer access."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from _bounds import VIOLATIONS  # noqa: E402
from _helpers import interpreting  # noqa: E402


@triton.jit
def _shifted_copy(x, y, shift, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(y + o, tl.load(x + o + shift, mask=o + shift < N + 2, other=0.0))


@pytest.mark.skipif(not interpreting(), reason="interpreter only")
def test_out_of_buffer_load_is_reported():
    x, y = torch.arange(16.0), torch.zeros(16)
    before = len(VIOLATIONS)
    _shifted_copy[(1,)](x, y, 0, N=16)  # in bounds
    assert len(VIOLATIONS) == before
    _shifted_copy[(1,)](x, y, 2, N=16)  # lanes 14, 15 read x[16], x[17]
    found = VIOLATIONS[before:]
    del VIOLATIONS[before:]  # reported here, not by the autouse check
    assert len(found) == 1 and found[0][:3] == ("_shifted_copy", "load", 2), found
    assert torch.equal(y[:14], x[2:])
