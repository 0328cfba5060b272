"""Two-key per-key-decay kernels (lowering/two_key*.py) against the float64 reference.

Forward (output, final state) and every gradient (q, k, w, v, log_decay,
initial state) against ``reference.two_key_chunk_recurrence`` under autograd in
float64, run per sequence. Cases: odd lengths (1, 63, 65, 100), grouped heads,
with and without an initial state, ``state_v_first``, packed sequences (with an
empty and a one-token sequence), gates at the Diag-KDN floor ``log(1e-6)`` and at
the documented bound ``-20`` per token. Every kernel output is poisoned with NaN
before it is written. Without CUDA the kernels run in the Triton interpreter at
tiny sizes; the CUDA cases (bf16/fp32, K = V = 128, long T) skip without a GPU.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from kdn_compile.lowering.two_key_bwd import two_key_bwd
from kdn_compile.lowering.two_key_common import (
    LOG_DECAY_BOUND,
    two_key_kernel_supports,
)
from kdn_compile.lowering.two_key_fwd import two_key_fwd
from kdn_compile.reference import LOG_MEMORY_ALPHA_FLOOR, two_key_chunk_recurrence

from _helpers import assert_close, count_calls, gpu, kernels, slow, without_interpreter
from _inputs import delta_inputs, kdn_inputs, two_key_inputs

GRADS = ("q", "k", "w", "v", "log_decay", "initial_state")
# float32 inputs: every kernel product is exact fp32 (``DOT_PREC = "ieee"``), so results
# differ from the float64 reference by fp32 rounding only (relative RMS at most 1.2e-5 in
# the interpreter cases, 4e-7 for the CUDA fp32 case run in the interpreter); tf32
# products gave 4e-4 in the interpreter cases and 1.8e-3 on the H200.
FP32_TOL = 1e-4
# Half precision: every output and gradient within 1e-2 (relative norm), except the
# log-decay gradient, a sum over the chunk of products that cancel: 2e-2, as FLA's own
# KDA / gated delta rule tests allow for dg. Measured on the H200 (bf16):
# 1.07e-2 with half the gates at LOG_MEMORY_ALPHA_FLOOR, 1.20e-2 at LOG_DECAY_BOUND.
HALF_TOL, HALF_GATE_GRAD_TOL = 1e-2, 2e-2


def reference(x, cu_seqlens, do, dht, *, scale, state_v_first):
    """``(o, final_state, grads)`` in float64; grads ordered as GRADS (None if absent)."""
    x = {n: (t.detach().double().requires_grad_() if t is not None else None) for n, t in x.items()}
    q, k, w, v, g = (x[n] for n in GRADS[:5])
    hv, group = v.shape[2], v.shape[2] // q.shape[2]
    B, T = q.shape[:2]
    n_seq = B if cu_seqlens is None else cu_seqlens.numel() - 1
    state = x["initial_state"]
    if state is None:
        state = q.new_zeros(n_seq, hv, k.shape[-1], v.shape[-1])
    elif state_v_first:
        state = state.transpose(-1, -2)
    heads = lambda t: t.repeat_interleave(group, 2).transpose(1, 2) if t.shape[2] != hv else t.transpose(1, 2)  # noqa: E731,E501
    bounds = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    outs, finals = [], []
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        rows = slice(None) if cu_seqlens is None else slice(i, i + 1)
        o, s = two_key_chunk_recurrence(
            *(heads(t[:, a:b]) for t in (q, k, w, v, g)), state[rows], scale=scale, chunk_size=64
        )
        outs.append(o.transpose(1, 2))
        finals.append(s)
    o, final = torch.cat(outs, 1), torch.cat(finals, 0)
    if state_v_first:
        final = final.transpose(-1, -2)
    loss = (o * do.double()).sum() + (final * dht.double()).sum()
    inputs = [x[n] for n in GRADS if x[n] is not None]
    grads = iter(torch.autograd.grad(loss, inputs))
    return o, final, [next(grads) if x[n] is not None else None for n in GRADS]


@pytest.fixture
def poisoned(monkeypatch):
    """Every ``new_empty`` float tensor starts as NaN: unwritten elements fail the checks."""
    original = torch.Tensor.new_empty

    def new_empty(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if out.is_floating_point():
            out.fill_(math.nan)
        return out

    monkeypatch.setattr(torch.Tensor, "new_empty", new_empty)


def run_case(x, cu_seqlens, *, dtype, device, tol, state_v_first=False, seed=1):
    K = x["q"].shape[-1]
    scale = K ** -0.5
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64)
    n_seq = x["q"].shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    hv, V = x["v"].shape[2:]
    dht_shape = (n_seq, hv, V, K) if state_v_first else (n_seq, hv, K, V)
    dht = torch.randn(dht_shape, generator=gen, dtype=torch.float64)
    o_ref, s_ref, g_ref = reference(
        {n: t.to(device) if t is not None else None for n, t in x.items()},
        cu_seqlens, do.to(device), dht.to(device), scale=scale, state_v_first=state_v_first,
    )

    dev = {n: (t.to(device=device, dtype=dtype if n != "initial_state" else torch.float32)
               if t is not None else None) for n, t in x.items()}
    cu = cu_seqlens.to(device) if cu_seqlens is not None else None
    assert two_key_kernel_supports(dev["q"], dev["v"], chunk_size=64)
    o, final, *saved = two_key_fwd(
        dev["q"], dev["k"], dev["w"], dev["v"], dev["log_decay"], dev["initial_state"], cu,
        chunk_size=64, scale=scale, state_v_first=state_v_first,
    )
    assert o.dtype == dtype and final.dtype == torch.float32
    assert_close(o, o_ref, tol, "o")
    assert_close(final, s_ref, tol, "final_state")
    grads = two_key_bwd(
        dev["q"], dev["k"], dev["w"], dev["v"], dev["log_decay"], dev["initial_state"], cu,
        *saved, do.to(device, dtype), dht.to(device, torch.float32),
        chunk_size=64, scale=scale, state_v_first=state_v_first,
    )
    failures = []
    for name, got, want in zip(GRADS, grads, g_ref):
        if want is None:  # zero initial state: its gradient is still returned
            continue
        try:
            loose = name == "log_decay" and dtype != torch.float32
            assert_close(got, want, HALF_GATE_GRAD_TOL if loose else tol, f"d{name}")
        except AssertionError as error:
            failures.append(str(error))
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- interpreter / CPU

CPU_CASES = [
    # id, (B, T, Hk, Hv, K, V), cu_seqlens, gate_min, floor_share, with_state, state_v_first
    # (float32; the fp16 case below checks half-precision storage: the interpreter's
    # bf16 tl.dot is wrong on the CPU with Triton 3.9, so bf16 runs on CUDA only)
    ("T1", (1, 1, 1, 1, 16, 16), None, -1.0, 0.0, True, False),
    ("T63-grouped", (1, 63, 1, 2, 16, 16), None, -1.0, 0.0, True, False),
    ("T65-K32-floor", (1, 65, 1, 1, 32, 16), None, LOG_MEMORY_ALPHA_FLOOR, 0.5, True, False),
    ("T100-V32-nostate", (1, 100, 1, 1, 16, 32), None, -1.0, 0.0, False, False),
    # V=64: two 32-wide value tiles per sequence and head in the state kernels
    ("varlen-vfirst-V64", (1, 100, 1, 2, 16, 64), [0, 1, 1, 66, 100], -1.0, 0.0, True, True),
    ("bound", (1, 40, 1, 1, 16, 16), None, LOG_DECAY_BOUND, 0.5, True, False),
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter cases run without CUDA")
@pytest.mark.parametrize("case", CPU_CASES, ids=[c[0] for c in CPU_CASES])
def test_interpreter_matches_reference(case, poisoned):
    _, (B, T, Hk, Hv, K, V), cu, gate_min, share, with_state, v_first = case
    cu_seqlens = torch.tensor(cu) if cu is not None else None
    N = None if cu is None else len(cu) - 1
    x = two_key_inputs(B, T, Hk, Hv, K, V, N=N, gate_min=gate_min, floor_share=share,
                       with_state=with_state, state_v_first=v_first)
    run_case(x, cu_seqlens, dtype=torch.float32, device="cpu", tol=FP32_TOL,
             state_v_first=v_first)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter cases run without CUDA")
def test_interpreter_fp16_floor_decay_gradient(poisoned):
    """Half-precision intermediates with decays at log(1e-6): dlog_decay must not lose
    its small values to cancellation (it did, 42% in bf16 on the H200, before the
    c_last gradient was formed from the same products as the per-row terms)."""
    x = two_key_inputs(1, 130, 1, 1, 64, 64, gate_min=LOG_MEMORY_ALPHA_FLOOR, floor_share=0.5)
    run_case(x, None, dtype=torch.float16, device="cpu", tol=1e-2)


def test_supports():
    q = torch.empty(1, 4, 2, 128)
    assert two_key_kernel_supports(q, torch.empty(1, 4, 2, 128), chunk_size=64)
    assert not two_key_kernel_supports(q, torch.empty(1, 4, 2, 128), chunk_size=32)
    assert not two_key_kernel_supports(q, torch.empty(1, 4, 2, 96), chunk_size=64)
    assert not two_key_kernel_supports(q.double(), torch.empty(1, 4, 2, 128).double(),
                                       chunk_size=64)
    # half inputs: head sizes 64 and 128 only; float32 from 16 (see two_key_kernel_supports)
    half = torch.empty(1, 4, 2, 32, dtype=torch.bfloat16)
    assert not two_key_kernel_supports(half, half, chunk_size=64)
    wide = torch.empty(1, 4, 2, 256, dtype=torch.float16)
    assert not two_key_kernel_supports(wide, wide, chunk_size=64)
    assert two_key_kernel_supports(wide[..., :64], wide[..., :128], chunk_size=64)
    small = torch.empty(1, 4, 2, 16)
    assert two_key_kernel_supports(small, small, chunk_size=64)


def test_state_launch_narrows_for_few_programs(monkeypatch):
    import sympy
    from torch.fx.experimental.sym_node import SymNode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from kdn_compile.lowering import two_key_common

    wide, narrow = {"BV": 32}, {"BV": 16}
    monkeypatch.setattr(two_key_common, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    assert two_key_common.state_launch(wide, narrow, 128, 8 * 16, cuda) is wide  # 512 programs
    assert two_key_common.state_launch(wide, narrow, 128, 66, cuda) is wide  # 264
    assert two_key_common.state_launch(wide, narrow, 128, 65, cuda) is narrow  # 260
    assert two_key_common.state_launch(wide, narrow, 16, 200, cuda) is narrow  # one tile each
    env = ShapeEnv()
    symbolic = env.create_unbacked_symint()  # a batch under dynamic shapes
    assert two_key_common.state_launch(wide, narrow, 128, symbolic * 16, cuda) is wide
    # a SymInt of known value (Dynamo's view of a static size) counts as that int
    known = torch.SymInt(SymNode(sympy.Integer(16), env, int, hint=16))
    assert two_key_common.state_launch(wide, narrow, 128, known, cuda) is narrow
    monkeypatch.setattr(two_key_common, "sm_count", lambda device: 1)  # CPU
    assert two_key_common.state_launch(wide, narrow, 128, 1, torch.device("cpu")) is wide


# ---------------------------------------------------------------- CUDA

CUDA_CASES = [
    ("bf16-grouped", torch.bfloat16, (2, 1000, 2, 4, 128, 128), None, -1.0, 0.0, False),
    ("fp32", torch.float32, (1, 777, 2, 2, 128, 128), None, -1.0, 0.0, False),
    ("fp16-K64", torch.float16, (1, 500, 1, 2, 64, 128), None, -1.0, 0.0, False),
    ("bf16-varlen-vfirst", torch.bfloat16, (1, 2000, 2, 2, 128, 128), [0, 300, 301, 301, 2000],
     -1.0, 0.0, True),
    ("bf16-floor", torch.bfloat16, (1, 1000, 2, 2, 128, 128), None, LOG_MEMORY_ALPHA_FLOOR, 0.5,
     False),
    ("bf16-bound", torch.bfloat16, (1, 300, 1, 1, 128, 128), None, LOG_DECAY_BOUND, 0.5, False),
    ("bf16-long", torch.bfloat16, (1, 16384, 1, 2, 128, 128), None, -0.1, 0.0, False),
    # 72 sequence-heads: the state passes keep their wide launch on an H200 (the cases
    # above have few programs and take the narrow one: state_launch)
    ("bf16-wide-grid", torch.bfloat16, (9, 130, 2, 8, 128, 128), None, -1.0, 0.0, False),
]
SMOKE_CASES = ("bf16-grouped", "bf16-varlen-vfirst")  # the others: full tier


@gpu
@pytest.mark.parametrize("case", [
    pytest.param(c, id=c[0], marks=() if c[0] in SMOKE_CASES else slow) for c in CUDA_CASES])
def test_cuda_matches_reference(case, poisoned):
    _, dtype, (B, T, Hk, Hv, K, V), cu, gate_min, share, v_first = case
    cu_seqlens = torch.tensor(cu) if cu is not None else None
    N = None if cu is None else len(cu) - 1
    x = two_key_inputs(B, T, Hk, Hv, K, V, N=N, gate_min=gate_min, floor_share=share,
                       state_v_first=v_first)
    tol = FP32_TOL if dtype == torch.float32 else HALF_TOL
    run_case(x, cu_seqlens, dtype=dtype, device="cuda", tol=tol, state_v_first=v_first)


# ---------------------------------------------------------------- op layer (kdn::chunk_kda)

@kernels
def test_chunk_kda_op_kernel_path_matches_reference(monkeypatch):
    """``kdn_compile.chunk_kda`` on the kernel path (eager; interpreter on CPU), fwd + grads.

    Grouped heads, initial state, ``beta`` chained through ``w = beta k``; against the
    float64 reference under autograd. One forward and one backward launch: the
    backward reads the forward's saved tensors instead of running it again.
    """
    import kdn_compile
    from kdn_compile.ops import kda as kda_ops
    from kdn_compile.ops.kda import _kda_kernels
    from kdn_compile.reference import chunk_kda_reference

    launches = count_calls(monkeypatch, kda_ops, ("two_key_fwd", "two_key_bwd"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tol = HALF_TOL if device == "cuda" else FP32_TOL
    gen = torch.Generator().manual_seed(3)
    B, T, Hk, Hv, K, V = (1, 70, 1, 2, 16, 16) if device == "cpu" else (2, 300, 2, 4, 128, 128)
    x = delta_inputs(B, T, Hk, Hv, K, V, per_key=True, seed=gen)
    do = torch.randn(B, T, Hv, V, generator=gen, dtype=torch.float64)
    dht = torch.randn(B, Hv, K, V, generator=gen, dtype=torch.float64)
    ref_in = {n: t.clone().requires_grad_() for n, t in x.items()}
    o_ref, s_ref = chunk_kda_reference(**ref_in, chunk_size=64)
    ref_grads = torch.autograd.grad((o_ref * do).sum() + (s_ref * dht).sum(), list(ref_in.values()))

    dev = {n: t.to(device, dtype if n != "initial_state" else torch.float32).requires_grad_()
           for n, t in x.items()}
    assert _kda_kernels(dev["q"], dev["v"], 64)
    with kdn_compile.use_backend("triton"):
        o, s = kdn_compile.chunk_kda(**dev, chunk_size=64)
    assert_close(o, o_ref.to(device), tol, "o")
    assert_close(s, s_ref.to(device), tol, "final_state")
    with kdn_compile.use_backend("triton"):
        grads = torch.autograd.grad(
            (o.double() * do.to(device)).sum() + (s.double() * dht.to(device)).sum(),
            list(dev.values()),
        )
    for name, got, want in zip(x, grads, ref_grads):
        assert got.dtype == dev[name].dtype
        assert_close(got, want.to(device), tol, f"d{name}")
    assert launches == ["two_key_fwd", "two_key_bwd"], launches


def _kda_op_args(T=70, cu_seqlens=None, seed=6):
    """float32 arguments of ``kdn::chunk_kda`` that its kernels cover (chunk 64)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    B = 1 if cu_seqlens is not None else 2
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    x = delta_inputs(B, T, 1, 2, 16, 16, per_key=True, N=N, seed=seed, dtype=torch.float32,
                     device=device, requires_grad=True)
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, device=device)
    return (*x.values(), cu, 64, 0.25, False)


@kernels
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_chunk_kda_op_saved_outputs(varlen):
    """``kdn::chunk_kda`` on its kernels returns ``(o, final_state)`` and the saved
    tensors of ``two_key_fwd``, which are not differentiable; the public function
    returns the first two only. opcheck: on CUDA every test; on the CPU (where a
    trace takes the reference branch) the schema and the autograd registration."""
    import kdn_compile
    from kdn_compile.ops.kda import SAVED

    args = _kda_op_args(cu_seqlens=[0, 5, 70] if varlen else None)
    outputs = torch.ops.kdn.chunk_kda(*args)
    assert len(outputs) == 2 + len(SAVED)
    o, final_state, *saved = outputs
    assert o.requires_grad and final_state.requires_grad
    assert not any(t.requires_grad for t in saved)
    assert saved[-2].dtype == saved[-1].dtype == torch.int32  # chunk_seq, chunk_first
    q, k, v, g, beta, h0, cu = args[:7]
    with kdn_compile.use_backend("triton"):
        public = kdn_compile.chunk_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu,
                                       chunk_size=64, scale=0.25)
    assert len(public) == 2
    assert_close(public[0], o, 0.0, "o")
    assert_close(public[1], final_state, 0.0, "final_state")
    # Only the final state's gradient: the output's is zeros of its shape.
    (dv,) = torch.autograd.grad(public[1].sum(), [v])
    assert torch.isfinite(dv).all()
    tests = "ALL" if torch.cuda.is_available() else ("test_schema", "test_autograd_registration")
    torch.library.opcheck(torch.ops.kdn.chunk_kda.default, args, test_utils=tests)
    bwd_args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    bwd_args += tuple(t.detach() for t in saved) + (torch.randn_like(o), torch.randn_like(final_state))
    torch.library.opcheck(torch.ops.kdn.chunk_kda_bwd.default, bwd_args,
                          test_utils="ALL" if torch.cuda.is_available() else "test_schema")


@kernels
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_diag_kdn_op_memory_kernels_match_reference(varlen, monkeypatch):
    """``kdn::diag_kdn`` with the memory on the two-key kernels (chunk 64): output,
    memory, precision and all 8 gradients vs the float64 reference; a fifth of the
    decays sit below the memory floor (clamp gradient)."""
    import kdn_compile
    from kdn_compile.ops import kdn as kdn_ops

    launches = count_calls(monkeypatch, kdn_ops, ("two_key_fwd", "two_key_bwd"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cu_seqlens = torch.tensor([0, 5, 70], device=device) if varlen else None
    x = kdn_inputs(B=1 if varlen else 2, T=70, H=1, K=16, V=16, N=2, seed=4)
    gen = torch.Generator().manual_seed(5)
    low = torch.rand(x["log_alpha"].shape, generator=gen, dtype=torch.float64) < 0.2
    x["log_alpha"] = torch.where(low, torch.full_like(x["log_alpha"], -16.0), x["log_alpha"])
    ours = {n: t.detach().to(device, torch.float32).requires_grad_() for n, t in x.items()}
    theirs = {n: t.detach().to(device).requires_grad_() for n, t in x.items()}
    kw = dict(scale=0.5, info_scale=0.8, chunk_size=64, cu_seqlens=cu_seqlens)
    with kdn_compile.use_backend("triton"):
        out = kdn_compile.diag_kdn(**ours, **kw)
    with kdn_compile.use_backend("reference"):
        ref_out = kdn_compile.diag_kdn(**theirs, **kw)
    grads = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(device)
             for o in ref_out]
    torch.autograd.backward(out, [g.float() for g in grads])
    torch.autograd.backward(ref_out, grads)
    # the backward reads the forward's saved tensors: one launch of each
    assert launches == ["two_key_fwd", "two_key_bwd"], launches
    for name, a, b in zip(("output", "memory", "precision"), out, ref_out):
        assert_close(a, b, FP32_TOL, name)
    for name in x:
        assert_close(ours[name].grad, theirs[name].grad, FP32_TOL, f"grad {name}")


@kernels
def test_diag_kdn_op_half_keys_and_values():
    """``kdn::diag_kdn`` with ``q, k, v`` in half precision (as the DiagKDN layer passes
    them with half activations) and float32 noise, memory and precision: the gain and
    memory kernels against the float64 reference, every output and gradient (bf16 on
    CUDA; fp16 in the interpreter, whose bf16 products are wrong)."""
    import kdn_compile

    device = "cuda" if torch.cuda.is_available() else "cpu"
    half = torch.bfloat16 if device == "cuda" else torch.float16
    K = 64 if device == "cpu" else 128
    x = kdn_inputs(B=1, T=100, H=2, K=K, V=K, N=1, seed=7)
    ours = {n: t.detach().to(device, half if n in ("q", "k", "v") else torch.float32)
            .requires_grad_() for n, t in x.items()}
    theirs = {n: t.detach().to(device).requires_grad_() for n, t in x.items()}
    kw = dict(scale=K ** -0.5, info_scale=1.0, chunk_size=64)
    with kdn_compile.use_backend("triton"):
        out = kdn_compile.diag_kdn(**ours, **kw)
    with kdn_compile.use_backend("reference"):
        ref_out = kdn_compile.diag_kdn(**theirs, **kw)
    gen = torch.Generator().manual_seed(8)
    grads = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(device) for o in ref_out]
    torch.autograd.backward(out, [g.to(o.dtype) for g, o in zip(grads, out)])
    torch.autograd.backward(ref_out, grads)
    assert out[0].dtype == half and out[1].dtype == torch.float32
    for name, a, b in zip(("output", "memory", "precision"), out, ref_out):
        assert_close(a, b, HALF_TOL, name)
    for name in x:
        tol = HALF_GATE_GRAD_TOL if name == "log_alpha" else HALF_TOL
        assert_close(ours[name].grad, theirs[name].grad, tol, f"grad {name}")


@kernels
def test_chunk_kda_op_floors_gates_below_the_kernel_bound():
    """Gates far below ``LOG_DECAY_BOUND`` (e.g. -60, a KDA layer at the top of its
    init range) give finite results equal to the reference's, with zero ``dg`` there."""
    import kdn_compile
    from kdn_compile.reference import chunk_kda_reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    B, T, H, K = 1, 40, 1, 16
    x = delta_inputs(B, T, H, H, K, K, per_key=True, seed=5, gate_scale=60.0, with_state=False)
    o_ref, s_ref = chunk_kda_reference(**x, chunk_size=64)
    dev = {n: t.to(device, torch.float32).requires_grad_() for n, t in x.items()}
    with kdn_compile.use_backend("triton"):
        o, s = kdn_compile.chunk_kda(**dev, chunk_size=64)
        (dg,) = torch.autograd.grad(o.sum() + s.sum(), [dev["g"]])
    assert torch.isfinite(o).all() and torch.isfinite(s).all() and torch.isfinite(dg).all()
    assert_close(o, o_ref.to(device), FP32_TOL, "o with deep gates")
    assert_close(s, s_ref.to(device), FP32_TOL, "state with deep gates")
    assert (dg[dev["g"] < LOG_DECAY_BOUND] == 0).all()


@kernels
def test_chunk_kda_backward_at_the_bound_with_large_gradients():
    """Four tokens of one 8-token half at the bound (-20) and gradients in the hundreds:
    the backward's diagonal block keeps its factors within e^40 there (quarters), where
    halves would reach e^80 and overflow float32 once ``|dA w|`` passes 6e3 (inf ``dq``,
    NaN ``dg``). Every gradient against float64."""
    import kdn_compile
    from kdn_compile.reference import chunk_kda_reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = delta_inputs(1, 16, 1, 1, 16, 16, per_key=True, seed=21, gate_scale=0.1,
                     with_state=False)
    x["v"] = 300 * x["v"]
    x["g"][:, 4:8] = LOG_DECAY_BOUND
    do = 300 * torch.randn(1, 16, 1, 16, generator=torch.Generator().manual_seed(22),
                           dtype=torch.float64)
    ref = {n: t.clone().requires_grad_() for n, t in x.items()}
    o_ref, _ = chunk_kda_reference(**ref, chunk_size=64)
    want = torch.autograd.grad(o_ref, list(ref.values()), do)
    dev = {n: t.to(device, torch.float32).requires_grad_() for n, t in x.items()}
    with kdn_compile.use_backend("triton"):
        o, _ = kdn_compile.chunk_kda(**dev, chunk_size=64)
    got = torch.autograd.grad(o, list(dev.values()), do.to(device, torch.float32))
    assert_close(o, o_ref.to(device), FP32_TOL, "o")
    for name, a, b in zip(dev, got, want):
        assert torch.isfinite(a).all(), f"grad {name} not finite"
        assert_close(a, b.to(device), FP32_TOL, f"grad {name}")


@kernels
def test_chunk_kda_kernels_keep_a_nan_gate():
    """A NaN gate gives a NaN output and state on the kernel path, as on the reference
    (the floor once turned it into -20 and hid it)."""
    import kdn_compile

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = delta_inputs(1, 20, 1, 1, 16, 16, per_key=True, seed=23, gate_scale=0.1,
                     with_state=False, dtype=torch.float32, device=device)
    x["g"][0, 3, 0, :] = float("nan")
    with kdn_compile.use_backend("triton"):
        o, s = kdn_compile.chunk_kda(**x, chunk_size=64)
    assert not torch.isfinite(o[:, 3:]).any()  # (earlier tokens of its chunk may be NaN too)
    assert not torch.isfinite(s).all()


@pytest.mark.parametrize("which,expected", [("gdn", "counts [2, 3]"), ("kda", "counts [5, 4]"),
                                            ("kdn", "counts [8, 7]"),
                                            ("export", "exported kdn ['kdn.diag_kdn.default']")])
def test_kernel_path_traces_as_on_the_gpu(which, expected):
    """The kernel branch traced on the CPU (tests/_trace_kernel_path.py): the ops with
    their saved outputs through AOTAutograd's min-cut partitioner (a backward kernel
    once seen writing the saved ``chunk_first`` failed there: "Node getitem_29 was
    invalid, but is output"), and the layers through torch.export with a dynamic length
    (a saved or scratch tensor with a dimension of one chunk once made it guard on the
    length)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "tests/_trace_kernel_path.py", which],
                          env=without_interpreter(),
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0 and expected in done.stdout, done.stdout + done.stderr[-3000:]
    if which == "export":
        assert "exported kda ['kdn.chunk_kda.default']" in done.stdout, done.stdout
        assert "exported gdn ['kdn.chunk_gdn.default']" in done.stdout, done.stdout


@pytest.mark.parametrize("floor", [LOG_DECAY_BOUND - 1.0, 0.5, float("nan"), True, "abc", None])
def test_decay_floor_outside_the_bound_is_refused(floor):
    """A ``log_decay_floor`` below the kernels' bound (or above 0) would overflow or
    mean nothing: both entry points refuse it, naming the argument and the range."""
    q = torch.zeros(1, 8, 1, 16)
    v, g = torch.zeros(1, 8, 1, 16), torch.zeros(1, 8, 1, 16)
    kw = dict(chunk_size=64, scale=1.0, state_v_first=False, log_decay_floor=floor)
    with pytest.raises(ValueError, match=r"log_decay_floor: expected a float in \[-20.0, 0\]"):
        two_key_fwd(q, q, q, v, g, None, None, **kw)
    with pytest.raises(ValueError, match=r"log_decay_floor: expected a float in \[-20.0, 0\]"):
        two_key_bwd(q, q, q, v, g, None, None, *([None] * 10), v, None, **kw)


def test_packed_sequences_need_batch_one():
    """The launchers read ``cu_seqlens`` as boundaries in ``B * T`` tokens of one row:
    ``B = 2`` would leave the second row unwritten, so both refuse it."""
    q = torch.zeros(2, 8, 1, 16)
    kw = dict(chunk_size=64, scale=1.0, state_v_first=False)
    cu = torch.tensor([0, 3, 8])
    with pytest.raises(ValueError, match=r"with cu_seqlens the batch size must be 1, got B = 2"):
        two_key_fwd(q, q, q, q, q, None, cu, **kw)
    with pytest.raises(ValueError, match=r"with cu_seqlens the batch size must be 1, got B = 2"):
        two_key_bwd(q, q, q, q, q, None, cu, *([None] * 10), q, None, **kw)


@pytest.mark.parametrize("beta", [torch.rand(1, 8, 2), torch.ones(1, 8, 1, dtype=torch.int64)],
                         ids=["shape", "dtype"])
def test_beta_of_the_wrong_shape_or_dtype_is_refused(beta):
    q = torch.zeros(1, 8, 1, 16)
    kw = dict(chunk_size=64, scale=1.0, state_v_first=False, beta=beta)
    with pytest.raises(ValueError, match=r"beta: expected a float tensor of shape \(1, 8, 1\)"):
        two_key_fwd(q, q, None, q, q, None, None, **kw)
    with pytest.raises(ValueError, match=r"beta: expected a float tensor of shape \(1, 8, 1\)"):
        two_key_bwd(q, q, None, q, q, None, None, *([None] * 10), q, None, **kw)


@pytest.mark.parametrize("w_given", [True, False], ids=["both", "neither"])
def test_exactly_one_of_w_and_beta(w_given):
    q = torch.zeros(1, 8, 1, 16)
    kw = dict(chunk_size=64, scale=1.0, state_v_first=False,
              beta=torch.rand(1, 8, 1) if w_given else None)
    with pytest.raises(ValueError, match="w, beta: give exactly one"):
        two_key_fwd(q, q, q if w_given else None, q, q, None, None, **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter case runs without CUDA")
def test_interpreter_beta_forms_the_write_key(poisoned):
    """KDA's ``beta`` (the kernels form ``w = beta k`` and chain through it) against
    the same call with ``w = beta k`` given: ``o``, final state, ``dq``, ``dv``, ``dg``
    agree and ``dk``, ``dbeta`` are the chain rule of ``dk``, ``dw`` (grouped heads)."""
    x = two_key_inputs(1, 70, 1, 2, 16, 16)
    gen = torch.Generator().manual_seed(9)
    beta = torch.rand(1, 70, 2, generator=gen, dtype=torch.float64)
    k = x["k"]
    w = k.repeat_interleave(2, 2) * beta[..., None]
    f = {n: t.float() if t is not None else None for n, t in x.items()}
    kw = dict(chunk_size=64, scale=0.3, state_v_first=False)
    do = torch.randn(1, 70, 2, 16, generator=gen)
    args = (f["q"], f["k"])
    rest = (f["v"], f["log_decay"], f["initial_state"], None)
    o_w, s_w, *saved_w = two_key_fwd(*args, w.float(), *rest, **kw)
    o_b, s_b, *saved_b = two_key_fwd(*args, None, *rest, beta=beta.float(), **kw)
    assert_close(o_b, o_w, FP32_TOL, "o")
    assert_close(s_b, s_w, FP32_TOL, "final state")
    g_w = two_key_bwd(*args, w.float(), *rest, *saved_w, do, None, **kw)
    g_b = two_key_bwd(*args, None, *rest, *saved_b, do, None, beta=beta.float(), **kw)
    dw = g_w[2].double()
    dk = g_w[1].double() + (dw * beta[..., None]).view(1, 70, 1, 2, 16).sum(3)
    dbeta = (dw * k.repeat_interleave(2, 2)).sum(-1)
    for name, got, want in (("dq", g_b[0], g_w[0]), ("dk", g_b[1], dk), ("dbeta", g_b[2], dbeta),
                            ("dv", g_b[3], g_w[3]), ("dg", g_b[4], g_w[4]), ("dh0", g_b[5], g_w[5])):
        assert_close(got.double(), want.double(), FP32_TOL, name)
