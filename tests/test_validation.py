"""Bad input raises a clear error naming the argument, the expected and the received value."""

from __future__ import annotations

import pytest
import torch

import kdn_compile
from _helpers import delta_inputs, kdn_inputs


def _gdn(**changes):
    x = delta_inputs(B=2, T=8, Hk=2, Hv=4, K=4, V=3)
    kwargs = {n: changes.pop(n) for n in list(changes) if n not in x}
    x.update(changes)
    return kdn_compile.chunk_gdn(**x, **kwargs)


BAD_GDN = [
    ("k", torch.zeros(2, 8, 2, 5, dtype=torch.float64), ValueError, r"k must have q's shape \(2, 8, 2, 4\)"),
    ("v", torch.zeros(2, 7, 4, 3, dtype=torch.float64), ValueError, r"v must be \[B=2, T=8, Hv, V\], got \(2, 7, 4, 3\)"),
    ("v", torch.zeros(2, 8, 3, 3, dtype=torch.float64), ValueError, r"Hv = 3 .* multiple of the key heads Hk = 2"),
    ("g", torch.zeros(2, 8, 4, 4, dtype=torch.float64), ValueError, r"g must have shape \(2, 8, 4\), got \(2, 8, 4, 4\)"),
    ("beta", torch.zeros(2, 8, 2, dtype=torch.float64), ValueError, r"beta must have shape \(2, 8, 4\)"),
    ("q", torch.zeros(2, 8, 2, 4, dtype=torch.int64), TypeError, r"q must be float16, bfloat16, float32 or float64, got torch.int64"),
    ("v", torch.zeros(2, 8, 4, 3, dtype=torch.float32), TypeError, r"q, k, v must share a dtype"),
    ("q", torch.zeros(2, 8, 4, dtype=torch.float64), ValueError, r"q must have 4 dims, \[B, T, H, K\], got shape \(2, 8, 4\)"),
    ("initial_state", torch.zeros(3, 4, 4, 3, dtype=torch.float64), ValueError, r"initial_state must have shape \(2, 4, 4, 3\), got \(3, 4, 4, 3\)"),
    ("initial_state", torch.zeros(4, 4, 3, dtype=torch.float64), ValueError, r"initial_state must have shape \(2, 4, 4, 3\), got \(4, 4, 3\)"),
    ("chunk_size", 0, ValueError, r"chunk_size must be a positive finite int, got 0"),
    ("chunk_size", float("inf"), ValueError, r"chunk_size must be a positive finite int, got inf"),
    ("chunk_size", "64", TypeError, r"chunk_size must be a positive int, got str"),
    ("chunk_size", None, TypeError, r"chunk_size must be a positive int, got NoneType"),
    ("state_qdq_block_v", 0, ValueError, r"state_qdq_block_v must be a positive int, got 0"),
    ("scale", "1", TypeError, r"scale must be a float or None, got str"),
    ("cu_seqlens", torch.tensor([0, 8]), ValueError, r"with cu_seqlens the batch size must be 1, got B = 2"),
    ("initial_state", torch.zeros(2, 4, 4, 3, dtype=torch.float64, device="meta"), ValueError, r"initial_state is on meta but q is on cpu"),
]


@pytest.mark.parametrize("arg,value,error,message", BAD_GDN, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_GDN)])
def test_chunk_gdn_rejects(arg, value, error, message):
    with pytest.raises(error, match=message):
        _gdn(**{arg: value})


def test_cu_seqlens_checks():
    x = delta_inputs(B=1, T=8, K=4, V=3, N=2)
    with pytest.raises(TypeError, match=r"cu_seqlens must be int32 or int64, got torch.float32"):
        kdn_compile.chunk_gdn(**x, cu_seqlens=torch.tensor([0.0, 3.0, 8.0]))
    with pytest.raises(ValueError, match=r"cu_seqlens must be \[N \+ 1\] with N >= 1, got shape \(1,\)"):
        kdn_compile.chunk_gdn(**x, cu_seqlens=torch.tensor([0]))
    with pytest.raises(ValueError, match=r"initial_state must have shape \(3, 4, 4, 3\)"):
        kdn_compile.chunk_gdn(**x, cu_seqlens=torch.tensor([0, 2, 5, 8]))
    with pytest.raises(ValueError, match=r"cu_seqlens is on meta but q is on cpu"):
        kdn_compile.chunk_gdn(**x, cu_seqlens=torch.tensor([0, 3, 8], device="meta"))


def test_kda_and_recurrent_gate_rank():
    x = delta_inputs(T=8, K=4, V=3)
    with pytest.raises(ValueError, match=r"g must have shape \(2, 8, 4, 4\), got \(2, 8, 4\)"):
        kdn_compile.chunk_kda(**x)
    x["g"] = torch.zeros(2, 8, 4, 4, 1, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"g must have shape \(2, 8, 4\) or \(2, 8, 4, 4\)"):
        kdn_compile.recurrent_delta_rule(**x)
    x = delta_inputs(T=8, K=4, V=3, state_v_first=True)
    with pytest.raises(ValueError, match=r"initial_state must have shape \(2, 4, 4, 3\), got \(2, 4, 3, 4\)"):
        kdn_compile.recurrent_delta_rule(**x, state_v_first=False)


@pytest.mark.parametrize(
    "arg,shape,message",
    [
        ("k", (2, 9, 2, 8), r"k must have q's shape \(2, 9, 2, 4\)"),
        ("r", (2, 9, 2, 1), r"r must have 3 dims, \[B, T, H\], got shape \(2, 9, 2, 1\)"),
        ("precision", (2, 4), r"precision must have 3 dims, \[N, H, K\], got shape \(2, 4\)"),
        ("memory", (2, 4, 3), r"memory must have 4 dims, \[N, H, K, V\], got shape \(2, 4, 3\)"),
        ("r", (2, 9, 3), r"r must have shape \(2, 9, 2\) = \[B, T, H\], got \(2, 9, 3\)"),
        ("memory", (2, 2, 4, 5), r"memory must have shape \(2, 2, 4, 3\), got \(2, 2, 4, 5\)"),
        ("precision", (1, 2, 4), r"precision must have shape \(2, 2, 4\), got \(1, 2, 4\)"),
        ("v", (2, 9, 3, 3), r"v must be \[B=2, T=9, H=2, V\], got \(2, 9, 3, 3\)"),
    ],
)
def test_diag_kdn_rejects(arg, shape, message):
    x = kdn_inputs(T=9, K=4, V=3)
    x[arg] = torch.zeros(shape, dtype=torch.float64)
    with pytest.raises(ValueError, match=message):
        kdn_compile.diag_kdn(**x, scale=1.0, info_scale=1.0)


def test_state_fp8_qdq_rejects():
    with pytest.raises(ValueError, match=r"block_v must be a positive int, got -1"):
        kdn_compile.state_fp8_qdq(torch.zeros(4, 4), -1)
    with pytest.raises(ValueError, match=r"state must be \[..., K, V\], got shape \(4,\)"):
        kdn_compile.state_fp8_qdq(torch.zeros(4))
    with pytest.raises(TypeError, match=r"state must be float16, bfloat16, float32 or float64"):
        kdn_compile.state_fp8_qdq(torch.zeros(4, 4, dtype=torch.int32))


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


def test_zero_heads_flags_and_scalars():
    x = delta_inputs(B=1, T=4, Hk=1, Hv=1, K=4, V=3)
    x["q"] = x["k"] = torch.zeros(1, 4, 1, 0, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"at least one head and K >= 1, got shape \(1, 4, 1, 0\)"):
        kdn_compile.chunk_gdn(**{n: t for n, t in x.items() if n != "initial_state"})
    y = delta_inputs(T=4, K=4, V=3)
    with pytest.raises(TypeError, match=r"state_qdq must be a bool, got str"):
        kdn_compile.chunk_gdn(**y, state_qdq="yes")
    z = kdn_inputs(T=5, K=4, V=3)
    with pytest.raises(TypeError, match=r"scale must be a float, got NoneType"):
        kdn_compile.diag_kdn(**z, scale=None, info_scale=1.0)
    # chunk_size=None: an error naming the argument, not one from inside int(None)
    with pytest.raises(TypeError, match=r"chunk_size must be a positive int, got NoneType"):
        kdn_compile.diag_kdn(**z, scale=1.0, info_scale=1.0, chunk_size=None)
    w = delta_inputs(T=4, K=4, V=3)
    w["g"] = w["g"][..., None].expand(-1, -1, -1, 4).contiguous()
    with pytest.raises(TypeError, match=r"chunk_size must be a positive int, got NoneType"):
        kdn_compile.chunk_kda(**w, chunk_size=None)
    z["v"] = z["v"].float()
    with pytest.raises(TypeError, match=r"q, k, v must share a dtype"):
        kdn_compile.diag_kdn(**z, scale=1.0, info_scale=1.0)


def test_w_quantizer_result_is_checked():
    x = delta_inputs(T=8, K=4, V=3)
    with pytest.raises(ValueError, match=r"w_quantizer must return W's shape \(2, 8, 4, 4\)"):
        kdn_compile.chunk_gdn(**x, w_quantizer=lambda w: w[:, :4])
    with pytest.raises(TypeError, match=r"w_quantizer must return a float tensor, got NoneType"):
        kdn_compile.chunk_gdn(**x, w_quantizer=lambda w: None)


def test_scales_must_be_finite():
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
