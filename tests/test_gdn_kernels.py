"""GDN Triton kernels (lowering/chunk_gdn_*.py) against the float64 reference.

CPU: the kernels run under ``TRITON_INTERPRET=1`` (set by conftest.py before any
kernel import) at tiny sizes: forward and every gradient, odd lengths, packed
sequences, grouped value heads, initial state, value-major states. Outputs are
poisoned with NaN first, so an element the kernels never write fails.
GPU (skipped without CUDA): fresh random inputs, bf16 and float32 tolerances,
gates near zero and strongly negative, lengths up to 32768.
"""

from __future__ import annotations

import pytest
import torch

from kdn_compile.lowering.chunk_gdn_bwd import chunk_gdn_bwd
from kdn_compile.lowering.chunk_gdn_fwd import (
    chunk_gdn_fwd, gdn_kernel_supports, qdq_tile_width,
)
from kdn_compile.reference import chunk_gdn_reference
from tests._helpers import (
    assert_close, count_calls, gpu, kernels, poisoned as _poisoned, slow,
)
from tests._inputs import delta_inputs

CUDA = torch.cuda.is_available()
GRADS = ("q", "k", "v", "g", "beta", "initial_state")


def _check(x, cu_seqlens, *, state_v_first, tol, with_dht=True, seed=1, qdq=None,
           state_tol=None):
    """Kernels vs float64 reference on ``x`` (``delta_inputs``; no initial state where it has
    none): o, final state (within ``state_tol``, default ``tol``) and every gradient;
    ``qdq``: the ``state_qdq_block_v`` of FP8 state quantization (None: none). Returns the
    final state."""
    x = dict(x, initial_state=x.get("initial_state"))
    scale = x["q"].shape[-1] ** -0.5
    options = dict(chunk_size=64, scale=scale, state_v_first=state_v_first,
                   state_qdq=qdq is not None, state_qdq_block_v=qdq or 64)
    with _poisoned():
        o, ht, *prepared = chunk_gdn_fwd(
            x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], cu_seqlens, **options
        )
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o)
    dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(ht) if with_dht else None
    with _poisoned():
        grads = chunk_gdn_bwd(
            x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], cu_seqlens, do, dht,
            prepared=prepared, **options,
        )
    leaves = {n: (t.detach().double().requires_grad_() if t is not None else None)
              for n, t in x.items()}
    ro, rh = chunk_gdn_reference(
        leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
        initial_state=leaves["initial_state"], cu_seqlens=cu_seqlens, **options,
    )
    loss = (ro * do.double()).sum()
    if with_dht:
        loss = loss + (rh * dht.double()).sum()
    wrt = [n for n in GRADS if leaves[n] is not None]
    expected = dict(zip(wrt, torch.autograd.grad(loss, [leaves[n] for n in wrt])))
    assert o.dtype == x["v"].dtype and ht.dtype == torch.float32
    assert_close(o, ro, tol, "o")
    assert_close(ht, rh, tol if state_tol is None else state_tol, "final state")
    for name, grad in zip(GRADS, grads):
        if leaves[name] is None:
            assert grad is None, name
            continue
        assert grad.dtype == x[name].dtype, name
        assert_close(grad, expected[name], _grad_tol(name, x[name].dtype, tol), f"d{name}")
    return ht


def _grad_tol(name: str, dtype: torch.dtype, tol: float) -> float:
    """``dg`` in half precision gets twice ``tol`` (as FLA's tests): each gate's gradient is
    a difference of products summed over the key, so with few tokens one cancelling term
    dominates its error (bf16, 1 x 300 x 1 head, K 64, V 128 on the H200: 1.27e-2 in one
    run of four, each with its own seed; below 1e-2 in the others)."""
    return 2 * tol if name == "g" and dtype != torch.float32 else tol


# -- CPU (interpreter) ---------------------------------------------------------------------

CPU_CASES = [
    # id, B, T, Hk, Hv, K, V, cu_seqlens, with_state, state_v_first
    pytest.param(1, 1, 1, 1, 16, 16, None, True, False, id="T1"),
    pytest.param(1, 63, 1, 1, 16, 32, None, False, False, id="T63-no-state"),
    pytest.param(2, 65, 1, 2, 32, 16, None, True, True, id="T65-grouped-vfirst"),
    pytest.param(1, 100, 2, 2, 16, 16, [0, 1, 37, 100], True, False, id="varlen-3"),
    pytest.param(1, 100, 1, 2, 16, 16, [0, 0, 64, 100], True, True, id="varlen-empty-grouped"),
    pytest.param(1, 120, 1, 1, 16, 16, [0, 1, 2, 5, 9, 14, 20, 27, 35, 44, 54, 65, 77, 90, 104, 119,
                                         120], True, False, id="varlen-16-short"),
]


@kernels
@pytest.mark.parametrize("B,T,Hk,Hv,K,V,cu,with_state,state_v_first", CPU_CASES)
def test_kernels_match_reference(B, T, Hk, Hv, K, V, cu, with_state, state_v_first):
    device = "cuda" if CUDA else "cpu"
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
    N = B if cu is None else len(cu) - 1
    x = delta_inputs(B, T, Hk, Hv, K, V, N=N, dtype=torch.float32, device=device, seed=T + Hv,
                with_state=with_state, state_v_first=state_v_first)
    _check(x, cu_seqlens, state_v_first=state_v_first, tol=1e-4, with_dht=with_state)


@kernels
def test_kernels_match_reference_fp16():
    """The half path (fp16 products, fp32 accumulation). The interpreter's bf16 ``tl.dot`` is
    wrong (Triton 3.9 on torch 2.13 CPU), so bf16 is checked on the GPU only."""
    device = "cuda" if CUDA else "cpu"
    cu_seqlens = torch.tensor([0, 30, 100], dtype=torch.int32, device=device)
    x = delta_inputs(1, 100, 1, 2, 64, 64, N=2, dtype=torch.float16, device=device, seed=7)
    _check(x, cu_seqlens, state_v_first=False, tol=1e-2)


@kernels
@pytest.mark.parametrize("cu,qdq", [(None, None), ([0, 1, 37, 100], None), (None, 16)],
                         ids=["fixed", "varlen", "qdq"])
def test_grad_kernel_key_tiles(monkeypatch, cu, qdq):
    """The grad kernel with the keys split into 16-wide tiles (K = 32: two), as at K >= 128:
    the per-tile parts of ``dg`` and ``dbeta`` summed, ``dq``, ``dk`` tile by tile; grouped
    value heads, packed sequences and the saved float8 states of QDQ."""
    from kdn_compile.lowering import chunk_gdn_bwd as bwd

    real = bwd.grad_config
    monkeypatch.setattr(bwd, "grad_config", lambda k, v, dt: (16, *real(k, v, dt)[1:]))
    device = "cuda" if CUDA else "cpu"
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
    N = 1 if cu is None else len(cu) - 1
    x = delta_inputs(1, 100, 1, 2, 32, 32, N=N, dtype=torch.float32, device=device, seed=5)
    _check(x, cu_seqlens, state_v_first=False, tol=1e-4, qdq=qdq)


QDQ_CASES = [
    # id, B, T, Hk, Hv, K, V, cu_seqlens, with_state, state_v_first, state_qdq_block_v
    pytest.param(1, 70, 1, 2, 16, 32, None, True, False, 16, id="T70-grouped-2-tiles"),
    pytest.param(2, 65, 1, 2, 32, 16, None, True, True, 64, id="T65-vfirst-tile-wider-than-V"),
    pytest.param(1, 100, 1, 2, 16, 32, [0, 0, 64, 100], True, True, 16, id="varlen-empty-vfirst"),
    pytest.param(1, 63, 1, 1, 16, 32, None, False, False, 32, id="T63-no-state"),
]


@kernels
@pytest.mark.parametrize("B,T,Hk,Hv,K,V,cu,with_state,state_v_first,block_v", QDQ_CASES)
def test_state_qdq_kernels_match_reference(B, T, Hk, Hv, K, V, cu, with_state, state_v_first,
                                           block_v):
    """FP8 state QDQ (initial state, each chunk's final state after its readout): forward and
    every gradient (straight-through) against ``chunk_gdn_reference(..., state_qdq=True)``
    in float64. The backward reads the forward's float8 chunk states."""
    from kdn_compile.reference import state_fp8_qdq_reference
    from tests._helpers import rel_error

    device = "cuda" if CUDA else "cpu"
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
    N = B if cu is None else len(cu) - 1
    x = delta_inputs(B, T, Hk, Hv, K, V, N=N, dtype=torch.float32, device=device, seed=T + Hv,
                with_state=with_state, state_v_first=state_v_first)
    ht = _check(x, cu_seqlens, state_v_first=state_v_first, tol=1e-4, with_dht=with_state,
                qdq=block_v)
    # the final state is one of E4M3 (a no-op QDQ would fail here, not only above)
    key_first = ht.transpose(-1, -2) if state_v_first else ht
    assert_close(state_fp8_qdq_reference(key_first, block_v), key_first, 1e-6, "on the grid")
    plain = chunk_gdn_reference(*(x[n].double() for n in ("q", "k", "v", "g", "beta")),
                                initial_state=x.get("initial_state"), cu_seqlens=cu_seqlens,
                                state_v_first=state_v_first)[1]
    assert rel_error(ht, plain) > 1e-3


@kernels
def test_state_qdq_backward_recomputes_the_same_states():
    """The backward's recomputed float8 chunk states and scales are those the forward
    quantized (kept here as the ``w_quantizer`` path's forward keeps them), bit for bit,
    and with them delta."""
    from kdn_compile.lowering.chunk_gdn_fwd import (
        _recurrence, gdn_layout, gdn_prepare, gdn_recompute_states,
    )

    device = "cuda" if CUDA else "cpu"
    for B, T, K, V, block_v in ((1, 70, 16, 32, 16), (2, 130, 32, 64, 64)):
        x = delta_inputs(B, T, 1, 2, K, V, N=B, dtype=torch.float32, device=device, seed=4)
        q, k, v, beta, h0 = (x[n] for n in ("q", "k", "v", "beta", "initial_state"))
        layout = gdn_layout(q, v, None)
        gc, ai, aqk = gdn_prepare(q, k, x["g"], beta, None, layout)
        _, _, hs, scales = _recurrence(
            q, k, v, gc, beta, ai, aqk, h0, None, layout, scale=0.25, state_v_first=False,
            recompute=False, qdq_block_v=block_v, keep_states=True)
        hs2, scales2, delta = gdn_recompute_states(
            x["k"], x["v"], gc, x["beta"], ai, x["initial_state"], None, layout,
            state_v_first=False, qdq_block_v=block_v, deltas=True)
        assert torch.equal(hs.view(torch.uint8), hs2.view(torch.uint8)), (B, T, K, V)
        assert torch.equal(scales, scales2), (B, T, K, V)
        assert delta.shape == x["v"].shape and bool(delta.isfinite().all())


def test_supports():
    x = delta_inputs(1, 8, 1, 2, 64, 128, N=1, dtype=torch.bfloat16, device="cpu", seed=0)
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "initial_state")] + [None]
    assert gdn_kernel_supports(*args, 64)
    assert not gdn_kernel_supports(*args, 32)
    # every power of two in [16, 256], each dtype (checked on the H200: diagnose_gdn.py)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for dims in ((16, 16), (32, 16), (256, 256), (128, 256), (16, 256)):
            h = delta_inputs(1, 8, 1, 1, *dims, N=1, dtype=dtype, device="cpu", seed=0)
            assert gdn_kernel_supports(*[h[n] for n in GRADS], None, 64), (dtype, dims)
    for dims in ((512, 64), (64, 8)):
        h = delta_inputs(1, 8, 1, 1, *dims, N=1, dtype=torch.bfloat16, device="cpu", seed=0)
        assert not gdn_kernel_supports(*[h[n] for n in GRADS], None, 64), dims
    # FP8 state QDQ: one program per [K, block_v] scale tile of a power of two of columns
    assert gdn_kernel_supports(*args, 64, state_qdq=True, state_qdq_block_v=256)  # V = 128
    for block_v in (8, 48):  # too narrow for tl.dot, not a power of two
        assert not gdn_kernel_supports(*args, 64, state_qdq=True, state_qdq_block_v=block_v)
    assert qdq_tile_width(128, 128, 64, torch.bfloat16) == 64
    assert qdq_tile_width(128, 128, 64, torch.float32) is None  # 32 KiB of float32
    assert qdq_tile_width(256, 256, 32, torch.bfloat16) == 32
    assert qdq_tile_width(256, 256, 64, torch.bfloat16) is None
    y = delta_inputs(1, 8, 1, 1, 24, 32, N=1, dtype=torch.float32, device="cpu", seed=0)
    assert not gdn_kernel_supports(*[y[n] for n in GRADS], None, 64)
    z = delta_inputs(1, 8, 1, 1, 16, 16, N=1, dtype=torch.float64, device="cpu", seed=0)
    assert not gdn_kernel_supports(*[z[n] for n in GRADS], None, 64)


# -- GPU ------------------------------------------------------------------------------------

BF16, HALF, FP32 = (torch.bfloat16, 1e-2), (torch.float16, 1e-2), (torch.float32, 1e-3)
GPU_CASES = [
    # dtype and tolerance, B, T, Hk, Hv, K, V, cu_seqlens, gate_scale
    pytest.param(*BF16, 2, 1000, 2, 4, 128, 128, None, 1.0, id="bf16-grouped"),
    pytest.param(*FP32, 2, 1000, 2, 4, 128, 128, None, 1.0, id="fp32-grouped", marks=slow),
    pytest.param(*BF16, 1, 32768, 1, 2, 128, 128, None, 0.05, id="bf16-T32768-gates-near-zero",
                 marks=slow),
    pytest.param(*FP32, 1, 8192, 1, 1, 128, 128, None, 0.05, id="fp32-T8192-gates-near-zero",
                 marks=slow),
    pytest.param(*BF16, 1, 3000, 2, 2, 64, 64, [0, 5, 700, 701, 2999, 3000], 20.0,
                 id="bf16-varlen-strong-gates"),
    pytest.param(*FP32, 1, 3000, 2, 2, 64, 64, [0, 5, 700, 701, 2999, 3000], 20.0,
                 id="fp32-varlen-strong-gates", marks=slow),
    pytest.param(*BF16, 1, 300, 1, 1, 64, 128, None, 1.0, id="bf16-K64-V128"),
    pytest.param(*FP32, 1, 300, 1, 1, 32, 128, None, 1.0, id="fp32-K32-V128", marks=slow),
    # sizes where Triton 3.6 miscompiles some launch configurations on Hopper (full tier)
    pytest.param(*BF16, 2, 300, 1, 2, 256, 256, None, 1.0, id="bf16-K256-V256", marks=slow),
    pytest.param(*HALF, 1, 500, 2, 2, 32, 16, [0, 100, 500], 1.0, id="fp16-K32-V16-varlen",
                 marks=slow),
    pytest.param(*BF16, 1, 300, 1, 1, 16, 64, None, 1.0, id="bf16-K16-V64", marks=slow),
    pytest.param(*HALF, 1, 300, 1, 1, 256, 128, None, 1.0, id="fp16-K256-V128", marks=slow),
    pytest.param(*BF16, 1, 300, 1, 1, 64, 16, None, 1.0, id="bf16-K64-V16", marks=slow),
]


@gpu
@pytest.mark.parametrize("dtype,tol,B,T,Hk,Hv,K,V,cu,gate_scale", GPU_CASES)
def test_kernels_gpu(dtype, tol, B, T, Hk, Hv, K, V, cu, gate_scale, seed):
    """Fresh random inputs each run (fp32 kernels use exact fp32 products, no tf32)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32, device="cuda")
    N = B if cu is None else len(cu) - 1
    x = delta_inputs(B, T, Hk, Hv, K, V, N=N, dtype=dtype, device="cuda", seed=seed,
                gate_scale=gate_scale, state_v_first=K == 64)
    _check(x, cu_seqlens, state_v_first=K == 64, tol=tol, seed=seed + 1)


def test_recurrence_config_tiers(monkeypatch):
    """At K = V = 128 in half precision the sequential passes take 64-wide tiles while those
    fill the GPU's multiprocessors, then 32-wide, then 16-wide; a symbolic count of
    sequences x heads takes the wide ones."""
    from kdn_compile.lowering import chunk_gdn_fwd as fwd_module

    monkeypatch.setattr(fwd_module, "sm_count", lambda device: 132)
    config = lambda seq_heads: fwd_module.recurrence_config(  # noqa: E731
        128, 128, torch.bfloat16, seq_heads, "cuda", "forward")
    assert config(128) == config(66) == fwd_module._WIDE["forward"]
    assert config(65) == config(33) == fwd_module._MIDDLE
    assert config(32) == config(1) == fwd_module._NARROW
    assert fwd_module.recurrence_config(128, 128, torch.bfloat16, 64, "cuda", "state") \
        == fwd_module._MIDDLE
    assert [c[0] for c in (fwd_module._WIDE["forward"], fwd_module._MIDDLE,
                           fwd_module._NARROW)] == [64, 32, 16]


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cu", [None, [0, 5, 700, 701, 1400]], ids=["fixed", "packed"])
@pytest.mark.parametrize("tier", ["wide", "middle", "narrow"])
def test_kernels_gpu_measured_configs(monkeypatch, dtype, cu, tier, seed):
    """K = V = 128 in half precision under each of ``recurrence_config``'s measured choices,
    whatever this GPU's size: the wide per-pass tiles (``sm_count`` 1, so every grid counts
    as many programs), the middle ones (``sm_count`` three programs per sequence and head)
    and the narrow ones (a huge ``sm_count``); with the whole-key tiles of ``grad_config``."""
    from kdn_compile.lowering import chunk_gdn_fwd as fwd_module

    seq_heads = 4 * (2 if cu is None else len(cu) - 1)
    sms = {"wide": 1, "middle": 3 * seq_heads, "narrow": 10**6}[tier]
    monkeypatch.setattr(fwd_module, "sm_count", lambda device: sms)
    expected = {"wide": fwd_module._WIDE["forward"], "middle": fwd_module._MIDDLE,
                "narrow": fwd_module._NARROW}[tier]
    assert fwd_module.recurrence_config(128, 128, dtype, seq_heads, "cuda", "forward") == expected
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32, device="cuda")
    B, T, N = (2, 700, 2) if cu is None else (1, cu[-1], len(cu) - 1)
    x = delta_inputs(B, T, 2, 4, 128, 128, N=N, dtype=dtype, device="cuda", seed=seed)
    _check(x, cu_seqlens, state_v_first=False, tol=1e-2, seed=seed + 1)


@kernels
def test_op_kernel_path_autograd():
    """kdn_compile.chunk_gdn takes the kernels (fp32, chunk 64) and its autograd matches."""
    import kdn_compile
    from kdn_compile.ops import gdn as gdn_ops

    import kdn_compile.lowering.chunk_gdn_bwd as bwd_module

    device = "cuda" if CUDA else "cpu"
    x = delta_inputs(1, 70, 1, 2, 16, 16, N=1, dtype=torch.float32, device=device, seed=3)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    with pytest.MonkeyPatch.context() as patch, kdn_compile.use_backend("triton"):
        calls = count_calls(patch, gdn_ops, ("chunk_gdn_fwd", "chunk_gdn_bwd"))
        prepares = count_calls(patch, bwd_module, ("gdn_prepare",))
        o, ht = kdn_compile.chunk_gdn(**leaves)
        (o.sum() + ht.square().sum()).backward()
    assert calls == ["chunk_gdn_fwd", "chunk_gdn_bwd"]
    assert prepares == [], "the backward reuses the forward's gates, (I + A)^-1 and M"
    ref = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    ro, rh = chunk_gdn_reference(**ref)
    (ro.sum() + rh.square().sum()).backward()
    assert_close(o.detach(), ro, 1e-4, "o")
    for name in GRADS:
        assert_close(leaves[name].grad, ref[name].grad, 1e-4, f"d{name}")
