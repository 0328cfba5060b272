"""The references against each other: chunked == token loop, continuation, gradients."""

from __future__ import annotations

import math

import pytest
import torch

from _helpers import assert_close
from _inputs import delta_inputs, kdn_inputs
from kdn_compile import reference as ref

CASES = [
    pytest.param(dict(), id="base"),
    pytest.param(dict(T=70), id="T-not-multiple"),
    pytest.param(dict(Hk=1, Hv=4), id="grouped-values"),
    pytest.param(dict(state_v_first=True), id="state_v_first"),
    pytest.param(dict(with_state=False), id="no-initial-state"),
    pytest.param(dict(T=1), id="T1"),
]


@pytest.mark.parametrize("per_key", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("case", CASES)
def test_chunk_matches_recurrent(case, per_key):
    x = delta_inputs(per_key=per_key, **case)
    svf = case.get("state_v_first", False)
    chunk = ref.chunk_kda_reference if per_key else ref.chunk_gdn_reference
    o1, s1 = ref.recurrent_delta_rule_reference(**x, state_v_first=svf)
    o2, s2 = chunk(**x, chunk_size=16, state_v_first=svf)
    assert_close(o2, o1, 1e-12, "o")
    assert_close(s2, s1, 1e-12, "state")


def test_kda_with_one_decay_per_head_is_gdn():
    """KDA's per-key gate, equal across each head's K channels, is GDN's scalar gate."""
    x = delta_inputs(per_key=False, Hk=1, Hv=2, T=37)
    o_gdn, s_gdn = ref.chunk_gdn_reference(**x, chunk_size=16)
    g = x.pop("g")
    o_kda, s_kda = ref.chunk_kda_reference(
        **x, g=g[..., None].expand(*g.shape, x["k"].shape[-1]), chunk_size=16)
    assert_close(o_kda, o_gdn, 1e-12, "o")
    assert_close(s_kda, s_gdn, 1e-12, "state")


@pytest.mark.parametrize("per_key", [False, True], ids=["gdn", "kda"])
def test_varlen_equals_separate_sequences(per_key):
    lengths = [5, 0, 40, 19]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    x = delta_inputs(B=1, T=sum(lengths), per_key=per_key, N=len(lengths))
    chunk = ref.chunk_kda_reference if per_key else ref.chunk_gdn_reference
    o, s = chunk(**x, cu_seqlens=cu, chunk_size=16)
    o_loop, s_loop = ref.recurrent_delta_rule_reference(**x, cu_seqlens=cu)
    assert_close(o, o_loop, 1e-12, "varlen chunk vs loop")
    assert_close(s, s_loop, 1e-12, "varlen state")
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        one = {k_: t[:, a:b] for k_, t in x.items() if k_ != "initial_state"}
        o_n, s_n = chunk(**one, initial_state=x["initial_state"][n : n + 1], chunk_size=16)
        assert_close(o[:, a:b], o_n, 1e-12, f"sequence {n}") if b > a else None
        assert_close(s[n : n + 1], s_n, 1e-12, f"state {n}")


@pytest.mark.parametrize("per_key", [False, True], ids=["gdn", "kda"])
def test_prefill_split_continues_exactly(per_key):
    x = delta_inputs(T=50, per_key=per_key)
    chunk = ref.chunk_kda_reference if per_key else ref.chunk_gdn_reference
    o, s = chunk(**x, chunk_size=16)
    first = {k_: t[:, :23] for k_, t in x.items() if k_ != "initial_state"}
    second = {k_: t[:, 23:] for k_, t in x.items() if k_ != "initial_state"}
    o1, s1 = chunk(**first, initial_state=x["initial_state"], chunk_size=16)
    o2, s2 = ref.recurrent_delta_rule_reference(**second, initial_state=s1)
    assert_close(torch.cat([o1, o2], 1), o, 1e-12, "split output")
    assert_close(s2, s, 1e-12, "split state")


def test_w_quantizer_sees_whole_w_once():
    x = delta_inputs(T=40)
    calls = []

    def quantizer(w):
        calls.append(tuple(w.shape))
        return w

    o, s = ref.chunk_gdn_reference(**x, chunk_size=16, w_quantizer=quantizer)
    assert calls == [(2, 40, 4, 8)]
    o0, s0 = ref.chunk_gdn_reference(**x, chunk_size=16)
    assert_close(o, o0, 0.0, "identity quantizer")
    o_half, _ = ref.chunk_gdn_reference(**x, chunk_size=16, w_quantizer=lambda w: 0.5 * w)
    assert ref_error_large(o_half, o0)


def ref_error_large(a, b):
    return float((a - b).norm() / b.norm()) > 1e-3


def test_state_qdq_applies_to_every_chunk_state():
    x = delta_inputs(T=40, V=12)
    o, s = ref.chunk_gdn_reference(**x, chunk_size=16, state_qdq=True, state_qdq_block_v=8)
    # Spelled out: quantize the initial state, then each chunk's final state after its readout.
    state, outputs = ref.state_fp8_qdq_reference(x["initial_state"], 8), []
    for start in range(0, 40, 16):
        part = {n: t[:, start : start + 16] for n, t in x.items() if n != "initial_state"}
        o_c, state = ref.chunk_gdn_reference(**part, initial_state=state, chunk_size=16)
        outputs.append(o_c)
        state = ref.state_fp8_qdq_reference(state, 8)
    assert_close(o, torch.cat(outputs, 1), 1e-12, "output with state QDQ")
    assert_close(s, state, 1e-12, "final state with state QDQ")
    _, s0 = ref.chunk_gdn_reference(**x, chunk_size=16)
    assert ref_error_large(s, s0)


def test_fp8_qdq_tiles_and_gradient():
    gen = torch.Generator().manual_seed(1)
    state = torch.randn(3, 16, 20, generator=gen, dtype=torch.float64)
    state[1, :, 8:16] = 0.0  # one all-zero tile
    state[2, :, 16:] *= 1e4  # a large partial last tile
    out = ref.state_fp8_qdq_reference(state, 8)
    assert out.shape == state.shape and out.dtype == state.dtype
    assert torch.equal(out[1, :, 8:16], torch.zeros(16, 8, dtype=torch.float64))
    for b in range(3):
        for start in range(0, 20, 8):
            tile, qtile = state[b, :, start : start + 8], out[b, :, start : start + 8]
            amax = tile.abs().max()
            if amax == 0:
                continue
            scale = amax / 448.0
            # Values sit on the E4M3 grid of this tile's own scale ...
            grid = (qtile / scale).to(torch.float8_e4m3fn).to(torch.float64) * scale
            assert torch.allclose(grid, qtile, rtol=0, atol=1e-12 * float(amax))
            # ... the largest magnitude is kept, and the error is within E4M3's half-ulp.
            assert torch.isclose(qtile.abs().max(), amax, rtol=1e-12)
            assert ((qtile - tile).abs() <= 2.0 ** -4 * tile.abs() + scale * 2.0 ** -9).all()
    # Changing one tile leaves every other tile's result alone.
    bumped = state.clone()
    bumped[0, :, :8] *= 3
    again = ref.state_fp8_qdq_reference(bumped, 8)
    assert torch.equal(again[0, :, 8:], out[0, :, 8:]) and torch.equal(again[1:], out[1:])
    # Straight-through gradient: the identity.
    leaf = state.clone().requires_grad_()
    grad = torch.randn_like(state)
    ref.state_fp8_qdq_reference(leaf, 8).backward(grad)
    assert torch.equal(leaf.grad, grad)


@pytest.mark.parametrize("value_dim", [80, 200, 64, 3])
def test_fp8_state_quantization_compiles_as_it_runs(value_dim):
    """quantize_state_fp8 / dequantize_state_fp8 under torch.compile give the eager bytes,
    a partial last tile included (Inductor on the CPU once miscompiled it at V = 80: NaN
    and wrong values in the last 16 columns)."""
    from kdn_compile.reference.fp8 import dequantize_state_fp8, quantize_state_fp8

    seed = 7 + value_dim
    print(f"seed {seed}")
    state = 3 * torch.randn(3, 2, 16, value_dim, generator=torch.Generator().manual_seed(seed))
    state[0, 0] = 0.0  # an all-zero state: scale 1, zeros
    values, scales = quantize_state_fp8(state)
    torch._dynamo.reset()
    values_c, scales_c = torch.compile(quantize_state_fp8, fullgraph=True)(state)
    assert torch.equal(values_c.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(scales_c, scales)
    back = dequantize_state_fp8(values, scales)
    assert torch.equal(torch.compile(dequantize_state_fp8, fullgraph=True)(values, scales), back)
    assert ((back - state).abs() <= 2.0 ** -4 * state.abs() + scales.amax() * 2.0 ** -9).all()


def test_fp8_qdq_rejects_bad_arguments():
    with pytest.raises(ValueError, match="block_v"):
        ref.state_fp8_qdq_reference(torch.zeros(4, 4), 0)
    with pytest.raises(ValueError, match="state"):
        ref.state_fp8_qdq_reference(torch.zeros(4), 4)


# -- Diag-KDN ------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 29, 64, 100])
def test_diag_kdn_chunked_matches_recurrent(T):
    x = kdn_inputs(T=T)
    o1, m1, p1 = ref.diag_kdn_recurrent(**x, scale=0.3, info_scale=0.7)
    o2, m2, p2 = ref.diag_kdn_chunked(**x, scale=0.3, info_scale=0.7, chunk_size=16)
    assert_close(o2, o1, 1e-10, "output")
    assert_close(m2, m1, 1e-10, "memory")
    assert_close(p2, p1, 1e-10, "precision")


def test_diag_kdn_floors_memory_decay_only():
    x = kdn_inputs(T=20)
    x["log_alpha"] = x["log_alpha"] - 30.0  # far below log(1e-6)
    o1, m1, p1 = ref.diag_kdn_recurrent(**x, scale=1.0, info_scale=1.0)
    o2, m2, p2 = ref.diag_kdn_chunked(**x, scale=1.0, info_scale=1.0, chunk_size=8)
    assert_close(o2, o1, 1e-9, "output at the floor")
    assert_close(p2, p1, 1e-9, "precision at the floor")
    # The covariance forgets (alpha ~ e^-30): precision is set by the last step alone.
    step_p = ref.diag_kdn_step(*(x[n][:, -1] for n in ("q", "k", "v", "log_alpha", "omega", "r")),
                               m1, p1, scale=1.0, info_scale=1.0)[2]
    assert torch.isfinite(step_p).all()


def test_diag_kdn_prefill_then_decode_continues():
    x = kdn_inputs(T=40)
    o, m, p = ref.diag_kdn_chunked(**x, scale=0.5, info_scale=1.0, chunk_size=16)
    seq = ("q", "k", "v", "log_alpha", "omega", "r")
    first = {n: x[n][:, :31] for n in seq}
    o1, m1, p1 = ref.diag_kdn_chunked(**first, memory=x["memory"], precision=x["precision"],
                                      scale=0.5, info_scale=1.0, chunk_size=16)
    outs = [o1]
    for t in range(31, 40):
        ot, m1, p1 = ref.diag_kdn_step(*(x[n][:, t] for n in seq), m1, p1, scale=0.5,
                                       info_scale=1.0)
        outs.append(ot[:, None])
    assert_close(torch.cat(outs, 1), o, 1e-10, "prefill + decode")
    assert_close(m1, m, 1e-10, "memory")
    assert_close(p1, p, 1e-10, "precision")


def test_diag_kdn_reference_validates_like_the_delta_rule_references():
    # cu_seqlens ending before T must not drop the trailing tokens silently
    x = kdn_inputs(B=1, T=9, K=4, V=3, N=2)
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0, never decrease and end at T = 9"):
        ref.diag_kdn_reference(**x, scale=1.0, info_scale=1.0, cu_seqlens=torch.tensor([0, 3, 6]))
    x = kdn_inputs(B=2, T=9, K=4, V=3)
    with pytest.raises(ValueError, match=r"with cu_seqlens the batch size must be 1, got B = 2"):
        ref.diag_kdn_reference(**x, scale=1.0, info_scale=1.0, cu_seqlens=torch.tensor([0, 3, 9]))
    x["memory"] = x["memory"][:1]
    with pytest.raises(ValueError, match=r"memory must have shape \(2, 2, 4, 3\), got \(1, 2, 4, 3\)"):
        ref.diag_kdn_reference(**x, scale=1.0, info_scale=1.0)


def test_integral_float_chunk_size_is_taken_as_int():
    """``chunk_size=4.0`` passes the argument checks; the two-key references chunk by it as
    by ``4`` (GDN's did already)."""
    x = delta_inputs(B=1, T=9, Hk=1, Hv=1, K=4, V=3, per_key=True)
    assert torch.equal(ref.chunk_kda_reference(**x, chunk_size=4.0)[0],
                       ref.chunk_kda_reference(**x, chunk_size=4)[0])
    y = kdn_inputs(B=1, T=9, H=1, K=4, V=3)
    assert torch.equal(ref.diag_kdn_reference(**y, scale=0.5, info_scale=0.8, chunk_size=4.0)[0],
                       ref.diag_kdn_reference(**y, scale=0.5, info_scale=0.8, chunk_size=4)[0])


def test_mask_padding_leaves_state_untouched():
    x = kdn_inputs(B=2, T=12)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 7:] = False
    k, v, la, om = ref.mask_padding(mask, x["k"], x["v"], x["log_alpha"], x["omega"])
    _, m, p = ref.diag_kdn_chunked(x["q"], k, v, la, om, x["r"], x["memory"], x["precision"],
                                   scale=1.0, info_scale=1.0, chunk_size=4)
    short = {n: x[n][1:, :7] for n in ("q", "k", "v", "log_alpha", "omega", "r")}
    _, m7, p7 = ref.diag_kdn_recurrent(**short, memory=x["memory"][1:],
                                       precision=x["precision"][1:], scale=1.0, info_scale=1.0)
    assert_close(m[1:], m7, 1e-12, "memory after padding")
    assert_close(p[1:], p7, 1e-12, "precision after padding")


def test_kalman_noise_and_initial_state():
    H, K = 3, 4
    raw = torch.zeros(2, 5, H, K, dtype=torch.float64)
    la, om, r, prior = ref.kalman_noise(raw, raw, raw[..., 0], torch.zeros(H, dtype=torch.float64),
                                        torch.zeros(H * K, dtype=torch.float64),
                                        torch.full((H,), ref.initial_precision_logit(),
                                                   dtype=torch.float64))
    assert_close(la, torch.full_like(la, -math.log(2.0)), 1e-15, "log_alpha")
    assert_close(om, torch.full_like(om, math.log(2.0) + ref.OMEGA_MIN), 1e-15, "omega")
    assert_close(r, torch.full_like(r, math.log(2.0) + ref.R_MIN), 1e-15, "r")
    assert_close(prior, torch.full_like(prior, ref.INITIAL_PRECISION), 1e-15, "prior")
    memory, precision = ref.initial_state(prior, batch_size=2, key_dim=K, value_dim=5)
    assert memory.shape == (2, H, K, 5) and not memory.any()
    assert precision.shape == (2, H, K)
    assert_close(precision, torch.ones_like(precision), 1e-15, "initial precision")


# -- gradients of every reference -----------------------------------------------------


def _check(fn, inputs):
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("name", ["chunk_gdn", "chunk_kda", "recurrent"])
def test_gradcheck_delta_rule(name):
    x = delta_inputs(B=1, T=11, Hk=1, Hv=2, K=4, V=3, per_key=(name == "chunk_kda"),
                     requires_grad=True)
    fn = {
        "chunk_gdn": lambda *a: ref.chunk_gdn_reference(*a[:5], initial_state=a[5], chunk_size=4),
        "chunk_kda": lambda *a: ref.chunk_kda_reference(*a[:5], initial_state=a[5], chunk_size=4),
        "recurrent": lambda *a: ref.recurrent_delta_rule_reference(*a[:5], initial_state=a[5]),
    }[name]
    _check(fn, tuple(x.values()))


def test_gradcheck_diag_kdn_functions():
    x = kdn_inputs(B=1, T=9, H=1, K=3, V=2, requires_grad=True)
    seq = [x[n] for n in ("q", "k", "v", "log_alpha", "omega", "r", "memory", "precision")]
    _check(lambda *a: ref.diag_kdn_chunked(*a, scale=0.5, info_scale=0.8, chunk_size=4), seq)
    _check(lambda *a: ref.diag_kdn_recurrent(*a, scale=0.5, info_scale=0.8), seq)
    _check(lambda *a: ref.diag_kdn_step(*(t[:, 0] if t.dim() > 3 or i == 5 else t
                                         for i, t in enumerate(a[:6])), a[6], a[7],
                                       scale=0.5, info_scale=0.8), seq)
    _check(lambda k, la, om, r, p: ref.kalman_gain(k, la, om, r, p, info_scale=0.8),
           (x["k"], x["log_alpha"], x["omega"], x["r"], x["precision"]))
    gain = x["k"].detach().clone().requires_grad_()
    _check(lambda q, k, v, la, g, m: ref.chunked_memory(q, k, v, la, g, m, scale=0.5, chunk_size=4),
           (x["q"], x["k"], x["v"], x["log_alpha"], gain, x["memory"]))


def test_gradcheck_front_end():
    gen = torch.Generator().manual_seed(3)
    H, K = 2, 3
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64, requires_grad=True)  # noqa
    _check(ref.kalman_noise, (r(1, 4, H, K), r(1, 4, H, K), r(1, 4, H), r(H), r(H * K), r(H)))
    _check(ref.normalize_query_key, (r(1, 4, H, K), r(1, 4, H, K)))


def test_fp8_qdq_small_half_state_and_long_chunks():
    small = torch.tensor([[1e-5, 0.0]], dtype=torch.float16)
    out = ref.state_fp8_qdq_reference(small, 2)
    assert torch.isfinite(out).all() and out[0, 1] == 0 and out[0, 0] > 0
    assert ref.state_fp8_qdq_reference(torch.zeros(2, 0, 4), 2).shape == (2, 0, 4)
    # chunk_size far beyond T computes the same as one chunk of length T, cheaply.
    x = delta_inputs(T=8)
    o_big, s_big = ref.chunk_gdn_reference(**x, chunk_size=2**20)
    o_one, s_one = ref.chunk_gdn_reference(**x, chunk_size=8)
    assert_close(o_big, o_one, 1e-13, "huge chunk")
    assert_close(s_big, s_one, 1e-13, "huge chunk state")
