"""Decode over state pools and the token-recurrence kernels, on the CPU.

The kernels run in Triton's interpreter (backend ``"triton"``, ``TRITON_INTERPRET=1``
from conftest) at tiny sizes against the exact references; the pool contract
(padding rows, untouched slots, repeated and out-of-range indices, float8 round trip)
is checked on both; validation errors name the argument.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kdn_compile
from _helpers import assert_close
from _inputs import delta_inputs, kdn_inputs
from kdn_compile import reference as ref
from kdn_compile.reference.fp8 import dequantize_state_fp8, quantize_state_fp8
from kdn_compile.reference.pools import diag_kdn_decode_reference

triton = pytest.importorskip("triton")

FP8 = torch.float8_e4m3fn


def _pool(slots, hv, dk, dv, dtype, seed=1, state_v_first=False):
    """A random pool (and its scales for float8) with its exact float32 content."""
    gen = torch.Generator().manual_seed(seed)
    state = torch.randn(slots, hv, dk, dv, generator=gen)
    scales = None
    if dtype == FP8:
        values, scales = quantize_state_fp8(state)
        state = dequantize_state_fp8(values, scales).contiguous()
        pool = values
    else:
        pool = state.to(dtype)
        state = pool.float()
    if state_v_first:
        pool = pool.transpose(-1, -2).contiguous()
    return pool, scales, state


def _decode_both(x, pool, scales, idx, **kw):
    """The decode step on the kernel and on the reference, each on its own pool copy."""
    out = {}
    for backend in ("triton", "reference"):
        p = pool.clone()
        s = None if scales is None else scales.clone()
        inter = kw.pop("inter_like", None)
        inter = None if inter is None else inter.clone()
        with kdn_compile.use_backend(backend):
            o = kdn_compile.delta_rule_decode(
                x["q"], x["k"], x["v"], x["g"], x["beta"], p, idx, pool_scales=s, **kw)
        out[backend] = (o, p, s)
    return out


def _as_float(pool, scales, state_v_first=False):
    if pool.dtype == FP8:
        pool = pool.transpose(-1, -2) if state_v_first else pool
        return dequantize_state_fp8(pool, scales)
    return (pool.transpose(-1, -2) if state_v_first else pool).float()


@pytest.mark.parametrize("per_key", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, FP8],
                         ids=["f32", "bf16", "fp8"])
@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
def test_decode_kernel_matches_reference(per_key, pool_dtype, state_v_first):
    """Kernel == reference: outputs, the named slots, untouched slots, padding rows,
    intermediate states (a partial value tile: V = 80 with 64-column float8 tiles)."""
    B, T, Hk, Hv, K, V, S = 3, 3, 1, 2, 8, 80, 5
    x = delta_inputs(B=B, T=T, Hk=Hk, Hv=Hv, K=K, V=V, per_key=per_key, dtype=torch.float32,
                     with_state=False, seed=3)
    pool, scales, start = _pool(S, Hv, K, V, pool_dtype, state_v_first=state_v_first)
    idx = torch.tensor([4, -1, 1])
    inter_shape = (B, T, Hv, V, K) if state_v_first else (B, T, Hv, K, V)
    results = {}
    for backend in ("triton", "reference"):
        p, s = pool.clone(), None if scales is None else scales.clone()
        inter = torch.full(inter_shape, 7.0)
        with kdn_compile.use_backend(backend):
            o = kdn_compile.delta_rule_decode(
                x["q"], x["k"], x["v"], x["g"], x["beta"], p, idx, pool_scales=s,
                state_v_first=state_v_first, intermediate_states=inter)
        results[backend] = o, _as_float(p, s, state_v_first), inter
    (o1, p1, i1), (o2, p2, i2) = results["triton"], results["reference"]
    assert_close(o1, o2, 1e-5, "o")
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, FP8: 7e-2}[pool_dtype]
    assert_close(p1, p2, tol, "pool")
    assert_close(i1, i2, 1e-5, "intermediate states")
    assert torch.equal(o1[1], torch.zeros_like(o1[1])), "a padding row must output zeros"
    assert torch.equal(i1[1], torch.full_like(i1[1], 7.0)), "a padding row writes no state"
    for slot in (0, 2, 3):
        assert torch.equal(p1[slot], start[slot]), f"slot {slot} is not named: untouched"
    # against float64: the oracle token loop from the dequantized slot
    for row, slot in ((0, 4), (2, 1)):
        sub = {n: t[row:row + 1].double() for n, t in x.items()}
        o64, s64 = ref.recurrent_delta_rule_reference(
            **sub, initial_state=start[slot:slot + 1].double())
        assert_close(o1[row:row + 1], o64, 1e-5, f"o row {row} vs float64")
        assert_close(p1[slot:slot + 1], s64, tol, f"slot {slot} vs float64")


def test_float8_store_is_bit_exact_on_the_same_state():
    """The kernel's float8 quantizer == quantize_state_fp8 bit for bit: a step that leaves
    the state as it is (beta = 0, g = 0) from a random float32 pool into a float8 one, an
    all-zero tile and a tile of subnormals among its tiles."""
    from kdn_compile.lowering.recurrent import recurrent_delta_fwd

    B, Hv, K, V = 4, 2, 16, 72
    x = delta_inputs(B=B, T=1, Hk=1, Hv=Hv, K=K, V=V, dtype=torch.float32, with_state=False)
    gen = torch.Generator().manual_seed(7)
    state = torch.randn(B, Hv, K, V, generator=gen) * torch.logspace(-12, 3, V)
    state[1, 0, :, :64] = 0.0  # an all-zero tile: scale 1
    # a tile of nonzero float32 subnormals: scale 1 too (amax * (1 / 448) is below 2^-126)
    tiny = torch.randn(K, V - 64, generator=gen, dtype=torch.float64) * 1e-43
    state[2, 1, :, 64:] = (tiny.sign() * tiny.abs().clamp_min(2e-45)).float()
    out = torch.empty(B, Hv, K, V, dtype=FP8)
    scales = torch.empty(B, Hv, 2)
    _, ok = recurrent_delta_fwd(x["q"], x["k"], x["v"], torch.zeros_like(x["g"]),
                        torch.zeros_like(x["beta"]), scale=0.5, state_in=state, state_out=out,
                        scales=scales, indices=torch.arange(B))
    values, expected_scales = quantize_state_fp8(state)
    assert bool(ok)
    assert torch.equal(scales, expected_scales)
    assert torch.equal(out.view(torch.uint8), values.view(torch.uint8))
    assert scales[1, 0, 0] == 1.0
    assert scales[2, 1, 1] == 1.0 and state[2, 1, :, 64:].abs().amax() > 0


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_float8_pool_round_trip_is_state_fp8_qdq(backend):
    """A float8 pool holds state_fp8_qdq_reference of the float32 pool's new state."""
    x = delta_inputs(B=2, T=2, Hk=1, Hv=2, K=8, V=70, dtype=torch.float32, with_state=False)
    pool8, scales, start = _pool(3, 2, 8, 70, FP8)
    pool32 = start.clone().contiguous()
    idx = torch.tensor([2, 0])
    with kdn_compile.use_backend(backend):
        kdn_compile.delta_rule_decode(*x.values(), pool8, idx, pool_scales=scales)
    with kdn_compile.use_backend("reference"):
        kdn_compile.delta_rule_decode(*x.values(), pool32, idx)
    expected = ref.state_fp8_qdq_reference(pool32[idx])
    got = dequantize_state_fp8(pool8, scales)
    assert torch.equal(got[1], start[1]), "a slot not named is untouched"
    if backend == "reference":  # the same float32 arithmetic: equal bit for bit
        assert torch.equal(got[idx], expected)
    else:
        assert_close(got[idx], expected, 7e-2, "kernel float8 pool")


def check_decayed_slot_is_written_as_fresh(backend, pool_dtype, seed, device="cpu", steps=40):
    """Decode slot 0 of a random pool for ``steps`` steps of ``g = -3``, ``beta = 0`` (its
    state shrinks by ``e^-3`` a step, through float32 subnormals to nothing; a float8
    tile's scale falls below ``2^-126`` and becomes 1), then write it and the fresh slot 2
    (zeros; float8 scales 1) in one step of ``beta > 0``, the same inputs on both rows.
    Every output and both slots stay finite; the write gives slot 0 what it gives the
    fresh slot, exactly: the same output, state and (float8) scales."""
    Hv, K, V = 2, 8, 80  # float8: a whole 64-column tile and a partial one
    pool, scales, _ = _pool(3, Hv, K, V, pool_dtype, seed=seed)
    pool[2].zero_()
    if scales is not None:
        scales[2] = 1.0
    pool = pool.to(device)
    scales = None if scales is None else scales.to(device)
    x = delta_inputs(B=1, T=steps + 1, Hk=1, Hv=Hv, K=K, V=V, dtype=torch.float32,
                     with_state=False, seed=seed)
    x["g"][:, :steps], x["beta"][:, :steps] = -3.0, 0.0
    x["beta"][:, steps] += 0.1
    x = {n: t.to(device) for n, t in x.items()}
    with kdn_compile.use_backend(backend):
        for t in range(steps):
            step = [u[:, t:t + 1] for u in x.values()]
            o = kdn_compile.delta_rule_decode(
                *step, pool, torch.tensor([0], device=device), pool_scales=scales)
            assert torch.isfinite(o).all(), f"output of decay step {t}"
            assert torch.isfinite(_as_float(pool, scales)[0]).all(), f"slot after step {t}"
        step = [u[:, steps:].expand(2, *[-1] * (u.dim() - 1)).contiguous() for u in x.values()]
        o = kdn_compile.delta_rule_decode(
            *step, pool, torch.tensor([0, 2], device=device), pool_scales=scales)
    written = _as_float(pool, scales)
    assert torch.isfinite(o).all() and torch.isfinite(written).all()
    assert torch.equal(o[0], o[1]), "the output of the write"
    assert torch.equal(written[0], written[2]), "the written state"
    assert written[2].abs().amax() > 0, "the write wrote something"
    if scales is not None:
        assert torch.equal(scales[0], scales[2]), "the written scales"


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, FP8],
                         ids=["f32", "bf16", "fp8"])
def test_a_slot_decayed_to_nothing_is_written_as_a_fresh_slot(backend, pool_dtype, seed):
    """:func:`check_decayed_slot_is_written_as_fresh` on the CPU: the reference, and the
    kernel in Triton's interpreter."""
    check_decayed_slot_is_written_as_fresh(backend, pool_dtype, seed)


@pytest.mark.parametrize("per_key", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("packed", [False, True], ids=["fixed", "packed"])
def test_recurrent_kernel_matches_float64(per_key, packed):
    """kdn::recurrent_delta_rule's kernel (grouped heads, K = 12 not a power of two, a
    bfloat16 initial state, value-major state) against the float64 token loop."""
    cu = torch.tensor([0, 5, 5, 13]) if packed else None
    x = delta_inputs(B=1 if packed else 2, T=13, Hk=2, Hv=4, K=12, V=40, per_key=per_key,
                     dtype=torch.float32, N=3 if packed else None, state_v_first=True)
    x["initial_state"] = x["initial_state"].to(torch.bfloat16)
    with kdn_compile.use_backend("triton"):
        o, s = kdn_compile.recurrent_delta_rule(**x, cu_seqlens=cu, state_v_first=True)
    o64, s64 = ref.recurrent_delta_rule_reference(
        **{n: t.double() for n, t in x.items()}, cu_seqlens=cu, state_v_first=True)
    assert s.dtype == torch.float32
    assert_close(o, o64, 1e-5, "o")
    assert_close(s, s64, 1e-5, "final state")
    o0, _ = kdn_compile.recurrent_delta_rule(
        **{n: t for n, t in x.items() if n != "initial_state"}, cu_seqlens=cu)
    with kdn_compile.use_backend("reference"):
        r0, _ = kdn_compile.recurrent_delta_rule(
            **{n: t for n, t in x.items() if n != "initial_state"}, cu_seqlens=cu)
    assert_close(o0, r0, 1e-5, "o from a zero state")


def test_recurrent_kernel_gradients_are_the_references():
    x = delta_inputs(B=2, T=5, Hk=1, Hv=2, K=8, V=6, per_key=True, dtype=torch.float32,
                     requires_grad=True)
    with kdn_compile.use_backend("triton"):
        o, s = kdn_compile.recurrent_delta_rule(**x)
    y = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    o64, s64 = ref.recurrent_delta_rule_reference(**y)
    gen = torch.Generator().manual_seed(2)
    go, gs = torch.randn(o.shape, generator=gen), torch.randn(s.shape, generator=gen)
    grads = torch.autograd.grad((o, s), list(x.values()), (go, gs))
    grads64 = torch.autograd.grad((o64, s64), list(y.values()), (go.double(), gs.double()))
    for name, a, b in zip(x, grads, grads64):
        assert_close(a, b, 1e-5, f"d{name}")


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_diag_kdn_decode_continues_the_chunked_pass(backend):
    """Prefill with diag_kdn, then decode steps over pools == one diag_kdn pass."""
    T0, steps = 9, (1, 3)
    x = kdn_inputs(B=2, T=T0 + sum(steps), H=2, K=8, V=6, dtype=torch.float32, N=2)
    full, mem_full, prec_full = kdn_compile.diag_kdn(**x, scale=0.3, info_scale=0.7,
                                                     chunk_size=4)
    seq = ("q", "k", "v", "log_alpha", "omega", "r")
    head = {n: x[n][:, :T0] for n in seq}
    o, mem, prec = kdn_compile.diag_kdn(**head, memory=x["memory"], precision=x["precision"],
                                        scale=0.3, info_scale=0.7, chunk_size=4)
    memory_pool = torch.zeros(4, 2, 8, 6)
    precision_pool = torch.ones(4, 2, 8)
    idx = torch.tensor([3, 1])
    memory_pool[idx], precision_pool[idx] = mem, prec
    outputs, t = [o], T0
    with kdn_compile.use_backend(backend):
        for n in steps:
            step = {name: x[name][:, t:t + n] for name in seq}
            outputs.append(kdn_compile.diag_kdn_decode(
                *step.values(), memory_pool, precision_pool, idx, scale=0.3, info_scale=0.7))
            t += n
    assert_close(torch.cat(outputs, 1), full, 1e-5, "outputs")
    assert_close(memory_pool[idx], mem_full, 1e-5, "memory")
    assert_close(precision_pool[idx], prec_full, 1e-5, "precision")
    assert torch.equal(memory_pool[0], torch.zeros(2, 8, 6))


def test_diag_kdn_decode_kernel_padding_and_bf16_memory():
    x = kdn_inputs(B=3, T=2, H=2, K=8, V=40, dtype=torch.float32, N=3)
    seq = [x[n] for n in ("q", "k", "v", "log_alpha", "omega", "r")]
    memory = torch.randn(4, 2, 8, 40).to(torch.bfloat16)
    precision = torch.rand(4, 2, 8) + 0.5
    idx = torch.tensor([2, -1, 0])
    results = []
    for backend in ("triton", "reference"):
        m, p = memory.clone(), precision.clone()
        with kdn_compile.use_backend(backend):
            o = kdn_compile.diag_kdn_decode(*seq, m, p, idx, scale=0.3, info_scale=0.7)
        results.append((o, m, p))
    (o1, m1, p1), (o2, m2, p2) = results
    assert_close(o1, o2, 1e-5, "o")
    assert_close(m1.float(), m2.float(), 1e-2, "bf16 memory")
    assert_close(p1, p2, 1e-5, "precision")
    assert torch.equal(o1[1], torch.zeros_like(o1[1]))
    for slot in (1, 3):
        assert torch.equal(m1[slot], memory[slot]) and torch.equal(p1[slot], precision[slot])
    o64 = diag_kdn_decode_reference(
        *(t.double() for t in seq), memory.double(), precision.double(), idx,
        scale=0.3, info_scale=0.7)
    assert_close(o1, o64, 1e-5, "o vs float64")


def test_repeated_or_out_of_range_indices_are_rejected_on_the_device():
    x = delta_inputs(B=3, T=1, Hk=1, Hv=2, K=4, V=3, dtype=torch.float32, with_state=False)
    pool = torch.zeros(4, 2, 4, 3)
    kdn_compile.delta_rule_decode(*x.values(), pool, torch.tensor([-1, -1, 2]))  # padding repeats
    for backend in ("triton", "reference"):
        with kdn_compile.use_backend(backend):
            for bad in ([1, 3, 1], [0, 4, 1], [-1, 3, 3]):
                with pytest.raises(RuntimeError, match="must not repeat a non-negative slot"):
                    kdn_compile.delta_rule_decode(*x.values(), pool.clone(), torch.tensor(bad))
    kd = kdn_inputs(B=2, T=1, H=2, K=4, V=3, dtype=torch.float32)
    seq = [kd[n] for n in ("q", "k", "v", "log_alpha", "omega", "r")]
    for backend in ("triton", "reference"):
        with kdn_compile.use_backend(backend), pytest.raises(RuntimeError, match="< the pool"):
            kdn_compile.diag_kdn_decode(*seq, torch.zeros(3, 2, 4, 3), torch.ones(3, 2, 4),
                                        torch.tensor([2, 2]), scale=0.5, info_scale=1.0)


def _bad(message, **change):
    x = delta_inputs(B=2, T=2, Hk=1, Hv=2, K=4, V=3, dtype=torch.float32, with_state=False)
    args = dict(x, state_pool=torch.zeros(3, 2, 4, 3), state_indices=torch.tensor([0, 1]))
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=message):
        kdn_compile.delta_rule_decode(**args)


def test_validation_names_the_argument():
    long = delta_inputs(B=2, T=9, Hk=1, Hv=2, K=4, V=3, dtype=torch.float32, with_state=False)
    _bad(r"1 <= T <= 8 tokens per row, got T = 9", **long)
    _bad(r"state_pool must be \[S, Hv, K, V\] = \(S, 2, 4, 3\), got \(3, 2, 3, 4\)",
         state_pool=torch.zeros(3, 2, 3, 4))
    _bad(r"state_pool must be float32, bfloat16, float8_e4m3fn, float64, got torch.float16",
         state_pool=torch.zeros(3, 2, 4, 3, dtype=torch.float16))
    _bad("state_pool must be contiguous", state_pool=torch.zeros(3, 2, 3, 4).transpose(-1, -2))
    _bad("state_indices must be int32 or int64, got torch.float32",
         state_indices=torch.tensor([0.0, 1.0]))
    _bad(r"state_indices must be \[B\] = \(2,\), got \(3,\)", state_indices=torch.tensor([0, 1, 2]))
    _bad("needs pool_scales", state_pool=torch.zeros(3, 2, 4, 3, dtype=FP8))
    _bad("pool_scales go with a float8_e4m3fn state_pool", pool_scales=torch.ones(3, 2, 1))
    _bad(r"pool_scales must be \[S, Hv, ceil\(V / 64\)\] = \(3, 2, 1\), got \(3, 2, 2\)",
         state_pool=torch.zeros(3, 2, 4, 3, dtype=FP8), pool_scales=torch.ones(3, 2, 2))
    _bad(r"intermediate_states must be \[B, T, Hv, K, V\] = \(2, 2, 2, 4, 3\)",
         intermediate_states=torch.zeros(2, 1, 2, 4, 3))
    _bad("intermediate_states must be float32, bfloat16, float64, got torch.float8_e4m3fn",
         intermediate_states=torch.zeros(2, 2, 2, 4, 3, dtype=FP8))
    _bad(r"g must have shape", g=torch.zeros(2, 2, 3))
    if torch.device("meta") != torch.device("cpu"):
        _bad("state_pool is on meta but q is on cpu",
             state_pool=torch.zeros(3, 2, 4, 3, device="meta"))
    kd = kdn_inputs(B=2, T=1, H=2, K=4, V=3, dtype=torch.float32)
    seq = [kd[n] for n in ("q", "k", "v", "log_alpha", "omega", "r")]
    with pytest.raises(ValueError, match=r"precision_pool must be \[S, H, K\] = \(3, 2, 4\)"):
        kdn_compile.diag_kdn_decode(*seq, torch.zeros(3, 2, 4, 3), torch.ones(2, 2, 4),
                                    torch.tensor([0, 1]), scale=0.5, info_scale=1.0)
    with pytest.raises(TypeError, match="memory_pool must be float32, bfloat16, float64"):
        kdn_compile.diag_kdn_decode(*seq, torch.zeros(3, 2, 4, 3, dtype=FP8), torch.ones(3, 2, 4),
                                    torch.tensor([0, 1]), scale=0.5, info_scale=1.0)


def test_decode_compiles_fullgraph_and_mutates_the_pool():
    """Under torch.compile(fullgraph=True) the pool is written as in eager mode."""
    x = delta_inputs(B=2, T=2, Hk=1, Hv=2, K=4, V=3, per_key=True, dtype=torch.float32,
                     with_state=False)
    pools = [_pool(3, 2, 4, 3, dtype)[:2] for dtype in (torch.float32, FP8)]

    def step(pool, scales, idx):
        return kdn_compile.delta_rule_decode(*x.values(), pool, idx, pool_scales=scales)

    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    idx = torch.tensor([2, -1])
    for pool, scales in pools:
        p1, s1 = pool.clone(), None if scales is None else scales.clone()
        p2, s2 = pool.clone(), None if scales is None else scales.clone()
        o1, o2 = step(p1, s1, idx), compiled(p2, s2, idx)
        assert_close(o2, o1, 1e-6, "o")
        assert torch.equal(p1.view(torch.uint8), p2.view(torch.uint8))
        assert not torch.equal(p2.view(torch.uint8)[2], pool.view(torch.uint8)[2])


def test_short_prefill_then_decode_equals_one_pass():
    """chunk_gdn over a prompt, then decode steps of 1 and 4 tokens over a pool == one pass."""
    x = delta_inputs(B=2, T=16, Hk=1, Hv=2, K=8, V=8, dtype=torch.float32)
    full, final = kdn_compile.chunk_gdn(**x, chunk_size=4)
    head = {n: (t[:, :11] if n != "initial_state" else t) for n, t in x.items()}
    o, state = kdn_compile.chunk_gdn(**head, chunk_size=4)
    pool = torch.zeros(5, 2, 8, 8)
    idx = torch.tensor([1, 4])
    pool[idx] = state
    outs, t = [o], 11
    with kdn_compile.use_backend("triton"):
        for n in (1, 4):
            step = {name: x[name][:, t:t + n] for name in ("q", "k", "v", "g", "beta")}
            outs.append(kdn_compile.delta_rule_decode(*step.values(), pool, idx))
            t += n
    assert_close(torch.cat(outs, 1), full, 1e-5, "outputs")
    assert_close(pool[idx], final, 1e-5, "state")
    assert F.mse_loss(pool[0], torch.zeros(2, 8, 8)) == 0


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_strided_indices_empty_batch_and_grad_inputs(backend):
    """Indices with a stride name the same slots as their contiguous copy; an empty batch is a
    no-op; inputs that require grad are refused before any pool is written."""
    x = delta_inputs(B=3, T=2, Hk=1, Hv=2, K=4, V=3, dtype=torch.float32, with_state=False)
    pool = torch.randn(6, 2, 4, 3)
    strided = torch.tensor([4, 0, -1, 5, 1, 3])[::2]  # [4, -1, 1]
    with kdn_compile.use_backend(backend):
        p1, p2 = pool.clone(), pool.clone()
        o1 = kdn_compile.delta_rule_decode(*x.values(), p1, strided)
        o2 = kdn_compile.delta_rule_decode(*x.values(), p2, strided.contiguous())
        assert torch.equal(o1, o2) and torch.equal(p1, p2)
        assert torch.equal(p1[[0, 2, 3, 5]], pool[[0, 2, 3, 5]])
        empty = {n: t[:0] for n, t in x.items()}
        for _ in range(20):  # the index flag of an empty launch must read as valid
            o = kdn_compile.delta_rule_decode(*empty.values(), p1, torch.zeros(0, dtype=torch.long))
        assert o.shape == (0, 2, 2, 3) and torch.equal(p1, p2)
        kd = kdn_inputs(B=2, T=1, H=2, K=4, V=3, dtype=torch.float32)
        seq = [kd[n] for n in ("q", "k", "v", "log_alpha", "omega", "r")]
        memory, precision = torch.randn(4, 2, 4, 3), torch.rand(4, 2, 4) + 0.5
        o1 = kdn_compile.diag_kdn_decode(*seq, memory.clone(), precision.clone(),
                                         torch.tensor([3, 9, 1])[::2], scale=0.5, info_scale=1.0)
        o2 = kdn_compile.diag_kdn_decode(*seq, memory.clone(), precision.clone(),
                                         torch.tensor([3, 1]), scale=0.5, info_scale=1.0)
        assert torch.equal(o1, o2)
        q = x["q"].clone().requires_grad_()
        with pytest.raises(RuntimeError, match="inference only, but q require grad"):
            kdn_compile.delta_rule_decode(q, *list(x.values())[1:], p1, strided)
        assert torch.equal(p1, p2)
        with torch.no_grad():
            kdn_compile.delta_rule_decode(q, *list(x.values())[1:], p1, strided)


def test_decode_with_intermediate_states_keeps_the_batch_dynamic_and_takes_none():
    """The argument checks do not specialize the batch (one graph for batches 2..5 under
    ``dynamic=True``), and an empty batch with intermediate states runs."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    def step(x, pool, idx, inter):
        return kdn_compile.delta_rule_decode(*x.values(), pool, idx, intermediate_states=inter)

    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=True)
    pool = torch.zeros(8, 1, 4, 4)
    for batch in (2, 3, 4, 5):
        x = delta_inputs(B=batch, T=1, Hk=1, Hv=1, K=4, V=4, dtype=torch.float32,
                         with_state=False, seed=batch)
        compiled(x, pool, torch.arange(batch), torch.zeros(batch, 1, 1, 4, 4))
    assert len(graphs) == 1, f"{len(graphs)} graphs"
    empty = delta_inputs(B=0, T=2, Hk=1, Hv=1, K=4, V=4, dtype=torch.float32, with_state=False)
    o = step(empty, pool, torch.zeros(0, dtype=torch.long), torch.zeros(0, 2, 1, 4, 4))
    assert o.shape == (0, 2, 1, 4)


def test_the_index_flag_is_kept_where_no_device_assert_is_compiled_in(monkeypatch):
    """The decode kernel checks its slot indices with a device assert; where none is
    compiled in (Triton's interpreter, an Inductor with ``assert_indirect_indexing`` off)
    it also writes the check into a flag that the op asserts on."""
    pytest.importorskip("triton")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kdn_compile.lowering import recurrent

    q = torch.zeros(2)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not recurrent._slot_flag(q)  # a direct launch of the debug-compiled kernel
    with FakeTensorMode() as mode:
        traced = mode.from_tensor(q)
        assert not recurrent._slot_flag(traced)  # Inductor compiles device asserts in
        with torch._inductor.config.patch(assert_indirect_indexing=False):
            assert recurrent._slot_flag(traced)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert recurrent._slot_flag(q)
