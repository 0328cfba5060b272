"""Numerics at the edges of the documented domain, against float64 token loops.

GDN's and KDA's chunked forms with hard resets (one or many very negative gates inside a
chunk), the kernels in the interpreter as well as the references; the gate gradient of
fast-decaying channels; Diag-KDN's chunked reference with a tiny observation noise or a huge process noise.
"""

from __future__ import annotations

import math

import pytest
import torch

from _helpers import assert_close, needs_kernels
from _inputs import delta_inputs, kdn_inputs
from kdn_compile import reference as ref

CUDA = torch.cuda.is_available()
GRADS = ("q", "k", "v", "g", "beta", "initial_state")

GATE = 127.5  # just above the floor: such gates are used as they are
# gates of token positions: hard resets among small gates, several in one chunk
RESETS = {
    "one": {20: -1e3},
    "huge": {20: -1e5, 90: -3e38},
    "minus-inf": {20: -math.inf},
    "many": {t: -1e4 for t in range(66, 120, 5)},
    "near-floor": {t: -GATE for t in range(2, 60)} | {t: -1e4 for t in range(70, 80)},
}


def _gdn_case(resets: dict, T: int = 130, seed: int = 0) -> dict:
    x = delta_inputs(B=1, T=T, Hk=1, Hv=2, K=16, V=16, seed=seed)
    x["g"] = 0.1 * x["g"]
    for t, value in resets.items():
        x["g"][0, t, 0] = value  # head 0 resets, head 1 keeps small gates
    return x


def _float64_truth(x: dict, fn=ref.recurrent_delta_rule_reference):
    """Outputs and gradients of the float64 token loop for fixed random cotangents."""
    leaves = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    o, state = fn(**leaves)
    gen = torch.Generator().manual_seed(1)
    do, dstate = torch.randn(o.shape, generator=gen), torch.randn(state.shape, generator=gen)
    loss = (o * do.double()).sum() + (state * dstate.double()).sum()
    grads = torch.autograd.grad(loss, [leaves[n] for n in GRADS])
    return (o, state, dict(zip(GRADS, grads))), (do, dstate)


def _check_float32(x: dict, chunked, tol: float) -> None:
    (o64, s64, g64), (do, dstate) = _float64_truth(x)
    leaves = {n: t.detach().float().requires_grad_() for n, t in x.items()}
    o, state = chunked(**leaves)
    grads = torch.autograd.grad((o * do).sum() + (state * dstate).sum(), [leaves[n] for n in GRADS])
    assert_close(o, o64, tol, "o")
    assert_close(state, s64, tol, "final state")
    for name, grad in zip(GRADS, grads):
        assert_close(grad, g64[name], tol, f"d{name}")
    floored = x["g"] < ref.GDN_GATE_FLOOR
    assert (grads[GRADS.index("g")][floored] == 0).all(), "dg below the floor is the floor's: 0"


@pytest.mark.parametrize("case", RESETS)
def test_gdn_reference_hard_resets_float32(case):
    """The chunked reference in float32 stays within 1e-4 of the float64 token loop for any
    finite (or -inf) gate <= 0: outputs, state and every gradient."""
    _check_float32(_gdn_case(RESETS[case]), ref.chunk_gdn_reference, 1e-4)


@needs_kernels
def test_gdn_kernels_hard_resets_float32():
    """The Triton kernels (forward and backward) with resets of every kind in one input."""
    import kdn_compile

    resets = RESETS["huge"] | RESETS["many"] | {3: -math.inf, 5: -GATE}
    x = _gdn_case(resets)
    x = {n: t.to("cuda" if CUDA else "cpu") for n, t in x.items()}
    with kdn_compile.use_backend("triton"):
        _check_float32(x, kdn_compile.chunk_gdn, 1e-4)


def test_gdn_floor_changes_no_ordinary_gate():
    """In float64 the chunked reference equals the token loop to rounding for gates down to
    just above the floor, and gates below it act as full resets."""
    x = delta_inputs(B=1, T=70, Hk=1, Hv=1, K=8, V=8, seed=3)
    x["g"][0, :, 0] = torch.linspace(-GATE, 0.0, 70, dtype=torch.float64)
    assert_close(ref.chunk_gdn_reference(**x)[0], ref.recurrent_delta_rule_reference(**x)[0],
                 1e-12, "o, gates above the floor")
    x["g"][0, 30, 0] = -1e300
    o = ref.chunk_gdn_reference(**x)[0]
    assert_close(o, ref.recurrent_delta_rule_reference(**x)[0], 1e-12, "o, a reset")


def _kda_case(resets: dict, T: int = 130, seed: int = 0) -> dict:
    """Per-key gates: channels 0-3 of head 0 reset at the given tokens, the rest stay small."""
    x = delta_inputs(B=1, T=T, Hk=1, Hv=2, K=16, V=16, per_key=True, seed=seed)
    x["g"] = 0.1 * x["g"]
    for t, value in resets.items():
        x["g"][0, t, 0, :4] = value
    return x


@pytest.mark.parametrize("case", RESETS)
def test_kda_reference_hard_resets_float32(case):
    """The chunked KDA reference in float32 stays within 1e-4 of the float64 token loop for
    any finite (or -inf) per-key gate <= 0: its cumulative gates are float64 and floored."""
    _check_float32(_kda_case(RESETS[case]), ref.chunk_kda_reference, 1e-4)


@pytest.mark.parametrize("gate", [-1e16, -1e300, -math.inf])
def test_kda_reference_float64_matches_the_token_loop_through_a_huge_gate(gate, seed):
    """In float64 the chunked KDA reference equals the token loop to rounding, for gates down
    to just above the floor and through a huge gate at one token (all its channels)."""
    x = delta_inputs(B=1, T=64, Hk=1, Hv=1, K=8, V=8, per_key=True, seed=seed)
    x["g"][0, :, 0, 0] = torch.linspace(-GATE, 0.0, 64, dtype=torch.float64)
    x["g"][0, 10] = gate
    expected = ref.recurrent_delta_rule_reference(**x)
    for found, truth, what in zip(ref.chunk_kda_reference(**x), expected, ("o", "state")):
        assert_close(found, truth, 1e-12, what)


@needs_kernels
def test_kda_kernels_hard_resets_float32():
    """The two-key kernels (forward and backward, gates floored at -20 as they are read) with
    resets of every kind in one input (the interpreter: 4e-6 at worst, the final state)."""
    import kdn_compile

    resets = RESETS["huge"] | RESETS["many"] | {3: -math.inf, 5: -GATE}
    x = {n: t.to("cuda" if CUDA else "cpu") for n, t in _kda_case(resets).items()}
    with kdn_compile.use_backend("triton"):
        _check_float32(x, kdn_compile.chunk_kda, 1e-4)


@pytest.mark.parametrize("family", ["gdn", "kda"])
def test_reference_gate_gradient_fast_decay(family):
    """``dg`` of channels decaying by e^-10 to e^-20 per token keeps float32 relative accuracy
    in the chunked references (their cumulative gates are float64)."""
    x = (_gdn_case if family == "gdn" else _kda_case)({})
    chunked = ref.chunk_gdn_reference if family == "gdn" else ref.chunk_kda_reference
    x["g"] = -10.0 - 10.0 * torch.rand(x["g"].shape, generator=torch.Generator().manual_seed(2),
                                       dtype=torch.float64)
    (_, _, g64), (do, dstate) = _float64_truth(x)
    leaves = {n: t.detach().float().requires_grad_() for n, t in x.items()}
    o, state = chunked(**leaves)
    (dg,) = torch.autograd.grad((o * do).sum() + (state * dstate).sum(), [leaves["g"]])
    assert_close(dg, g64["g"], 1e-5, "dg")


KDN_NAMES = ("q", "k", "v", "log_alpha", "omega", "r", "memory", "precision")


# noises at the edges of float32: (values, tokens they are set at)
KDN_EXTREMES = {
    "tiny-r": ({"r": 1e-25}, slice(None)), "huge-omega": ({"omega": 1e20}, slice(None)),
    "both": ({"r": 1e-25, "omega": 1e20}, slice(None)), "subnormal-r": ({"r": 1e-44}, [10, 20]),
}


def _check_kdn_float32(extreme: str, run, wrt, in_loss: int) -> None:
    """``run``'s outputs in float32 and the gradients with respect to ``wrt`` of a loss on
    its first ``in_loss`` outputs, within 1e-4 of the float64 token loop's."""
    values, tokens = KDN_EXTREMES[extreme]
    x = kdn_inputs(B=1, T=40, H=2, K=8, V=6)
    for name, value in values.items():
        x[name][:, tokens] = value
    kwargs = {"scale": 8**-0.5, "info_scale": 1.0}
    leaves = {n: t.detach().requires_grad_() for n, t in x.items()}
    expected = ref.diag_kdn_recurrent(*(leaves[n] for n in KDN_NAMES), **kwargs)
    gen = torch.Generator().manual_seed(1)
    cotangents = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in expected]
    loss = sum((t * c).sum() for t, c in zip(expected[:in_loss], cotangents))
    grads64 = torch.autograd.grad(loss, [leaves[n] for n in wrt])
    leaves32 = {n: t.detach().float().requires_grad_() for n, t in x.items()}
    found = run(*(leaves32[n] for n in KDN_NAMES), **kwargs)
    loss = sum((t * c.float()).sum() for t, c in zip(found[:in_loss], cotangents))
    grads = torch.autograd.grad(loss, [leaves32[n] for n in wrt])
    for what, a, e in zip(("o", "memory", "precision"), found, expected):
        assert_close(a, e, 1e-4, what)
    for name, a, e in zip(wrt, grads, grads64):
        assert_close(a, e, 1e-4, f"d{name}")


@pytest.mark.parametrize("extreme", KDN_EXTREMES)
def test_diag_kdn_reference_extreme_noise_float32(extreme):
    """The chunked Diag-KDN reference in float32 stays finite and within 1e-4 of the float64
    token loop where products of the Kalman maps would overflow before renormalizing, and
    where ``I = k^2 / r`` itself overflows float32 (a subnormal ``r`` at some tokens);
    gradients too, except ``dr`` where every ``r`` is tiny: it overflows float32 below
    ``r ~ 1e-19`` (in the token loop as well)."""
    values, tokens = KDN_EXTREMES[extreme]
    wrt = [n for n in KDN_NAMES if n != "r" or "r" not in values or tokens != slice(None)]
    _check_kdn_float32(extreme, ref.diag_kdn_reference, wrt, in_loss=3)


@needs_kernels
@pytest.mark.parametrize("extreme", KDN_EXTREMES)
def test_diag_kdn_gain_kernels_extreme_noise_float32(extreme):
    """The Kalman gain kernels (forward and backward; the memory on its reference at
    ``V = 6``) at the same noises: every output, and every gradient of a loss on ``o`` (a
    zero ``dprecision``), ``dr`` included."""
    import kdn_compile

    def run(*x, **kwargs):
        with kdn_compile.use_backend("triton"):
            found = kdn_compile.diag_kdn(*(t.to("cuda" if CUDA else "cpu") for t in x),
                                         **kwargs, chunk_size=16)
        return tuple(t.cpu() for t in found)

    _check_kdn_float32(extreme, run, KDN_NAMES, in_loss=1)
