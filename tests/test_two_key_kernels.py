"""Two-key per-key-decay kernels (lowering/two_key*.py) against the float64 reference.

Forward (output, final state) and every gradient (q, k, w, v, log_decay,
initial state) against ``reference.two_key_chunk_recurrence`` under autograd in
float64, run per sequence. Cases: odd lengths (1, 63, 65, 100), grouped heads,
with and without an initial state, ``state_v_first``, packed sequences (with an
empty and a one-token sequence), gates at the Diag-KDN floor ``log(1e-6)`` and at
the documented bound ``-20`` per token. Every kernel output is poisoned with NaN
before it is written. Without CUDA the kernels run in the Triton interpreter at
tiny sizes; the CUDA cases (bf16/fp32, K = V = 128, long T) skip without a GPU. Also the
launchers' argument checks and launch choices (the ops on these kernels:
``test_two_key_ops.py``).
"""

from __future__ import annotations

import math

import pytest
import torch

from kdn_compile.lowering.two_key_bwd import two_key_bwd
from kdn_compile.lowering.two_key_common import (
    LOG_DECAY_BOUND,
    two_key_kernel_supports,
)
from kdn_compile.lowering.two_key_fwd import two_key_fwd
from kdn_compile.reference import LOG_MEMORY_ALPHA_FLOOR, two_key_chunk_recurrence

from _helpers import assert_close, gpu, slow
from _inputs import two_key_inputs

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


# ---------------------------------------------------------------- arguments the launchers refuse

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
