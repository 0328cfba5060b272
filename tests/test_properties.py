"""Property-based tests: every public function against a float64 token loop.

Hypothesis draws shapes (odd lengths, grouped value heads, packed sequences with empty
ones, decode batches with padding rows and shuffled slots), dtypes, state layouts and
inputs within each function's documented domain: natural-log gates ``g`` in ``[-20, 0]``
(zero included), write strengths ``beta`` in ``[0, 1]``, Diag-KDN retentions
``log_alpha`` in ``[-20, 0]``, process noise ``omega`` in ``[1e-3, 10]``,
observation noise ``r`` in ``[1e-2, 1e2]`` and precisions in ``[1e-2, 1e2]``. Each
function runs on the references (backend ``"reference"``) and on the Triton kernels
in the interpreter (backend ``"triton"``, float32, ``TRITON_INTERPRET=1`` from
conftest; the kernel launchers are counted so a silent fallback fails), and its
outputs, final states and gradients are compared with the token loops of ``_helpers``
(:func:`delta_rule_oracle`, :func:`diag_kdn_oracle`), written from the spec's
recurrences and run in float64 on the same (rounded) inputs.

Bounded for CI: the ``ci`` profile is derandomized (the same examples every run) with a
few examples per test; ``HYPOTHESIS_PROFILE=deep`` draws ten times as many fresh ones.
Tolerances are relative RMS errors (:func:`_helpers.rel_error`).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import kdn_compile
import kdn_compile.ops.decode
import kdn_compile.ops.gdn
import kdn_compile.ops.kda
import kdn_compile.ops.kdn
import kdn_compile.ops.recurrent
from _helpers import assert_close, count_calls, delta_rule_oracle, diag_kdn_oracle, interpreting
from kdn_compile import fla
from kdn_compile.ops._dispatch import TRITON

# The kernel-bounds fixture (conftest) spans all the examples of a test on purpose.
settings.register_profile(
    "ci", deadline=None, derandomize=True, database=None, print_blob=True,
    suppress_health_check=(HealthCheck.too_slow, HealthCheck.function_scoped_fixture),
)
settings.register_profile("deep", settings.get_profile("ci"), derandomize=False)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)
_DEPTH = 10 if PROFILE == "deep" else 1

INTERPRETED = interpreting() and not torch.cuda.is_available()
needs_interpreter = pytest.mark.skipif(
    not (TRITON and INTERPRETED), reason="needs Triton's interpreter on the CPU")

# Relative RMS error against the float64 token loop, by input dtype: (outputs and
# states, gradients). float32 as the README states for the kernels; bfloat16 inputs are
# compared on their rounded values, so only the computation (float32, rounded outputs)
# counts.
TOLERANCE = {torch.float64: (1e-9, 1e-8), torch.float32: (1e-4, 1e-3),
             torch.bfloat16: (1e-2, None)}


def _tolerance(which: int, *dtypes):
    """The loosest tolerance (0: values, 1: gradients) of the dtypes involved."""
    return max(TOLERANCE[d][which] for d in dtypes)


def examples(n: int):
    """``settings`` for a test drawing ``n`` examples in the ci profile."""
    return settings(max_examples=n * _DEPTH)


# -- drawing ------------------------------------------------------------------------


@dataclass
class Case:
    """Inputs drawn for one call: ``tensors`` are the differentiable arguments (None for
    an absent initial state), ``options`` the others."""

    tensors: dict
    options: dict = field(default_factory=dict)
    gate: str = "g"  # the name of the gate tensor
    weakest: float = 0.0  # every gate decays by e^-weakest per token or faster


# A gate gradient is compared where some gate is weaker than this: when all decay faster,
# it loses relative accuracy as ``eps * e^weakest`` (float32: 2e-4 at 6, 3e-3 (reference)
# to 3e-2 (kernels) at 9, measured here), as the float32 token loop's does (documented
# for chunk_kda).
STRONG_GATE = {torch.float32: 5.0, torch.float64: 12.0}


def _generator(draw):
    return torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))


def _uniform(gen, shape, low, high):
    return low + (high - low) * torch.rand(shape, generator=gen, dtype=torch.float64)


def _log_uniform(gen, shape, low, high):
    return _uniform(gen, shape, math.log(low), math.log(high)).exp()


def _sequences(draw, max_len: int):
    """``(B, T, cu_seqlens)``: a fixed-length batch, or one row packing up to four
    sequences (empty ones included) with int32 or int64 boundaries. Lengths around one
    chunk (63, 64, 65) are drawn as often as the others together."""
    edges = [n for n in (63, 64, 65) if n <= max_len]
    lengths = st.integers(1, max_len)
    t = draw(st.one_of(lengths, st.sampled_from(edges)) if edges else lengths)
    if not draw(st.booleans()):
        return draw(st.integers(1, 2)), t, None
    cuts = sorted(draw(st.lists(st.integers(0, t), max_size=3)))
    dtype = draw(st.sampled_from((torch.int32, torch.int64)))
    return 1, t, torch.tensor([0, *cuts, t], dtype=dtype)


def _range(draw, high: float) -> tuple[float, float]:
    """A sub-interval ``[low, top]`` of ``[0, high]``, ends on a grid of ``high / 100`` (no
    subnormal write strengths)."""
    a, b = sorted(draw(st.integers(0, 100)) for _ in range(2))
    return a * high / 100, b * high / 100


def _gates(draw, gen, shape):
    """Natural-log decays in ``[-20, 0]``, uniform over a drawn sub-interval, and the
    weakest decay's magnitude."""
    low, top = _range(draw, 20.0)
    return -_uniform(gen, shape, low, top), low


def _qk(gen, shape):
    return F.normalize(torch.randn(shape, generator=gen, dtype=torch.float64), dim=-1)


@st.composite
def delta_cases(draw, *, per_key: bool, dims, dtypes, max_len: int, chunk_sizes=(64,),
                state_dtypes=(torch.float32,)):
    """Arguments of chunk_gdn / chunk_kda / recurrent_delta_rule."""
    gen = _generator(draw)
    b, t, cu_seqlens = _sequences(draw, max_len)
    hk = draw(st.integers(1, 2))
    hv = hk * draw(st.integers(1, 3))
    dk, dv = draw(dims), draw(dims)
    dtype = draw(st.sampled_from(dtypes))
    n = b if cu_seqlens is None else cu_seqlens.numel() - 1
    state_v_first = draw(st.booleans())
    low, top = _range(draw, 1.0)
    g, weakest = _gates(draw, gen, (b, t, hv, dk) if per_key else (b, t, hv))
    tensors = {
        "q": _qk(gen, (b, t, hk, dk)), "k": _qk(gen, (b, t, hk, dk)),
        "v": torch.randn(b, t, hv, dv, generator=gen, dtype=torch.float64),
        "g": g, "beta": _uniform(gen, (b, t, hv), low, top),
    }
    tensors = {name: x.to(dtype) for name, x in tensors.items()}
    tensors["initial_state"] = None
    if draw(st.booleans()):
        shape = (n, hv, dv, dk) if state_v_first else (n, hv, dk, dv)
        state = torch.randn(shape, generator=gen, dtype=torch.float64)
        tensors["initial_state"] = state.to(draw(st.sampled_from(state_dtypes)))
    options = {"scale": draw(st.one_of(st.none(), st.floats(0.1, 2.0))),
               "cu_seqlens": cu_seqlens, "state_v_first": state_v_first}
    if chunk_sizes is not None:
        options["chunk_size"] = draw(st.sampled_from(chunk_sizes))
    return Case(tensors, options, "g", weakest)


def _kdn_noise(draw, gen, b, t, h, dk):
    """``log_alpha, omega, r`` of Diag-KDN within their domain, and the weakest decay's
    magnitude."""
    o_low, o_top = sorted(draw(st.floats(-3, 1)) for _ in range(2))
    r_low, r_top = sorted(draw(st.floats(-2, 2)) for _ in range(2))
    log_alpha, weakest = _gates(draw, gen, (b, t, h, dk))
    return {"log_alpha": log_alpha,
            "omega": _log_uniform(gen, (b, t, h, dk), 10**o_low, 10**o_top),
            "r": _log_uniform(gen, (b, t, h), 10**r_low, 10**r_top)}, weakest


@st.composite
def kdn_cases(draw, *, dims, dtypes, max_len: int, chunk_sizes=(64,)):
    """Arguments of diag_kdn."""
    gen = _generator(draw)
    b, t, cu_seqlens = _sequences(draw, max_len)
    h, dk, dv = draw(st.integers(1, 2)), draw(dims), draw(dims)
    n = b if cu_seqlens is None else cu_seqlens.numel() - 1
    dtype = draw(st.sampled_from(dtypes))
    noise, weakest = _kdn_noise(draw, gen, b, t, h, dk)
    tensors = {"q": _qk(gen, (b, t, h, dk)), "k": _qk(gen, (b, t, h, dk)),
               "v": torch.randn(b, t, h, dv, generator=gen, dtype=torch.float64), **noise,
               "memory": torch.randn(n, h, dk, dv, generator=gen, dtype=torch.float64),
               "precision": _log_uniform(gen, (n, h, dk), 1e-2, 1e2)}
    tensors = {name: x.to(dtype) for name, x in tensors.items()}
    options = {"scale": draw(st.floats(0.1, 1.0)), "info_scale": draw(st.floats(0, 2)),
               "cu_seqlens": cu_seqlens, "chunk_size": draw(st.sampled_from(chunk_sizes))}
    return Case(tensors, options, "log_alpha", weakest)


# -- checking -----------------------------------------------------------------------

GDN_LAUNCHERS = ((kdn_compile.ops.gdn, ("chunk_gdn_fwd", "chunk_gdn_bwd")),)
KDA_LAUNCHERS = ((kdn_compile.ops.kda, ("two_key_fwd", "two_key_bwd")),)
KDN_LAUNCHERS = ((kdn_compile.ops.kdn, ("kalman_gain_fwd", "kalman_gain_bwd", "two_key_fwd",
                                        "two_key_bwd")),)
RECURRENT_LAUNCHERS = ((kdn_compile.ops.recurrent, ("recurrent_delta_fwd",)),)
DECODE_LAUNCHERS = ((kdn_compile.ops.decode, ("recurrent_delta_fwd", "recurrent_kdn_fwd")),)


@contextlib.contextmanager
def _backend(backend: str, launchers, expected: set):
    """Run under ``backend`` counting the kernel launchers (with Triton installed): on
    ``"triton"`` fail unless those named in ``expected`` ran (a kernel path that silently
    took the reference), on ``"reference"`` if any ran."""
    with pytest.MonkeyPatch.context() as patch, kdn_compile.use_backend(backend):
        calls = [count_calls(patch, module, names) for module, names in launchers if TRITON]
        yield
    launched = {name for found in calls for name in found}
    if backend == "triton":
        assert expected <= launched, f"kernels {sorted(expected - launched)} did not run"
    else:
        assert not launched, f"backend {backend!r} launched kernels {sorted(launched)}"


def _event(backend: str, case: Case, **more) -> None:
    """What was drawn, for ``--hypothesis-show-statistics``."""
    packed = case.options.get("cu_seqlens") is not None
    quantizer = "w_quantizer" in case.options
    event(f"{backend} {case.tensors['q'].dtype} T={case.tensors['q'].shape[1]}"
          + (" packed" if packed else "") + (" w_quantizer" if quantizer else "")
          + "".join(f" {k}={v}" for k, v in more.items()))


def _float64_leaves(tensors: dict) -> dict:
    return {n: x.detach().double().requires_grad_() for n, x in tensors.items() if x is not None}


def _compare(fn, oracle, case: Case, *, backend: str, launchers=(), expected=(),
             grads: bool):
    """``fn(**case)`` under ``backend`` against ``oracle`` on the float64 copies of the same
    inputs: every output, then (``grads``) the gradients of a random linear loss."""
    dtype = case.tensors["q"].dtype
    grads = grads and TOLERANCE[dtype][1] is not None
    _event(backend, case, grads=grads)
    leaves = {n: (None if x is None else x.clone().requires_grad_(grads))
              for n, x in case.tensors.items()}
    with _backend(backend, launchers, set(expected)):
        found = fn(**leaves, **case.options)
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in found]
        if grads:
            loss = sum((x.double() * w).sum() for x, w in zip(found, weights))
            inputs = [x for x in leaves.values() if x is not None]
            found_grads = torch.autograd.grad(loss, inputs)
    exact_leaves = _float64_leaves(case.tensors)
    options = {n: x for n, x in case.options.items() if n not in ("chunk_size", "w_quantizer")}
    exact = oracle(**{n: exact_leaves.get(n) for n in case.tensors}, **options)
    for i, (x, e) in enumerate(zip(found, exact)):
        assert_close(x, e, _tolerance(0, dtype, x.dtype), f"output {i}")
    if grads:
        loss = sum((x * w).sum() for x, w in zip(exact, weights))
        exact_grads = torch.autograd.grad(loss, list(exact_leaves.values()))
        for name, x, e in zip(exact_leaves, found_grads, exact_grads):
            if name != case.gate or case.weakest < STRONG_GATE[dtype]:
                assert_close(x, e, _tolerance(1, dtype, x.dtype), f"d{name}")


# -- chunk_gdn, chunk_kda, recurrent_delta_rule ----------------------------------------

REFERENCE_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
SMALL_DIMS = st.sampled_from((3, 8, 16))
KERNEL_DIMS = st.sampled_from((16, 32))


CHUNKED = pytest.mark.parametrize("fn, per_key, launchers", [
    (kdn_compile.chunk_gdn, False, GDN_LAUNCHERS), (kdn_compile.chunk_kda, True, KDA_LAUNCHERS),
], ids=["chunk_gdn", "chunk_kda"])


@CHUNKED
@examples(12)
@given(data=st.data())
def test_chunked_reference_is_the_token_loop(fn, per_key, launchers, data):
    """For chunk_gdn also through ``w_quantizer`` (the identity: the two-op path)."""
    case = data.draw(delta_cases(per_key=per_key, dims=SMALL_DIMS, dtypes=REFERENCE_DTYPES,
                                 max_len=80, chunk_sizes=(64, 16, 5),
                                 state_dtypes=(torch.float32, torch.float64)))
    if not per_key and data.draw(st.booleans()):
        case.options["w_quantizer"] = lambda w: w
    _compare(fn, delta_rule_oracle, case, backend="reference", launchers=launchers, grads=True)


@needs_interpreter
@CHUNKED
@examples(4)
@given(grads=st.booleans(), data=st.data())
def test_chunked_kernels_are_the_token_loop(fn, per_key, launchers, grads, data):
    """Forward and (``grads``) backward kernels."""
    case = data.draw(delta_cases(per_key=per_key, dims=KERNEL_DIMS, dtypes=(torch.float32,),
                                 max_len=80))
    names = launchers[0][1]
    _compare(fn, delta_rule_oracle, case, backend="triton", launchers=launchers, grads=grads,
             expected=names if grads else names[:1])


@examples(12)
@given(per_key=st.booleans(), data=st.data())
def test_recurrent_reference_is_the_token_loop(per_key, data):
    case = data.draw(delta_cases(per_key=per_key, dims=SMALL_DIMS, dtypes=REFERENCE_DTYPES,
                                 max_len=40, chunk_sizes=None,
                                 state_dtypes=(torch.float32, torch.float64)))
    _compare(kdn_compile.recurrent_delta_rule, delta_rule_oracle, case, backend="reference",
             launchers=RECURRENT_LAUNCHERS, grads=True)


@needs_interpreter
@examples(5)
@given(per_key=st.booleans(), data=st.data())
def test_recurrent_kernel_is_the_token_loop(per_key, data):
    """The forward on the token-recurrence kernel, the gradients from the reference."""
    case = data.draw(delta_cases(per_key=per_key, dims=st.sampled_from((5, 8, 16)),
                                 dtypes=(torch.float32,), max_len=24, chunk_sizes=None))
    _compare(kdn_compile.recurrent_delta_rule, delta_rule_oracle, case, backend="triton",
             launchers=RECURRENT_LAUNCHERS, expected=("recurrent_delta_fwd",), grads=True)


# -- diag_kdn -----------------------------------------------------------------------


@examples(12)
@given(case=kdn_cases(dims=SMALL_DIMS, dtypes=REFERENCE_DTYPES, max_len=80,
                      chunk_sizes=(64, 16, 5)))
def test_diag_kdn_reference_is_the_token_loop(case):
    _compare(kdn_compile.diag_kdn, diag_kdn_oracle, case, backend="reference",
             launchers=KDN_LAUNCHERS, grads=True)


@needs_interpreter
@examples(3)
@given(case=kdn_cases(dims=st.sampled_from((16, 5)), dtypes=(torch.float32,), max_len=40),
       grads=st.booleans())
def test_diag_kdn_kernels_are_the_token_loop(case, grads):
    """The gain kernels, then the memory on the two-key kernels (``K``, ``V`` of 16) or by
    the reference math (5)."""
    launchers = ["kalman_gain_fwd", "kalman_gain_bwd"]
    if case.tensors["k"].shape[-1] == case.tensors["v"].shape[-1] == 16:
        launchers += ["two_key_fwd", "two_key_bwd"]
    _compare(kdn_compile.diag_kdn, diag_kdn_oracle, case, backend="triton",
             launchers=KDN_LAUNCHERS, expected=launchers[::2] + (launchers[1::2] if grads else []),
             grads=grads)


# -- decode over state pools -----------------------------------------------------------


def _slots(draw, rows: int):
    """``(S, state_indices)``: distinct slots of a pool of ``S`` in a shuffled order, and
    padding rows (-1)."""
    slots = draw(st.integers(1, 4))
    order = draw(st.permutations(range(slots)))
    picks = [order[i] if i < slots and draw(st.booleans()) else -1 for i in range(rows)]
    dtype = draw(st.sampled_from((torch.int32, torch.int64)))
    return slots, torch.tensor(picks, dtype=dtype)


def _check_pool_step(found_o, pools_before, pools_after, indices, step):
    """``step(row, states) -> (o [T, H, V], new states)`` (float64; ``states`` are the slot's
    rows of ``pools_before``) for each live row: the row's output and its slots within the
    tolerances of their dtypes; padding rows give zeros and slots not named keep their
    bytes."""
    named = set()
    for row, slot in enumerate(indices.tolist()):
        if slot < 0:
            assert not found_o[row].any(), f"padding row {row} has non-zero outputs"
            continue
        named.add(slot)
        o, states = step(row, [pool[slot] for pool in pools_before])
        assert_close(found_o[row], o, _tolerance(0, found_o.dtype), f"o of row {row}")
        for i, (pool, state) in enumerate(zip(pools_after, states)):
            assert_close(pool[slot], state, _tolerance(0, found_o.dtype, pool.dtype),
                         f"pool {i} slot {slot}")
    for before, after in zip(pools_before, pools_after):
        for slot in set(range(before.shape[0])) - named:
            assert torch.equal(after[slot], before[slot]), f"slot {slot} was written"


@st.composite
def decode_inputs(draw, *, kdn: bool, backend: str):
    """``(inputs, memory pool, state_indices, generator)`` of a decode step of ``1..8``
    tokens over a pool of up to four slots: float32 inputs and pool for the kernels;
    float64, or float32 with a float32 or bfloat16 pool, for the reference."""
    gen = _generator(draw)
    rows, t = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    slots, indices = _slots(draw, rows)
    hk = draw(st.integers(1, 2))
    hv = hk if kdn else hk * draw(st.integers(1, 2))
    dk, dv = draw(st.sampled_from((5, 8, 16))), draw(st.sampled_from((5, 8, 16)))
    x = {"q": _qk(gen, (rows, t, hk, dk)), "k": _qk(gen, (rows, t, hk, dk)),
         "v": torch.randn(rows, t, hv, dv, generator=gen, dtype=torch.float64)}
    if kdn:
        x.update(_kdn_noise(draw, gen, rows, t, hv, dk)[0])
    else:
        per_key = draw(st.booleans())
        x["g"] = _gates(draw, gen, (rows, t, hv, dk) if per_key else (rows, t, hv))[0]
        low, top = _range(draw, 1.0)
        x["beta"] = _uniform(gen, (rows, t, hv), low, top)
    dtype, pool_dtype = torch.float32, torch.float32
    if backend == "reference":
        dtype = draw(st.sampled_from((torch.float32, torch.float64)))
        pool_dtype = dtype if dtype == torch.float64 else draw(
            st.sampled_from((torch.float32, torch.bfloat16)))
    pool = torch.randn(slots, hv, dk, dv, generator=gen, dtype=torch.float64).to(pool_dtype)
    return {n: v.to(dtype) for n, v in x.items()}, pool, indices, gen


def _draw_decode(data, **kwargs):
    x, pool, indices, gen = found = data.draw(decode_inputs(**kwargs))
    event(f"{kwargs['backend']} {x['q'].dtype} pool {pool.dtype} T={x['q'].shape[1]} "
          f"slots {indices.tolist()}")
    return found


DECODE_BACKENDS = pytest.mark.parametrize(
    "backend", ["reference", pytest.param("triton", marks=needs_interpreter)])


@DECODE_BACKENDS
@examples(8)
@given(data=st.data())
def test_delta_rule_decode_is_the_token_loop(backend, data):
    x, pool, indices, _ = _draw_decode(data, kdn=False, backend=backend)
    state_v_first = data.draw(st.booleans())
    scale = data.draw(st.one_of(st.none(), st.floats(0.1, 2.0)))
    layout = (lambda s: s.transpose(-1, -2)) if state_v_first else (lambda s: s)
    stored = layout(pool).contiguous()
    before = stored.clone()
    inter = None
    if data.draw(st.booleans()):
        inter_dtype = torch.float64 if pool.dtype == torch.float64 else torch.float32
        inter = torch.zeros((len(indices), x["q"].shape[1]) + layout(pool[0]).shape,
                            dtype=inter_dtype)
    with torch.no_grad(), _backend(backend, DECODE_LAUNCHERS, {"recurrent_delta_fwd"}):
        o = kdn_compile.delta_rule_decode(
            *x.values(), stored, indices, scale=scale, state_v_first=state_v_first,
            intermediate_states=inter)

    def run(row, state, tokens):
        one = {n: v[row:row + 1, :tokens] for n, v in x.items()}
        o, final = delta_rule_oracle(**one, scale=scale, initial_state=state[None],
                                     state_v_first=state_v_first)
        return o[0], [final[0]]

    _check_pool_step(o, [before], [stored], indices,
                     lambda row, states: run(row, states[0], None))
    if inter is not None:  # the state after every token: the loop stopped there
        for row, slot in enumerate(indices.tolist()):
            for t in range(inter.shape[1]) if slot >= 0 else ():
                state = run(row, before[slot], t + 1)[1][0]
                assert_close(inter[row, t], state, _tolerance(0, x["q"].dtype),
                             f"intermediate state {t} of row {row}")


@DECODE_BACKENDS
@examples(8)
@given(data=st.data())
def test_diag_kdn_decode_is_the_token_loop(backend, data):
    x, memory, indices, gen = _draw_decode(data, kdn=True, backend=backend)
    precision_dtype = torch.float64 if memory.dtype == torch.float64 else torch.float32
    precision = _log_uniform(gen, memory.shape[:3], 1e-2, 1e2).to(precision_dtype)
    scale, info_scale = data.draw(st.floats(0.1, 1.0)), data.draw(st.floats(0, 2))
    before = [memory.clone(), precision.clone()]
    with torch.no_grad(), _backend(backend, DECODE_LAUNCHERS, {"recurrent_kdn_fwd"}):
        o = kdn_compile.diag_kdn_decode(*x.values(), memory, precision, indices, scale=scale,
                                        info_scale=info_scale)

    def step(row, states):
        one = {n: v[row:row + 1] for n, v in x.items()}
        o, m, p = diag_kdn_oracle(**one, memory=states[0][None], precision=states[1][None],
                                  scale=scale, info_scale=info_scale)
        return o[0], [m[0], p[0]]

    _check_pool_step(o, before, [memory, precision], indices, step)


# -- kdn_compile.fla ----------------------------------------------------------------


def _fla_flags(draw, gen, case: Case, *, kda: bool):
    """FLA's preprocessing flags and head parameters, and what they do (from the docstrings
    of kdn_compile.fla: FLA's l2norm with eps 1e-6, beta sigmoid, the gate formulas)."""
    t = case.tensors
    hv, dk = t["v"].shape[2], t["q"].shape[3]
    flags = {name: draw(st.booleans()) for name in (
        "output_final_state", "use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel",
        "use_gate_in_kernel")}
    flags["allow_neg_eigval"] = flags["use_beta_sigmoid_in_kernel"] and draw(st.booleans())
    exact = {n: x for n, x in t.items()}
    if flags["use_qk_l2norm_in_kernel"]:  # raw q, k of any norm
        for name in ("q", "k"):
            t[name] = t[name] * draw(st.floats(0.1, 10.0))
            x = t[name].double()
            exact[name] = x / (x.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    if flags["use_beta_sigmoid_in_kernel"]:  # logits
        t["beta"] = (4 * torch.randn(t["beta"].shape, generator=gen, dtype=torch.float64)).to(
            t["beta"].dtype)
        exact["beta"] = t["beta"].double().sigmoid() * (2 if flags["allow_neg_eigval"] else 1)
    if flags["use_gate_in_kernel"]:  # raw gate inputs, |g| <= e * softplus(4) < 12
        t["g"] = _uniform(gen, t["g"].shape, -3, 3).to(t["g"].dtype)
        a_log = _uniform(gen, (hv,), -2, 1)
        dt_bias = _uniform(gen, (hv * dk,) if kda else (hv,), -1, 1)
        lower_bound = draw(st.one_of(st.none(), st.floats(-5, -0.1))) if kda else None
        rate = a_log.exp().reshape((hv, 1) if kda else (hv,))
        if lower_bound is not None and draw(st.booleans()):  # lower_bound * sigmoid(g + dt_bias)
            a_log, rate = None, 1.0
        flags.update(A_log=a_log, dt_bias=dt_bias)
        if kda:
            flags["lower_bound"] = lower_bound
        raw = t["g"].double() + dt_bias.reshape((hv, dk) if kda else (hv,))
        exact["g"] = (-rate * F.softplus(raw) if lower_bound is None
                      else lower_bound * torch.sigmoid(rate * raw))
    return flags, exact


def _fla_compare(fn, case: Case, flags: dict, exact: dict, *, backend: str, launchers):
    """``fn`` with FLA's ``flags`` against the token loop on the preprocessed ``exact``
    inputs; float32 inputs on ``"triton"`` must launch the kernel of ``launchers``."""
    dtype = case.tensors["q"].dtype
    tol = TOLERANCE[dtype][0]
    _event(backend, case)
    expected = {launchers[0][1][0]} if dtype == torch.float32 else set()
    with torch.no_grad(), _backend(backend, launchers, expected):
        o, state = fn(**case.tensors, **case.options, **flags)
    e_o, e_state = delta_rule_oracle(**exact, **case.options)
    assert_close(o, e_o, tol, "o")
    if flags["output_final_state"]:
        assert_close(state, e_state, tol, "final_state")
    else:
        assert state is None


FLA_BACKENDS = st.sampled_from(("reference", "triton") if TRITON and INTERPRETED
                               else ("reference",))


def _fla_case(data, per_key):
    case = data.draw(delta_cases(per_key=per_key, dims=KERNEL_DIMS,
                                 dtypes=(torch.float32, torch.float64), max_len=40,
                                 chunk_sizes=None))
    return case, torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))


@pytest.mark.parametrize("fn, per_key, launchers", [
    (fla.chunk_gated_delta_rule, False, GDN_LAUNCHERS),
    (fla.chunk_kda, True, KDA_LAUNCHERS),
    (fla.fused_recurrent_kda, True, RECURRENT_LAUNCHERS),
], ids=["chunk_gated_delta_rule", "chunk_kda", "fused_recurrent_kda"])
@examples(6)
@given(backend=FLA_BACKENDS, data=st.data())
def test_fla_function_is_the_token_loop(fn, per_key, launchers, backend, data):
    case, gen = _fla_case(data, per_key=per_key)
    flags, exact = _fla_flags(data.draw, gen, case, kda=per_key)
    _fla_compare(fn, case, flags, exact, backend=backend, launchers=launchers)


@examples(6)
@given(backend=FLA_BACKENDS, gates=st.sampled_from(("g", "gk", "both", "none")),
       ones=st.booleans(), data=st.data())
def test_fla_fused_recurrent_gated_delta_rule_is_the_token_loop(backend, gates, ones, data):
    """``g`` per value head, ``gk`` per key channel, both (their sum) or neither; ``beta``
    None means ones."""
    case, gen = _fla_case(data, per_key=False)
    use_gate = gates in ("g", "both")
    flags, exact = _fla_flags(data.draw, gen, case, kda=False)
    if not use_gate:  # the flag transforms g only
        flags.update(use_gate_in_kernel=False, A_log=None, dt_bias=None)
        exact["g"] = case.tensors["g"].double()
    t = case.tensors
    b, n_t, hv = t["v"].shape[:3]
    gk = _gates(data.draw, gen, (b, n_t, hv, t["q"].shape[3]))[0]
    per_value = exact["g"]
    if gates in ("gk", "none"):
        t["g"] = None
        per_value = torch.zeros(b, n_t, hv, dtype=torch.float64)
    if gates in ("gk", "both"):
        t["gk"] = gk.to(t["q"].dtype)
        exact["g"] = gk + per_value[..., None]
    else:
        exact["g"] = per_value
    if ones:
        t["beta"] = None
        exact["beta"] = torch.ones(b, n_t, hv, dtype=torch.float64)
        flags["use_beta_sigmoid_in_kernel"] = flags["allow_neg_eigval"] = False
    _fla_compare(fla.fused_recurrent_gated_delta_rule, case, flags, exact, backend=backend,
                 launchers=RECURRENT_LAUNCHERS)


# -- known failures: each flips to a strict XPASS failure when fixed ------------------


@pytest.mark.xfail(strict=True, reason=(
    "the reference op's backward differentiates every output, the unused precision with a "
    "materialized zero gradient: through d(1/p)/dp = -1/p**2, which overflows float32 once "
    "the precision passes ~1e19, that is 0 * inf = NaN (the float32 token loop and the "
    "kernels give finite gradients)"))
def test_diag_kdn_reference_gradients_of_the_output_alone_with_a_huge_precision():
    """omega = 0 (the domain's edge) and retention e^-12: after two tokens the precision is
    e^48 ~ 7e20, finite in float32, and the output's gradients are ordinary numbers."""
    t, k = 2, 1
    x = {"q": torch.ones(1, t, 1, k), "k": torch.ones(1, t, 1, k), "v": torch.ones(1, t, 1, 1),
         "log_alpha": torch.full((1, t, 1, k), -12.0), "omega": torch.zeros(1, t, 1, k),
         "r": torch.ones(1, t, 1), "memory": torch.zeros(1, 1, k, 1),
         "precision": torch.ones(1, 1, k)}
    options = {"scale": 1.0, "info_scale": 0.0}
    leaves = {n: v.clone().requires_grad_() for n, v in x.items()}
    with kdn_compile.use_backend("reference"):
        found = torch.autograd.grad(kdn_compile.diag_kdn(**leaves, **options)[0].sum(),
                                    list(leaves.values()))
    exact_leaves = _float64_leaves(x)
    exact = torch.autograd.grad(diag_kdn_oracle(**exact_leaves, **options)[0].sum(),
                                list(exact_leaves.values()))
    for name, f, e in zip(x, found, exact):
        assert_close(f, e, 1e-4, f"d{name}")
