"""Property-based tests: kdn_compile.fla's functions with FLA's preprocessing flags and head
parameters against the float64 token loop on the preprocessed inputs (the drawing and the
comparison: ``_properties.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from _helpers import assert_close, delta_rule_oracle
from _properties import (
    GDN_LAUNCHERS, INTERPRETED, KDA_LAUNCHERS, KERNEL_DIMS, RECURRENT_LAUNCHERS, TOLERANCE,
    TRITON, Case, _backend, _event, _gates, _uniform, delta_cases, examples,
)
from kdn_compile import fla


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
