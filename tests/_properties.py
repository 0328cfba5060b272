"""The property-based tests' machinery (``test_properties*.py``): every public function
against a float64 token loop.

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

Bounded for CI: the ``ci`` profile (registered and loaded here) is derandomized (the same
examples every run) with a few examples per test; ``HYPOTHESIS_PROFILE=deep`` draws ten
times as many fresh ones.
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
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st

import kdn_compile
import kdn_compile.ops.decode
import kdn_compile.ops.gdn
import kdn_compile.ops.kda
import kdn_compile.ops.kdn
import kdn_compile.ops.recurrent
from _helpers import assert_close, count_calls, interpreting
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


# head sizes of the kernel cases (powers of two the kernels take)
KERNEL_DIMS = st.sampled_from((16, 32))
