"""Debug mode (kdn_compile.debug): value checks on the device, eager and compiled.

On the CPU ``torch._assert_async`` raises a RuntimeError with the message at once in eager
mode and from the compiled code under ``torch.compile``; on CUDA the same checks are device-side
asserts (no host sync), which a CPU test cannot observe.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import kdn_compile
from _helpers import assert_close
from _inputs import delta_inputs, kdn_inputs
from kdn_compile import debug
from kdn_compile import reference as ref

KDN_KWARGS = {"scale": 8**-0.5, "info_scale": 1.0}


@pytest.fixture
def debug_on():
    previous = kdn_compile.get_debug()
    kdn_compile.set_debug(True)
    yield
    kdn_compile.set_debug(previous)


def _poisoned(x: dict, name: str, value: float) -> dict:
    x = dict(x)
    x[name] = x[name].clone()
    x[name].view(-1)[3] = value
    return x


def _chunk_gdn(x):
    return kdn_compile.chunk_gdn(**x)


def _chunk_kda(x):
    return kdn_compile.chunk_kda(**x)


def _recurrent(x):
    return kdn_compile.recurrent_delta_rule(**x)


def _diag_kdn(x):
    return kdn_compile.diag_kdn(*x.values(), **KDN_KWARGS)


def _delta_rule_decode(x):
    pool = torch.zeros(3, x["v"].shape[2], x["k"].shape[3], x["v"].shape[3], dtype=torch.float32)
    with torch.no_grad():
        return kdn_compile.delta_rule_decode(**x, state_pool=pool,
                                             state_indices=torch.tensor([2]))


def _diag_kdn_decode(x):
    b, _, h, dk = x["k"].shape
    memory, precision = torch.zeros(3, h, dk, x["v"].shape[3]), torch.ones(3, h, dk)
    x = {n: t for n, t in x.items() if n not in ("memory", "precision")}
    return kdn_compile.diag_kdn_decode(*x.values(), memory, precision, torch.tensor([1]),
                                       **KDN_KWARGS)


def _delta(per_key=False, T=9, state=True):
    x = delta_inputs(B=1, T=T, Hk=1, Hv=2, K=8, V=8, per_key=per_key, dtype=torch.float32,
                     with_state=state)
    return x


def _kdn(T=9):
    return kdn_inputs(B=1, T=T, H=2, K=8, V=8, dtype=torch.float32)


# function, its name in the message, inputs, argument, bad value, what the message says
CASES = [
    (_chunk_gdn, "chunk_gdn", _delta, "g", 0.5, "<= 0 and not NaN"),
    (_chunk_gdn, "chunk_gdn", _delta, "g", float("inf"), "<= 0 and not NaN"),
    (_chunk_gdn, "chunk_gdn", _delta, "g", float("nan"), "<= 0 and not NaN"),
    (_chunk_gdn, "chunk_gdn", _delta, "v", float("nan"), "finite"),
    (_chunk_gdn, "chunk_gdn", _delta, "q", float("inf"), "finite"),
    (_chunk_gdn, "chunk_gdn", _delta, "beta", float("nan"), "finite"),
    (_chunk_gdn, "chunk_gdn", _delta, "initial_state", float("nan"), "finite"),
    (_chunk_kda, "chunk_kda", lambda: _delta(per_key=True), "g", 1e-3, "<= 0 and not NaN"),
    (_chunk_kda, "chunk_kda", lambda: _delta(per_key=True), "g", float("nan"),
     "<= 0 and not NaN"),
    (_recurrent, "recurrent_delta_rule", _delta, "k", float("nan"), "finite"),
    (_recurrent, "recurrent_delta_rule", _delta, "g", float("nan"), "<= 0 and not NaN"),
    (_diag_kdn, "diag_kdn", _kdn, "log_alpha", 0.1, "finite and <= 0"),
    (_diag_kdn, "diag_kdn", _kdn, "omega", -1.0, "finite and >= 0"),
    (_diag_kdn, "diag_kdn", _kdn, "r", 0.0, "finite and > 0"),
    (_diag_kdn, "diag_kdn", _kdn, "precision", 0.0, "finite and > 0"),
    (_diag_kdn, "diag_kdn", _kdn, "memory", float("inf"), "finite"),
    (_delta_rule_decode, "delta_rule_decode", lambda: _delta(T=2, state=False), "g", 2.0,
     "<= 0 and not NaN"),
    (_diag_kdn_decode, "diag_kdn_decode", lambda: _kdn(T=2), "r", -1.0, "finite and > 0"),
]
IDS = [f"{c[1]}-{c[3]}-{c[4]}" for c in CASES]


@pytest.mark.parametrize("fn,function,make,name,value,words", CASES, ids=IDS)
def test_eager_error_names_function_and_argument(debug_on, fn, function, make, name, value,
                                                 words):
    x = make()
    fn(x)  # valid inputs pass
    match = f"kdn_compile debug: {function}: {name} must be {words}"
    with pytest.raises(RuntimeError, match=match):
        fn(_poisoned(x, name, value))


@pytest.mark.parametrize("fn,per_key", [
    (_chunk_gdn, False), (_chunk_kda, True), (_recurrent, False), (_recurrent, True),
    (_delta_rule_decode, False), (_delta_rule_decode, True),
], ids=["chunk_gdn", "chunk_kda", "recurrent", "recurrent-per-key", "decode", "decode-per-key"])
def test_minus_inf_gates_pass_as_hard_resets(debug_on, fn, per_key):
    """A gate of -inf is a hard reset where the function takes it: debug mode lets it through
    and the output is the float64 token loop's."""
    x = _delta(per_key=per_key, T=2 if fn is _delta_rule_decode else 9,
               state=fn is not _delta_rule_decode)
    x["g"][0, 1, 0] = float("-inf")
    o = fn(x)
    o = o if fn is _delta_rule_decode else o[0]
    expected, _ = ref.recurrent_delta_rule_reference(**{n: t.double() for n, t in x.items()})
    assert_close(o, expected, 1e-5, "o")


def test_w_quantizer_result_is_checked(debug_on):
    """A quantizer that returns NaN for valid inputs is named, eager and compiled."""

    def fn(x):
        return kdn_compile.chunk_gdn(**x, w_quantizer=lambda w: w / w.abs().amax(-1, keepdim=True))

    x = _delta()
    x["k"][0, 4, 0] = 0.0  # a zero row of W: 0 / 0
    torch._dynamo.reset()
    for f in (fn, torch.compile(fn, fullgraph=True)):
        with pytest.raises(RuntimeError, match=r"chunk_gdn: w_quantizer\(W\) must be finite"):
            f(x)


def test_off_checks_nothing():
    previous = kdn_compile.get_debug()
    kdn_compile.set_debug(False)
    try:
        o, _ = _chunk_gdn(_poisoned(_delta(), "g", 0.5))  # the contract is the caller's
    finally:
        kdn_compile.set_debug(previous)
    assert o.shape == (1, 9, 2, 8)


@pytest.mark.parametrize("fn,function,make,name,value", [
    (_chunk_gdn, "chunk_gdn", _delta, "g", 0.5),
    (_diag_kdn, "diag_kdn", _kdn, "r", 0.0),
], ids=["chunk_gdn-g", "diag_kdn-r"])
def test_compiled_fullgraph_raises_the_message(debug_on, fn, function, make, name, value):
    """No graph break (fullgraph), no host sync; the compiled code raises the message."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    x = make()
    compiled(x)
    with pytest.raises(RuntimeError, match=f"kdn_compile debug: {function}: {name} must be"):
        compiled(_poisoned(x, name, value))


def test_switching_recompiles():
    """torch.compile guards on the switch: a graph traced with it off has no checks, turning
    it on traces them in."""
    previous = kdn_compile.get_debug()
    torch._dynamo.reset()
    compiled = torch.compile(_chunk_gdn, fullgraph=True)
    bad = _poisoned(_delta(), "g", 0.5)
    try:
        kdn_compile.set_debug(False)
        compiled(bad)
        kdn_compile.set_debug(True)
        with pytest.raises(RuntimeError, match="chunk_gdn: g must be <= 0 and not NaN"):
            compiled(bad)
        kdn_compile.set_debug(False)
        compiled(bad)
    finally:
        kdn_compile.set_debug(previous)


def test_environment_variable_and_bad_switch(monkeypatch):
    """Off unless KDN_DEBUG is set at import to something other than empty, 0, false, no or
    off."""
    try:
        for value, on in (("1", True), ("yes", True), ("0", False), ("", False), (None, False),
                          ("false", False), ("Off", False), (" NO ", False)):
            if value is None:
                monkeypatch.delenv("KDN_DEBUG")
            else:
                monkeypatch.setenv("KDN_DEBUG", value)
            assert importlib.reload(debug).get_debug() is on, value
    finally:
        monkeypatch.undo()
        importlib.reload(debug)
    with pytest.raises(TypeError, match="enabled must be a bool, got int"):
        kdn_compile.set_debug(1)
