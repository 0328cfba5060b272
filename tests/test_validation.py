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


def test_scales_beyond_the_float_range():
    """An int scale too large for a float, and a float chunk size whose message would
    overflow its formatting while compiling, give the argument's error in both modes."""
    x = delta_inputs(T=4, K=4, V=3)
    compiled = torch.compile(kdn_compile.chunk_gdn, fullgraph=True, backend="eager")
    for fn in (kdn_compile.chunk_gdn, compiled):
        with pytest.raises(ValueError, match=r"scale must be a finite float, got an int of 1329 bits"):
            fn(**x, scale=10**400)
    z = kdn_inputs(T=5, K=4, V=3)
    with pytest.raises(ValueError, match=r"info_scale must be a finite float, got an int"):
        kdn_compile.diag_kdn(**z, scale=1.0, info_scale=-(10**400))
    with pytest.raises(ValueError, match=r"chunk_size must be below 2\*\*63, got 1e\+305"):
        kdn_compile.chunk_gdn(**x, chunk_size=1e305)
    with pytest.raises(ValueError, match=r"chunk_size must be below 2\*\*63, got a float >= 1e300"):
        compiled(**x, chunk_size=1e305)


@pytest.mark.parametrize("eps,error,message", [
    (float("nan"), ValueError, "norm_eps must be finite, got nan"),
    (-1e-5, ValueError, "norm_eps must be >= 0, got -1e-05"),
    ("1e-5", TypeError, "norm_eps must be a float, got str"),
    (None, TypeError, "norm_eps must be a float, got NoneType"),
])
def test_layers_check_norm_eps(eps, error, message):
    from kdn_compile.layers import DiagKDN, GatedDeltaNet, KimiDeltaAttention

    for layer in (GatedDeltaNet, KimiDeltaAttention, DiagKDN):
        with pytest.raises(error, match=message):
            layer(32, 2, 16, norm_eps=eps)
    assert GatedDeltaNet(32, 2, 16, norm_eps=0).norm.eps == 0.0


def test_decode_refuses_outputs_that_require_grad():
    """The pools and intermediate states a decode step writes in place: like its inputs,
    refused when they require grad with grad mode on (PyTorch refuses such in-place writes)."""
    x = delta_inputs(B=2, T=2, K=4, V=3)
    pool = torch.zeros(3, x["v"].shape[2], 4, 3)
    states = torch.zeros(2, 2, x["v"].shape[2], 4, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"inference only, but intermediate_states require grad"):
        kdn_compile.delta_rule_decode(**{n: x[n] for n in "qkvg"}, beta=x["beta"], state_pool=pool,
                                      state_indices=torch.tensor([0, 2]),
                                      intermediate_states=states)
    assert not pool.any() and not states.detach().any()


def test_transformers_causal_conv1d_checks_packed_boundaries():
    from kdn_compile.integrations.transformers import causal_conv1d

    x, w = torch.randn(1, 3, 10), torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"never decrease and end at T = 10, got \[0, 6, 4, 10\]"):
        causal_conv1d(x, w, cu_seq_lens_q=torch.tensor([0, 6, 4, 10]))
    with pytest.raises(TypeError, match=r"cu_seqlens must be int32 or int64, got torch.float32"):
        causal_conv1d(x, w, cu_seq_lens_q=torch.tensor([0.0, 4.0, 10.0]))
    with pytest.raises(ValueError, match=r"batch size must be 1, got B = 2"):
        causal_conv1d(torch.randn(2, 3, 10), w, cu_seq_lens_q=torch.tensor([0, 4, 10]))
    y = causal_conv1d(x, w, cu_seq_lens_q=torch.tensor([0, 4, 10]))
    assert torch.equal(y[..., 4:], causal_conv1d(x[..., 4:], w))
