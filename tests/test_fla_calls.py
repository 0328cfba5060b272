"""kdn_compile.fla: FLA's calling conventions against a float64 token loop written from
FLA's documented semantics (l2norm eps 1e-6, sigmoid beta, the GDN/KDA gate formulas)."""

from __future__ import annotations

import math

import pytest
import torch

from kdn_compile import fla
from tests._helpers import assert_close, delta_rule_oracle
from tests._inputs import delta_inputs

B, T, H, HV, K, V = 2, 19, 2, 4, 8, 6


def _l2(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _softplus(x):
    return torch.log1p(torch.exp(x))


def oracle(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
           state_v_first=False):
    """Token loop: S = exp(g) S (per head or per key row); S += beta k (v - S^T k)^T;
    o = scale S^T q. Returns (o, final_state [N, HV, K, V]) in float64."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    b_, t_, h_, k_ = q.shape
    hv, v_ = v.shape[2:]
    scale = k_ ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        spans = [(b, 0, t_) for b in range(b_)]
    else:
        c = cu_seqlens.tolist()
        spans = [(0, c[n], c[n + 1]) for n in range(len(c) - 1)]
    o = torch.zeros(b_, t_, hv, v_, dtype=torch.float64)
    finals = []
    for n, (b, start, end) in enumerate(spans):
        if initial_state is None:
            S = torch.zeros(hv, k_, v_, dtype=torch.float64)
        else:
            S = initial_state[n].double().clone()
            S = S.transpose(-1, -2).clone() if state_v_first else S
        for t in range(start, end):
            for h in range(hv):
                kh = h // (hv // h_)
                decay = torch.exp(g[b, t, h])
                S[h] = (decay[:, None] if decay.dim() else decay) * S[h]
                kk = k[b, t, kh]
                S[h] = S[h] + beta[b, t, h] * torch.outer(kk, v[b, t, h] - S[h].T @ kk)
                o[b, t, h] = scale * S[h].T @ q[b, t, kh]
        finals.append(S.transpose(-1, -2) if state_v_first else S)
    return o, torch.stack(finals)


def inputs(*, per_key, b=B, t=T, seed=0, dtype=torch.float64, raw=False):
    """``delta_inputs`` at this file's head sizes, no initial state: unnormalized q/k, beta
    logits and raw gate inputs when ``raw``; else unit q/k, beta in [0, 1) and log decays
    in (-1, 0]."""
    return delta_inputs(b, t, H, HV, K, V, per_key=per_key, seed=seed, dtype=dtype, raw=raw,
                        with_state=False)


def head_params(per_key, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return {"A_log": 0.5 * torch.randn(HV, generator=gen, dtype=torch.float64),
            "dt_bias": torch.randn(HV * K if per_key else HV, generator=gen, dtype=torch.float64)}


def check(actual, expected, tol=1e-10):
    o, s = actual
    eo, es = expected
    assert_close(o, eo, tol, "o")
    if s is None:
        assert es is None
    else:
        assert_close(s, es, tol, "final_state")


ALL = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda",
       "fused_recurrent_kda"]
PER_KEY = {"chunk_kda", "fused_recurrent_kda"}


def _positional(fn, x):
    return (x["q"], x["k"], x["v"], x["g"], x["beta"]) if fn != "fused_recurrent_gated_delta_rule" \
        else (x["q"], x["k"], x["v"], x["g"], None, None, x["beta"])


# ---- preprocessing flags, each function ----------------------------------------------------

GDN_CASES = {
    "plain": {},
    "l2norm": {"use_qk_l2norm_in_kernel": True},
    "beta_sigmoid": {"use_beta_sigmoid_in_kernel": True},
    "neg_eigval": {"use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True},
    "gate": {"use_gate_in_kernel": True},
    "gate_no_dt_bias": {"use_gate_in_kernel": True, "dt_bias": None},
    "all": {"use_qk_l2norm_in_kernel": True, "use_beta_sigmoid_in_kernel": True,
            "use_gate_in_kernel": True, "scale": 0.3},
}


def expected_preprocessing(x, flags, params, *, per_key, lower_bound=None):
    """FLA's documented preprocessing, in float64."""
    q, k, g, beta = x["q"], x["k"], x["g"], x["beta"]
    if flags.get("use_qk_l2norm_in_kernel"):
        q, k = _l2(q), _l2(k)
    if flags.get("use_beta_sigmoid_in_kernel"):
        beta = torch.sigmoid(beta) * (2 if flags.get("allow_neg_eigval") else 1)
    if flags.get("use_gate_in_kernel"):
        A_log = flags.get("A_log", params["A_log"])
        dt_bias = flags.get("dt_bias", params["dt_bias"])
        shape = (HV, K) if per_key else (HV,)
        a = g + (0 if dt_bias is None else dt_bias.view(shape))
        if lower_bound is None:
            decay_rate = torch.exp(A_log).view(HV, 1) if per_key else torch.exp(A_log)
            g = -decay_rate * _softplus(a)
        else:
            scaled = a if A_log is None else torch.exp(A_log).view(HV, 1) * a
            g = lower_bound * torch.sigmoid(scaled)
    return q, k, g, beta


def _call_kwargs(flags, params):
    kw = dict(flags)
    if kw.get("use_gate_in_kernel"):
        kw.setdefault("A_log", params["A_log"])
        kw.setdefault("dt_bias", params["dt_bias"])
    return kw


@pytest.mark.parametrize("fn", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"])
@pytest.mark.parametrize("case", list(GDN_CASES))
def test_gdn_flags_match_the_token_loop(fn, case):
    flags = GDN_CASES[case]
    x = inputs(per_key=False, raw=bool(flags))
    params = head_params(per_key=False)
    h0 = torch.randn(B, HV, K, V, dtype=torch.float64)
    q, k, g, beta = expected_preprocessing(x, flags, params, per_key=False)
    expected = oracle(q, k, x["v"], g, beta, scale=flags.get("scale"), initial_state=h0)
    kw = _call_kwargs(flags, params)
    got = getattr(fla, fn)(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=h0,
                           output_final_state=True, **kw)
    check(got, expected)


KDA_CASES = {
    "plain": ({}, None),
    "l2norm_beta_sigmoid": ({"use_qk_l2norm_in_kernel": True, "use_beta_sigmoid_in_kernel": True},
                            None),
    "gate": ({"use_gate_in_kernel": True}, None),
    "gate_no_dt_bias": ({"use_gate_in_kernel": True, "dt_bias": None}, None),
    "lower_bound": ({"use_gate_in_kernel": True}, -3.0),
    "lower_bound_no_A_log": ({"use_gate_in_kernel": True, "A_log": None}, -5.0),
    "neg_eigval": ({"use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True}, None),
}


@pytest.mark.parametrize("fn", ["chunk_kda", "fused_recurrent_kda"])
@pytest.mark.parametrize("case", list(KDA_CASES))
def test_kda_flags_match_the_token_loop(fn, case):
    flags, lower_bound = KDA_CASES[case]
    x = inputs(per_key=True, raw=bool(flags))
    params = head_params(per_key=True)
    h0 = torch.randn(B, HV, K, V, dtype=torch.float64)
    q, k, g, beta = expected_preprocessing(x, flags, params, per_key=True,
                                           lower_bound=lower_bound)
    expected = oracle(q, k, x["v"], g, beta, initial_state=h0)
    kw = _call_kwargs(flags, params)
    got = getattr(fla, fn)(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0,
                           output_final_state=True, lower_bound=lower_bound, **kw)
    check(got, expected)


def test_kda_safe_gate_changes_nothing():
    x = inputs(per_key=True, raw=True)
    params = head_params(per_key=True)
    kw = dict(use_gate_in_kernel=True, lower_bound=-5.0, output_final_state=True, **params)
    check(fla.chunk_kda(**x, safe_gate=True, disable_recompute=True, chunk_size=32, **kw),
          fla.chunk_kda(**x, **kw), tol=1e-12)


@pytest.mark.parametrize("fn", ["chunk_gated_delta_rule", "fused_recurrent_kda"])
@pytest.mark.parametrize("neg", [False, True])
def test_beta_sigmoid_is_float32_for_half_inputs(fn, neg):
    """FLA's in-kernel sigmoid gives float32 beta from bfloat16 logits; so does ours: the
    same result as float32 ``sigmoid(beta)`` (times 2) passed in."""
    x = {n: a.bfloat16() for n, a in inputs(per_key=fn in PER_KEY, raw=True, t=5).items()}
    x["g"] = -x["g"].float().abs()
    beta = torch.sigmoid(x["beta"].float()) * (2 if neg else 1)
    o, s = getattr(fla, fn)(*_positional(fn, dict(x, beta=beta)), output_final_state=True)
    o2, s2 = getattr(fla, fn)(*_positional(fn, x), output_final_state=True,
                              use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg)
    assert torch.equal(o, o2) and torch.equal(s, s2)


@pytest.mark.parametrize("fn,lower_bound", [(fn, None) for fn in ALL] + [("chunk_kda", -3.0)])
def test_gradients_through_every_flag_match_the_token_loop(fn, lower_bound):
    """Every preprocessing flag on: the gradients of q, k, v, the raw g, beta logits,
    A_log, dt_bias and h0 are those of FLA's formulas (l2norm with eps 1e-6) in float64."""
    per_key = fn in PER_KEY
    flags = {"use_qk_l2norm_in_kernel": True, "use_beta_sigmoid_in_kernel": True,
             "use_gate_in_kernel": True}
    x = inputs(per_key=per_key, raw=True, t=5)
    leaves = {**x, **head_params(per_key), "h0": torch.randn(B, HV, K, V, dtype=torch.float64)}
    leaves = {n: a.clone().requires_grad_() for n, a in leaves.items()}
    extra = {"lower_bound": lower_bound} if per_key else {}
    o, s = getattr(fla, fn)(*_positional(fn, leaves), initial_state=leaves["h0"],
                            output_final_state=True, A_log=leaves["A_log"],
                            dt_bias=leaves["dt_bias"], **flags, **extra)
    q, k, g, beta = expected_preprocessing(leaves, flags, leaves, per_key=per_key,
                                           lower_bound=lower_bound)
    eo, es = delta_rule_oracle(q, k, leaves["v"], g, beta, initial_state=leaves["h0"])
    wo, ws = torch.randn_like(eo), torch.randn_like(es)
    got = torch.autograd.grad((o * wo).sum() + (s * ws).sum(), list(leaves.values()))
    expected = torch.autograd.grad((eo * wo).sum() + (es * ws).sum(), list(leaves.values()))
    for name, a, e in zip(leaves, got, expected):
        assert_close(a, e, 1e-10, name)


# ---- fused recurrent GDN's optional gates and beta -----------------------------------------

def test_fused_recurrent_gdn_gk_g_and_missing_beta():
    x = inputs(per_key=False)
    gk = inputs(per_key=True, seed=3)["g"]
    o, s = oracle(x["q"], x["k"], x["v"], gk + x["g"][..., None], x["beta"])
    check(fla.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], gk, beta=x["beta"],
                                               output_final_state=True), (o, s))
    check(fla.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], gk=gk, beta=x["beta"],
                                               output_final_state=True),
          oracle(x["q"], x["k"], x["v"], gk, x["beta"]))
    ones = torch.ones_like(x["beta"])
    check(fla.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], output_final_state=True),
          oracle(x["q"], x["k"], x["v"], torch.zeros_like(x["g"]), ones))


# ---- packed sequences, states, layouts, dtypes ---------------------------------------------

@pytest.mark.parametrize("fn", ALL)
def test_cu_seqlens_with_initial_state(fn):
    x = inputs(per_key=fn in PER_KEY, b=1, t=37, raw=True)
    params = head_params(per_key=fn in PER_KEY)
    cu = torch.tensor([0, 5, 5, 30, 37])
    h0 = torch.randn(4, HV, K, V, dtype=torch.float64)
    flags = {"use_qk_l2norm_in_kernel": True, "use_beta_sigmoid_in_kernel": True,
             "use_gate_in_kernel": True}
    q, k, g, beta = expected_preprocessing(x, flags, params, per_key=fn in PER_KEY)
    expected = oracle(q, k, x["v"], g, beta, initial_state=h0, cu_seqlens=cu)
    got = getattr(fla, fn)(*_positional(fn, x), initial_state=h0, output_final_state=True,
                           cu_seqlens=cu, **_call_kwargs(flags, params))
    check(got, expected)


@pytest.mark.parametrize("fn", ALL)
def test_output_final_state_false_gives_none_and_no_initial_state(fn):
    x = inputs(per_key=fn in PER_KEY)
    o, s = getattr(fla, fn)(*_positional(fn, x))
    assert s is None
    assert_close(o, oracle(x["q"], x["k"], x["v"], x["g"], x["beta"])[0], 1e-10, "o")


@pytest.mark.parametrize("fn", ALL)
def test_state_v_first(fn):
    x = inputs(per_key=fn in PER_KEY)
    h0 = torch.randn(B, HV, V, K, dtype=torch.float64)
    expected = oracle(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0,
                      state_v_first=True)
    check(getattr(fla, fn)(*_positional(fn, x), initial_state=h0, output_final_state=True,
                           state_v_first=True), expected)


@pytest.mark.parametrize("fn", ALL)
def test_float32_inputs_give_float32_state_and_outputs_in_v_dtype(fn):
    x = inputs(per_key=fn in PER_KEY, dtype=torch.float32)
    o, s = getattr(fla, fn)(*_positional(fn, x), output_final_state=True,
                            use_qk_l2norm_in_kernel=True)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    q, k = _l2(x["q"].double()), _l2(x["k"].double())
    check((o, s), oracle(q, k, x["v"], x["g"], x["beta"]), tol=1e-5)


# ---- what is refused -----------------------------------------------------------------------

REFUSED = [
    ("chunk_gated_delta_rule", {"head_first": True}, "head_first"),
    ("chunk_gated_delta_rule", {"transpose_state_layout": True},
     "transpose_state_layout=True .*use state_v_first"),
    ("chunk_gated_delta_rule", {"cp_context": object()}, "cp_context"),
    ("chunk_gated_delta_rule", {"some_option": 1}, "some_option"),
    ("fused_recurrent_gated_delta_rule", {"gv": "GV"}, "gv"),
    ("fused_recurrent_gated_delta_rule", {"head_first": True}, "head_first"),
    ("chunk_kda", {"return_intermediate_states": True}, "return_intermediate_states"),
    ("chunk_kda", {"use_graph": True, "max_num_seqs": 4}, "max_num_seqs"),
    ("chunk_kda", {"cp_context": object()}, "cp_context"),
    ("fused_recurrent_kda", {"ssm_state_indices": "idx"},
     r"ssm_state_indices='idx' \(ssm_state_indices: .*kdn_compile.delta_rule_decode"),
]


@pytest.mark.parametrize("fn,kwargs,name", REFUSED,
                         ids=[f"{f}-{'-'.join(kw)}" for f, kw, _ in REFUSED])
def test_unsupported_arguments_raise_type_error_naming_them(fn, kwargs, name):
    x = inputs(per_key=fn in PER_KEY)
    if fn == "fused_recurrent_gated_delta_rule":
        kwargs = {k: (x["g"][..., None].expand(B, T, HV, V) if v == "GV" else v)
                  for k, v in kwargs.items()}
    with pytest.raises(TypeError, match=name):
        getattr(fla, fn)(*_positional(fn, x), **kwargs)


def test_head_first_false_asks_for_the_layout_they_take():
    """Older FLA releases' ``head_first=False`` is token-major, what every function takes."""
    x = inputs(per_key=False)
    expected = fla.chunk_gated_delta_rule(*_positional("chunk_gated_delta_rule", x))
    for fn in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"):
        check(getattr(fla, fn)(*_positional(fn, x), head_first=False), expected, tol=1e-10)
    with pytest.raises(TypeError, match="output_final_state gives the last one"):
        fla.chunk_kda(*_positional("chunk_kda", inputs(per_key=True)),
                      return_intermediate_states=True)


INVALID = [
    ("chunk_gated_delta_rule", {"allow_neg_eigval": True}, "use_beta_sigmoid_in_kernel"),
    ("chunk_gated_delta_rule", {"use_gate_in_kernel": True}, "A_log"),
    ("chunk_gated_delta_rule", {"chunk_size": 128}, "chunk_size"),
    ("chunk_kda", {"chunk_size": 16}, "chunk_size"),
    ("chunk_kda", {"use_gate_in_kernel": True, "safe_gate": True, "lower_bound": -6.0},
     "lower_bound"),
    ("fused_recurrent_kda", {"use_gate_in_kernel": True}, "A_log"),
    ("fused_recurrent_kda", {"use_gate_in_kernel": True, "A_log": torch.zeros(HV),
                             "dt_bias": torch.zeros(HV)}, "dt_bias"),
]


@pytest.mark.parametrize("fn,kwargs,name", INVALID, ids=[f"{f}-{n}" for f, _, n in INVALID])
def test_invalid_values_raise_value_error(fn, kwargs, name):
    x = inputs(per_key=fn in PER_KEY)
    with pytest.raises(ValueError, match=name):
        getattr(fla, fn)(*_positional(fn, x), **kwargs)


def _gk(b=B, hv=HV):
    return -torch.rand(b, T, hv, K, dtype=torch.float64)


# (function, the change to its inputs, the exception, its message): gates and betas of shapes
# FLA does not take (which broadcast, index or get read as another layout if let through)
BAD_SHAPES = [
    ("fused_recurrent_gated_delta_rule", {"gk": _gk(b=1)}, ValueError,
     r"gk must be \[B, T, HV, K\] = \(2, 19, 4, 8\), got \(1, 19, 4, 8\)"),
    ("fused_recurrent_gated_delta_rule", {"gk": _gk(hv=H)}, ValueError,
     r"gk must be \[B, T, HV, K\] = \(2, 19, 4, 8\), got \(2, 19, 2, 8\)"),
    ("fused_recurrent_gated_delta_rule", {"g": _gk()}, ValueError,
     r"g must be \[B, T, HV\] = \(2, 19, 4\), got \(2, 19, 4, 8\)"),
    ("fused_recurrent_gated_delta_rule", {"beta": torch.rand(B, T, HV, V)}, ValueError,
     r"beta must be \[B, T, HV\] = \(2, 19, 4\): FLA's per-value beta \[B, T, HV, V\] is not "
     r"supported, got \(2, 19, 4, 6\)"),
    ("fused_recurrent_kda", {"beta": torch.rand(B, T, HV, V)}, ValueError,
     r"FLA's per-value beta \[B, T, HV, V\] is not supported"),
    ("fused_recurrent_kda", {"g": _gk(hv=1), "use_gate_in_kernel": True, "A_log": torch.zeros(1)},
     ValueError, r"g must be \[B, T, HV, K\] = \(2, 19, 4, 8\), got \(2, 19, 1, 8\)"),
    ("chunk_kda", {"g": torch.zeros(K), "use_gate_in_kernel": True, "A_log": torch.zeros(HV)},
     ValueError, r"g must be \[B, T, HV, K\] = \(2, 19, 4, 8\), got \(8,\)"),
    ("chunk_gated_delta_rule", {"g": None, "use_gate_in_kernel": True, "A_log": torch.zeros(HV)},
     TypeError, r"g must be a torch.Tensor, got NoneType"),
    ("chunk_kda", {"use_gate_in_kernel": True, "lower_bound": math.nan}, ValueError,
     r"lower_bound must be finite, got nan"),
    ("fused_recurrent_kda", {"use_gate_in_kernel": True, "lower_bound": math.inf}, ValueError,
     r"lower_bound must be finite, got inf"),
]


@pytest.mark.parametrize("gate,args,message", [
    ("gdn_gate", (torch.zeros(2, 3, HV), None),
     r"A_log must be a torch.Tensor of Hv elements, got None"),
    ("kda_gate", (torch.zeros(2, 3, HV, K), None),
     r"A_log must be a torch.Tensor of Hv elements when lower_bound is not set, got None"),
    ("gdn_gate", (None, torch.zeros(HV)), r"g must be a torch.Tensor, got NoneType"),
    ("kda_gate", (torch.zeros(2, 3, HV, K), None, None, "x"),
     r"lower_bound must be a float, got str"),
    ("l2norm", (torch.tensor([3, 4]),),
     r"x must be float16, bfloat16, float32 or float64, got torch.int64"),
])
def test_preprocessing_helpers_name_a_bad_argument(gate, args, message):
    with pytest.raises(TypeError, match=message):
        getattr(fla, gate)(*args)


@pytest.mark.parametrize("gate,g,message", [
    ("gdn_gate", torch.zeros(2, 3, HV, K),
     r"g must have 3 dims, \[B, T, H\], got shape \(2, 3, 4, 8\)"),
    ("kda_gate", torch.zeros(2, 3, HV),
     r"g must have 4 dims, \[B, T, H, K\], got shape \(2, 3, 4\)"),
])
def test_gate_helpers_check_the_rank_of_g(gate, g, message):
    with pytest.raises(ValueError, match=message):
        getattr(fla, gate)(g, torch.zeros(HV))


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("fn,change,error,message", BAD_SHAPES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_SHAPES)])
def test_gates_and_betas_of_other_shapes_raise_naming_them(fn, change, error, message, mode):
    x = inputs(per_key=fn in PER_KEY)
    call = getattr(fla, fn)
    if mode == "compiled":
        torch._dynamo.reset()
        call = torch.compile(call, fullgraph=True, dynamic=True, backend="eager")
    named = dict(zip(("q", "k", "v"), _positional(fn, x)[:3]), g=x["g"], beta=x["beta"])
    with pytest.raises(error, match=message):
        call(**{**named, **change})


def test_flags_must_be_bools():
    x = inputs(per_key=False)
    with pytest.raises(TypeError, match="output_final_state"):
        fla.chunk_gated_delta_rule(*_positional("chunk_gated_delta_rule", x),
                                   output_final_state=1)


# ---- compile and export --------------------------------------------------------------------

class FLACall(torch.nn.Module):
    """Calls one FLA-style function with every preprocessing flag on."""

    def __init__(self, fn):
        super().__init__()
        self.fn, per_key = fn, fn in PER_KEY
        p = head_params(per_key)
        self.A_log = torch.nn.Parameter(p["A_log"].float())
        self.dt_bias = torch.nn.Parameter(p["dt_bias"].float())

    def forward(self, q, k, v, g, beta, h0):
        o, s = getattr(fla, self.fn)(
            *_positional(self.fn, {"q": q, "k": k, "v": v, "g": g, "beta": beta}),
            initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True, A_log=self.A_log,
            dt_bias=self.dt_bias,
        )
        return o, s


def _module_args(fn):
    x = inputs(per_key=fn in PER_KEY, t=11, raw=True, dtype=torch.float32)
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], torch.randn(B, HV, K, V))


@pytest.mark.parametrize("fn", ALL)
def test_compiles_fullgraph(fn):
    torch._dynamo.reset()
    module, args = FLACall(fn), _module_args(fn)
    expected = module(*args)
    got = torch.compile(module, fullgraph=True)(*args)
    for a, e in zip(got, expected):
        assert_close(a, e, 1e-5, fn)


@pytest.mark.parametrize("fn", ALL)
def test_compiles_fullgraph_dynamic_with_packed_sequences(fn):
    """``dynamic=True``: packed sequences of two layouts and lengths through one
    compiled call, every flag on (KDA with ``lower_bound``, GDN's recurrence with ``gk``);
    Dynamo and AOT autograd only (Inductor: :func:`test_compiles_fullgraph`)."""
    torch._dynamo.reset()
    per_key = fn in PER_KEY
    params = {n: a.float() for n, a in head_params(per_key).items()}
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True, **params)
    if per_key:
        kw["lower_bound"] = -4.0
    compiled = torch.compile(getattr(fla, fn), fullgraph=True, dynamic=True, backend="aot_eager")
    for t, cu in ((11, [0, 4, 11]), (14, [0, 1, 1, 14])):
        x = {n: a.float() for n, a in inputs(per_key=per_key, b=1, t=t, raw=True).items()}
        args = _positional(fn, x)
        if fn == "fused_recurrent_gated_delta_rule":
            args = args[:4] + (-torch.rand(1, t, HV, K),) + args[5:]
        call = dict(kw, cu_seqlens=torch.tensor(cu),
                    initial_state=torch.randn(len(cu) - 1, HV, K, V))
        for a, e in zip(compiled(*args, **call), getattr(fla, fn)(*args, **call)):
            assert_close(a, e, 1e-5, fn)


@pytest.mark.parametrize("fn", ALL)
def test_exports(fn):
    module, args = FLACall(fn), _module_args(fn)
    exported = torch.export.export(module, args)
    assert any("kdn" in str(n.target) for n in exported.graph.nodes if n.op == "call_function")
    for a, e in zip(exported.module()(*args), module(*args)):
        assert_close(a, e, 1e-6, fn)


def test_l2norm_eps_is_fla_s():
    x = torch.full((1, 1, 1, 4), 1e-4, dtype=torch.float64)
    assert math.isclose(float(fla.l2norm(x)[0, 0, 0, 0]), 1e-4 / math.sqrt(4e-8 + 1e-6),
                        rel_tol=1e-12)


# ---- the Triton kernels (CUDA) --------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("fn", ALL)
def test_cuda_kernels_match_the_token_loop_and_fla(fn):
    """Head size 64 (the kernels' path), packed sequences and initial states, float32 on
    CUDA, against the float64 loop; and against FLA's own function where FLA is installed."""
    per_key = fn in PER_KEY
    t, h, hv, d = 150, 2, 4, 64
    cu = torch.tensor([0, 40, 41, 150])
    x = delta_inputs(1, t, h, hv, d, d, per_key=per_key, seed=5, gate_scale=0.2, N=3)
    h0 = x.pop("initial_state")
    expected = oracle(**x, initial_state=h0, cu_seqlens=cu)
    cuda = {n: a.float().cuda() for n, a in x.items()}
    call = dict(initial_state=h0.float().cuda(), output_final_state=True,
                cu_seqlens=cu.cuda())
    got = getattr(fla, fn)(*_positional(fn, cuda), **call)
    for a, e, what in zip(got, expected, ("o", "final_state")):
        assert_close(a.cpu(), e, 1e-4, f"{fn} {what}")
    fla_ref = pytest.importorskip("fla.ops.kda" if per_key else "fla.ops.gated_delta_rule")
    # FLA's own call with q and k repeated to the value heads (grouped heads mean exactly that)
    repeated = dict(cuda, q=cuda["q"].repeat_interleave(hv // h, 2),
                    k=cuda["k"].repeat_interleave(hv // h, 2))
    theirs = getattr(fla_ref, fn)(*_positional(fn, repeated), **call)
    for a, e, what in zip(got, theirs, ("o", "final_state")):
        # FLA's float32 chunked GDN multiplies in TF32: 1.0e-3 from ours measured on an H200
        assert_close(a, e, 5e-3, f"{fn} {what} against FLA")
