"""Checks of argument values (the shape, type and dtype checks: test_errors.py)."""

from __future__ import annotations

import pytest
import torch

import kdn_compile
from _inputs import delta_inputs, kdn_inputs


def test_cu_seqlens_values_are_checked():
    x = delta_inputs(B=1, T=8, K=4, V=3, N=2)
    for bad in ([0, 3, 6], [1, 3, 8], [0, 9, 8], [0, -2, 8]):
        with pytest.raises(ValueError, match=r"cu_seqlens must start at 0, never decrease and end at T = 8"):
            kdn_compile.chunk_gdn(**x, cu_seqlens=torch.tensor(bad))
    # A valid but strided boundary vector is fine (the kernels get a dense copy).
    strided = torch.tensor([0, 99, 3, 99, 8])[::2]
    o, _ = kdn_compile.chunk_gdn(**x, cu_seqlens=strided)
    o_ref, _ = kdn_compile.chunk_gdn(**x, cu_seqlens=strided.contiguous())
    assert torch.equal(o, o_ref)
    # compiled, the values are not read on the host: a device-side assert, raised when the
    # compiled code runs (on CUDA at the next synchronization)
    compiled = torch.compile(kdn_compile.chunk_gdn, fullgraph=True, backend="eager")
    with pytest.raises(RuntimeError, match=r"cu_seqlens must start at 0, never decrease"):
        compiled(**x, cu_seqlens=torch.tensor([0, 9, 8]))


def test_scales_must_be_finite():
    """Eagerly here; compiled, the scale cases of test_errors.py."""
    x = delta_inputs(T=4, K=4, V=3)
    with pytest.raises(ValueError, match=r"scale must be finite, got nan"):
        kdn_compile.chunk_gdn(**x, scale=float("nan"))
    z = kdn_inputs(T=5, K=4, V=3)
    with pytest.raises(ValueError, match=r"info_scale must be finite, got inf"):
        kdn_compile.diag_kdn(**z, scale=1.0, info_scale=float("inf"))
    from kdn_compile.layers import DiagKDN

    with pytest.raises(ValueError, match=r"info_scale must be finite, got nan"):
        DiagKDN(32, 2, 16, info_scale=float("nan"))


def test_layers_check_cu_seqlens_before_the_packed_convolution():
    """The short convolution gathers rows by ``cu_seqlens``: bad boundaries once gave an
    IndexError eagerly and aborted the process (Inductor's C++ bounds check) compiled."""
    from kdn_compile.layers import DiagKDN, GatedDeltaNet

    torch.manual_seed(0)
    for layer in (GatedDeltaNet(32, 2, 16), DiagKDN(32, 2, 16)):
        with pytest.raises(ValueError, match=r"end at T = 20, got \[0, 5, 21\]"):
            layer(torch.randn(1, 20, 32), cu_seqlens=torch.tensor([0, 5, 21]))
        with pytest.raises(ValueError, match=r"with cu_seqlens the batch size must be 1, got B = 2"):
            layer(torch.randn(2, 10, 32), cu_seqlens=torch.tensor([0, 3, 10]))
    layer = GatedDeltaNet(32, 2, 16)
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(1, 20, 32)
    compiled(x, cu_seqlens=torch.tensor([0, 5, 20]))
    with pytest.raises(RuntimeError, match=r"cu_seqlens must start at 0, never decrease"):
        compiled(x, cu_seqlens=torch.tensor([0, 25, 20]))
