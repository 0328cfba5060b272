"""Decode kernels on CUDA against float64: every pool dtype, T = 1..8, intermediate states,
the token recurrence at length, and CUDA-graph replay. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import kdn_compile
from _helpers import assert_close, slow
from _inputs import delta_inputs, kdn_inputs
from kdn_compile import reference as ref
from kdn_compile.reference.fp8 import dequantize_state_fp8, quantize_state_fp8
from kdn_compile.reference.pools import diag_kdn_decode_reference

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn
POISON = float("nan")
# the inputs of a decode step (``delta_inputs``): gates in (-2, 0], the states in a pool
STEP = dict(gate_scale=2.0, with_state=False, device="cuda")


def _start_pool(S, Hv, K, V, pool_dtype, seed, state_v_first):
    gen = torch.Generator().manual_seed(seed)
    state = torch.randn(S, Hv, K, V, generator=gen, dtype=torch.float64).float().cuda()
    scales = None
    if pool_dtype == FP8:
        pool, scales = quantize_state_fp8(state)
        state = dequantize_state_fp8(pool, scales)
    else:
        pool = state.to(pool_dtype)
        state = pool.float().clone()  # not the pool itself: it is updated in place
    if state_v_first:
        pool = pool.transpose(-1, -2).contiguous()
    return pool, scales, state


@pytest.mark.parametrize("T", [1, *(pytest.param(t, marks=slow) for t in range(2, 8)), 8])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, FP8],
                         ids=["f32", "bf16", "fp8"])
@pytest.mark.parametrize("per_key", [False, True], ids=["gdn", "kda"])
def test_decode_against_float64(T, pool_dtype, per_key):
    B, Hk, Hv, K, V, S = 6, 2, 4, 128, 128, 11
    state_v_first = T % 2 == 0
    x = delta_inputs(B, T, Hk, Hv, K, V, per_key=per_key, dtype=torch.bfloat16, seed=T, **STEP)
    pool, scales, start = _start_pool(S, Hv, K, V, pool_dtype, T, state_v_first)
    idx = torch.tensor([7, -1, 0, 3, -1, 10], device="cuda", dtype=torch.int32)
    shape = (B, T, Hv, V, K) if state_v_first else (B, T, Hv, K, V)
    inter = torch.full(shape, POISON, device="cuda")
    before = pool.clone()
    o = kdn_compile.delta_rule_decode(*x.values(), pool, idx, pool_scales=scales,
                                      state_v_first=state_v_first, intermediate_states=inter)
    torch.cuda.synchronize()
    after = pool.transpose(-1, -2) if state_v_first else pool
    after = dequantize_state_fp8(after, scales) if pool_dtype == FP8 else after.float()
    every = inter.transpose(-1, -2) if state_v_first else inter
    tol = {torch.float32: 2e-5, torch.bfloat16: 1e-2, FP8: 7e-2}[pool_dtype]
    for row, slot in enumerate(idx.tolist()):
        if slot < 0:
            assert torch.equal(o[row], torch.zeros_like(o[row]))
            assert torch.isnan(inter[row]).all(), "a padding row writes no intermediate state"
            continue
        sub = {n: t[row:row + 1].double() for n, t in x.items()}
        o64, s64 = ref.recurrent_delta_rule_reference(
            **sub, initial_state=start[slot:slot + 1].double())
        assert_close(o[row:row + 1], o64, 1e-2, f"o row {row}")
        assert_close(after[slot:slot + 1], s64, tol, f"slot {slot}")
        assert_close(every[row, -1:], s64, 2e-5, f"last intermediate state row {row}")
    for slot in set(range(S)) - set(idx.tolist()):
        assert torch.equal(pool[slot].view(torch.uint8), before[slot].view(torch.uint8))


@pytest.mark.parametrize("per_key", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_recurrent_kernel_at_length_against_float64(per_key, dtype):
    x = delta_inputs(1, 300, 2, 4, 128, 64, per_key=per_key, dtype=dtype, seed=11, **STEP)
    h0 = torch.randn(3, 4, 128, 64, device="cuda")
    cu = torch.tensor([0, 100, 101, 300], device="cuda")
    o, s = kdn_compile.recurrent_delta_rule(*x.values(), initial_state=h0, cu_seqlens=cu)
    o64, s64 = ref.recurrent_delta_rule_reference(
        *(t.double() for t in x.values()), initial_state=h0.double(), cu_seqlens=cu)
    assert_close(o, o64, 1e-2 if dtype == torch.bfloat16 else 2e-5, "o")
    assert_close(s, s64, 1e-2 if dtype == torch.bfloat16 else 2e-5, "final state")


def test_float8_store_bit_exact_on_the_gpu():
    from kdn_compile.lowering.recurrent import recurrent_delta_fwd

    x = delta_inputs(8, 1, 2, 4, 128, 128, dtype=torch.bfloat16, seed=5, **STEP)
    state = torch.randn(8, 4, 128, 128, device="cuda") * torch.logspace(-12, 3, 128, device="cuda")
    # a tile of nonzero float32 subnormals: scale 1 (amax * (1 / 448) is below 2^-126)
    tiny = torch.randn(128, 64, dtype=torch.float64) * 1e-43
    state[5, 2, :, 64:] = (tiny.sign() * tiny.abs().clamp_min(2e-45)).float().cuda()
    out = torch.empty(8, 4, 128, 128, device="cuda", dtype=FP8)
    scales = torch.empty(8, 4, 2, device="cuda")
    recurrent_delta_fwd(x["q"], x["k"], x["v"], torch.zeros_like(x["g"]),
                        torch.zeros_like(x["beta"]), scale=0.1, state_in=state, state_out=out,
                        scales=scales, indices=torch.arange(8, device="cuda"))
    values, expected = quantize_state_fp8(state)
    assert torch.equal(scales, expected)
    assert torch.equal(out.view(torch.uint8), values.view(torch.uint8))
    assert scales[5, 2, 1] == 1.0


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, FP8],
                         ids=["f32", "bf16", "fp8"])
def test_a_slot_decayed_to_nothing_is_written_as_a_fresh_slot(backend, pool_dtype, seed):
    """:func:`test_decode.check_decayed_slot_is_written_as_fresh` on CUDA."""
    from test_decode import check_decayed_slot_is_written_as_fresh

    check_decayed_slot_is_written_as_fresh(backend, pool_dtype, seed, device="cuda")


@pytest.mark.parametrize("T", [1, 4])
def test_diag_kdn_decode_against_float64(T):
    x = kdn_inputs(B=5, T=T, H=4, K=128, V=128, dtype=torch.float64, seed=T)
    seq = [x[n].to(torch.bfloat16).cuda() for n in ("q", "k", "v")]
    seq += [x[n].float().cuda() for n in ("log_alpha", "omega", "r")]
    memory = torch.randn(7, 4, 128, 128, device="cuda")
    precision = torch.rand(7, 4, 128, device="cuda") + 0.5
    idx = torch.tensor([6, -1, 2, 0, 4], device="cuda")
    m64, p64 = memory.double(), precision.double()
    o64 = diag_kdn_decode_reference(*(t.double() for t in seq), m64, p64, idx,
                                    scale=0.088, info_scale=0.9)
    o = kdn_compile.diag_kdn_decode(*seq, memory, precision, idx, scale=0.088, info_scale=0.9)
    assert_close(o, o64, 1e-2, "o")
    assert_close(memory, m64, 2e-5, "memory")
    assert_close(precision, p64, 2e-5, "precision")


def test_decode_replays_in_a_cuda_graph():
    """torch.compile(mode="reduce-overhead") replays decode steps equal to eager."""
    x = delta_inputs(4, 1, 2, 4, 128, 128, per_key=True, dtype=torch.bfloat16, seed=3, **STEP)
    pool_e = torch.randn(6, 4, 128, 128, device="cuda")
    pool_c = pool_e.clone()
    torch._dynamo.mark_static_address(pool_c)
    idx = torch.tensor([5, 1, -1, 2], device="cuda")

    def step(q, k, v, g, beta, pool, idx):
        return kdn_compile.delta_rule_decode(q, k, v, g, beta, pool, idx)

    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    for i in range(20):
        y = delta_inputs(4, 1, 2, 4, 128, 128, per_key=True, dtype=torch.bfloat16, seed=100 + i,
                         **STEP)
        o_e = step(*y.values(), pool_e, idx)
        o_c = compiled(*y.values(), pool_c, idx).clone()
        assert_close(o_c, o_e, 1e-6, f"step {i}")
    assert_close(pool_c, pool_e, 1e-6, "pool")


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, FP8],
                         ids=["f32", "bf16", "fp8"])
@pytest.mark.parametrize("per_key", [False, True], ids=["gdn", "kda"])
def test_verify_then_commit_equals_decoding_the_accepted_tokens(pool_dtype, per_key):
    """On the kernels at K = V = 128: a verification leaves the pool as it is, its outputs
    are the updating step's and the commit writes what decoding the accepted tokens writes
    (tests/test_spec_decode.py), bit for bit for every pool dtype: the kernel rounds the
    same products in every specialization."""
    from test_spec_decode import check_commit

    check_commit("auto", per_key, pool_dtype, False, device="cuda", K=128, V=128)


@pytest.mark.parametrize("memory_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_diag_kdn_verify_then_commit_equals_decoding_the_accepted_tokens(memory_dtype):
    """Diag-KDN on the kernels at K = V = 128 (tests/test_spec_decode.py)."""
    from test_spec_decode import check_kdn_commit

    check_kdn_commit("auto", memory_dtype, device="cuda", K=128, V=128)


_BAD_SLOTS_SCRIPT = """
import sys, torch, kdn_compile
B, T, Hk, Hv, K = 3, 1, 1, 2, 64
q = torch.nn.functional.normalize(torch.randn(B, T, Hk, K, device="cuda"), dim=-1)
v, beta = torch.randn(B, T, Hv, K, device="cuda"), torch.rand(B, T, Hv, device="cuda")
g = -torch.rand(B, T, Hv, device="cuda")
pool = torch.zeros(4, Hv, K, K, device="cuda")
fn = kdn_compile.delta_rule_decode
if sys.argv[1] == "compiled":
    fn = torch.compile(fn, fullgraph=True)
with torch.no_grad():
    fn(q, q, v, g, beta, pool, torch.tensor([2, -1, 0], device="cuda"))
    torch.cuda.synchronize()
    print("good indices passed", flush=True)
    fn(q, q, v, g, beta, pool, torch.tensor([1, 3, 1], device="cuda"))
    torch.cuda.synchronize()
"""


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_repeated_slot_fails_the_decode_launch_with_the_message(mode):
    """A repeated slot index fails the decode kernel's own device assert, eagerly and
    compiled, with the message that names ``state_indices`` (no host sync, no second
    launch); good indices pass."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _BAD_SLOTS_SCRIPT, mode],
                          capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert "good indices passed" in output, output[-3000:]
    assert done.returncode != 0, output[-3000:]
    assert "must not repeat a non-negative slot" in output, output[-3000:]
