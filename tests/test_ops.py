"""The kdn op layer: opcheck on every overload, public == reference, compile, backend switch."""

from __future__ import annotations

import pytest
import torch

import kdn_compile
from _helpers import assert_close
from _inputs import delta_inputs, kdn_inputs
from kdn_compile import reference as ref

ops = torch.ops.kdn


def _gdn_args(x, cu=None, chunk=8, svf=False, qdq=False):
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], x.get("initial_state"), cu, chunk,
            0.35, svf, qdq, 8)


def _kda_args(x, cu=None, chunk=8, svf=False):
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], x.get("initial_state"), cu, chunk,
            0.35, svf)


def _kdn_args(x, cu=None):
    return (x["q"], x["k"], x["v"], x["log_alpha"], x["omega"], x["r"], x["memory"],
            x["precision"], cu, 0.5, 0.8, 8)


def _grads_like(outputs, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outputs]


def _opcheck_cases():
    cu = torch.tensor([0, 3, 3, 12], dtype=torch.int64)
    cases = []
    for grad in (True, False):
        g = delta_inputs(B=1, T=12, Hk=1, Hv=2, K=4, V=3, requires_grad=grad, N=3)
        gk = delta_inputs(B=1, T=12, Hk=1, Hv=2, K=4, V=3, per_key=True, requires_grad=grad, N=3)
        one = delta_inputs(B=2, T=1, K=4, V=3, requires_grad=grad)
        kd = kdn_inputs(B=1, T=10, H=2, K=4, V=3, requires_grad=grad, N=3)
        tag = "grad" if grad else "nograd"
        cases += [
            (f"chunk_gdn-varlen-{tag}", ops.chunk_gdn.default, _gdn_args(g, cu)),
            (f"chunk_gdn-T1-qdq-{tag}", ops.chunk_gdn.default, _gdn_args(one, qdq=True)),
            (f"chunk_gdn_reference-{tag}", ops.chunk_gdn_reference.default, _gdn_args(one)),
            (f"chunk_kda-varlen-{tag}", ops.chunk_kda.default, _kda_args(gk, cu)),
            (f"chunk_kda_reference-{tag}", ops.chunk_kda_reference.default, _kda_args(gk, cu)),
            (f"recurrent-{tag}", ops.recurrent_delta_rule_reference.default,
             _kda_args(gk, cu)[:7] + (0.35, False)),
            (f"diag_kdn-varlen-{tag}", ops.diag_kdn.default, _kdn_args(kd, torch.tensor([0, 4, 4, 10]))),
            (f"diag_kdn_reference-{tag}", ops.diag_kdn_reference.default,
             _kdn_args(kdn_inputs(B=2, T=1, H=2, K=4, V=3, requires_grad=grad))),
            (f"wy_operands-{tag}", ops.gdn_wy_operands_reference.default,
             (g["k"], g["v"], g["g"], g["beta"], cu, 8)),
            (f"wy_operands_kernel_op-{tag}", ops.gdn_wy_operands.default,
             (g["k"], g["v"], g["g"], g["beta"], cu, 8)),
            (f"state_fp8_qdq-{tag}", ops.state_fp8_qdq_reference.default,
             (torch.randn(2, 4, 10, dtype=torch.float64, requires_grad=grad), 4)),
            # float32: the kernel eagerly (CUDA; the interpreter), the reference traced
            (f"state_fp8_qdq_kernel_op-{tag}", ops.state_fp8_qdq.default,
             (torch.randn(2, 4, 10, requires_grad=grad), 4)),
            (f"recurrent_kernel_op-{tag}", ops.recurrent_delta_rule.default,
             _kda_args(gk, cu)[:7] + (0.35, False)),
            (f"mobius_product-{tag}", ops.mobius_product_reference.default,
             ((torch.rand(2, 5, 2, 3, 4, dtype=torch.float64) + 0.1).requires_grad_(grad),)),
        ]
    cases += _decode_cases()
    w, u = ref.gdn_wy_operands_reference(g["k"], g["v"], g["g"], g["beta"], chunk_size=8,
                                         cu_seqlens=cu)
    wy_args = (g["q"], g["k"], w.requires_grad_(), u.requires_grad_(), g["g"],
               g["initial_state"], cu, 8, 0.35, False, True, 8)
    cases.append(("wy_recurrence-grad", ops.gdn_wy_recurrence_reference.default, wy_args))
    cases.append(("wy_recurrence_kernel_op-grad", ops.gdn_wy_recurrence.default, wy_args))
    # Every backward op, on the arguments its forward saw and random output gradients.
    for name, op, args in list(cases):
        if not name.endswith("-grad") or not op._schema.name.endswith("_reference"):
            continue
        bwd = getattr(ops, op._schema.name.split("::")[1] + "_bwd").default
        outputs = op(*args)
        outputs = [outputs] if isinstance(outputs, torch.Tensor) else outputs
        cases.append((name + "-bwd", bwd, tuple(a.detach() if isinstance(a, torch.Tensor) else a
                                                for a in args) + tuple(_grads_like(outputs))))
    return cases


def _decode_cases():
    """The pool ops (no autograd: decoding runs without it), each pool dtype, and the
    slot-writing op of the layers' caches."""
    x = delta_inputs(B=3, T=2, Hk=1, Hv=2, K=4, V=3, dtype=torch.float32, with_state=False)
    idx = torch.tensor([2, -1, 0])
    cases = []
    for pool_dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        pool = torch.randn(4, 2, 4, 3).to(pool_dtype)
        scales = torch.rand(4, 2, 1) + 0.5 if pool_dtype == torch.float8_e4m3fn else None
        inter = torch.zeros(3, 2, 2, 4, 3)
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"], pool, idx, 0.35, False, scales, inter)
        for op in (ops.delta_rule_decode.default, ops.delta_rule_decode_reference.default):
            cases.append((f"{op._schema.name}-{pool_dtype}", op, args))
            # a verification: the pool is read, not written
            cases.append((f"{op._schema.name}-{pool_dtype}-verify", op, args + (False,)))
    kd = kdn_inputs(B=3, T=2, H=2, K=4, V=3, dtype=torch.float32)
    args = (kd["q"], kd["k"], kd["v"], kd["log_alpha"], kd["omega"], kd["r"],
            torch.randn(4, 2, 4, 3), torch.rand(4, 2, 4) + 0.5, idx, 0.5, 0.8, None, None)
    verify = args[:-2] + (torch.zeros(3, 2, 2, 4, 3), torch.zeros(3, 2, 2, 4), False)
    for op in (ops.diag_kdn_decode.default, ops.diag_kdn_decode_reference.default):
        cases.append((op._schema.name, op, args))
        cases.append((f"{op._schema.name}-verify", op, verify))
    cu = torch.tensor([0, 70, 70, 140])  # prefix-cache checkpoints: 1, 0 and 1 kept
    for per_key in (False, True):
        x = delta_inputs(B=1, T=140, Hk=1, Hv=2, K=4, V=3, per_key=per_key, N=3)
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], cu, 0.5, 64, 2)
        for op in (ops.chunk_checkpoints.default, ops.chunk_checkpoints_reference.default):
            cases.append((f"{op._schema.name}-{'kda' if per_key else 'gdn'}", op, args))
    kd = kdn_inputs(B=1, T=140, H=2, K=4, V=3, dtype=torch.float32, N=3)
    args = tuple(kd[n] for n in ("q", "k", "v", "log_alpha", "omega", "r", "memory",
                                 "precision")) + (cu, 0.5, 0.8, 64, 2)
    for op in (ops.diag_kdn_checkpoints.default, ops.diag_kdn_checkpoints_reference.default):
        cases.append((op._schema.name, op, args))
    for pool_dtype in (torch.float32, torch.float8_e4m3fn):  # rows into slots, padding skipped
        args = (torch.randn(4, 2, 3).to(pool_dtype), idx, torch.randn(3, 2, 3).to(pool_dtype))
        for op in (ops.scatter_slots.default, ops.scatter_slots_reference.default):
            cases.append((f"{op._schema.name}-{pool_dtype}", op, args))
    return cases


CASES = _opcheck_cases()


@pytest.mark.parametrize("name,op,args", CASES, ids=[c[0] for c in CASES])
def test_opcheck(name, op, args):
    # opcheck's schema test compares values with arithmetic float8 lacks on the CPU
    float8 = any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args)
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(op, args, test_utils=utils if float8 else "ALL")


def test_every_kdn_op_is_opchecked():
    checked = {op._schema.name for _, op, _ in CASES}
    registered = {
        f"kdn::{name}" for name in dir(ops)
        if isinstance(getattr(ops, name), torch._ops.OpOverloadPacket)
    }
    # Kernel backward ops are opchecked with their kernels (tests/test_*_kernels.py), the
    # context-parallel exchange ops in a process group (tests/test_context_parallel.py).
    kernel_backward = {n for n in registered if n.endswith("_bwd") and "_reference" not in n}
    exchange = {n for n in registered if n.startswith("kdn::context_")}
    assert registered - kernel_backward - exchange <= checked, (
        registered - kernel_backward - exchange - checked)


def test_no_written_argument_has_a_default():
    # torch 2.11's dispatcher drops trailing arguments equal to their defaults before the
    # in-place bookkeeping of a mutable op indexes them (IndexError while compiling there)
    ops_ = [getattr(ops, n) for n in dir(ops)
            if isinstance(getattr(ops, n), torch._ops.OpOverloadPacket)]
    written = [(op._schema.name, a.name) for op in (p.default for p in ops_)
               for a in op._schema.arguments
               if a.alias_info is not None and a.alias_info.is_write]
    assert ("kdn::diag_kdn_decode", "intermediate_memory") in written
    defaults = [(name, arg) for name, arg in written
                if next(a for a in getattr(ops, name[5:]).default._schema.arguments
                        if a.name == arg).has_default_value()]
    assert not defaults, defaults


# -- public functions == references -------------------------------------------------------


def _public_vs_reference(public, reference, inputs, **kw):
    a = {n: t.detach().clone().requires_grad_() for n, t in inputs.items()}
    b = {n: t.detach().clone().requires_grad_() for n, t in inputs.items()}
    out_a, out_b = public(**a, **kw), reference(**b, **kw)
    grads = _grads_like(out_b)
    torch.autograd.backward(out_a, grads)
    torch.autograd.backward(out_b, grads)
    for oa, ob in zip(out_a, out_b):
        assert oa.dtype == ob.dtype
        assert_close(oa, ob, 1e-12, "value")
    for n in inputs:
        assert_close(a[n].grad, b[n].grad, 1e-10, f"grad {n}")


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_public_functions_match_references(backend):
    with kdn_compile.use_backend(backend):
        _public_vs_reference(kdn_compile.chunk_gdn, ref.chunk_gdn_reference, delta_inputs(T=21),
                             chunk_size=8, state_qdq=True, state_qdq_block_v=4)
        _public_vs_reference(kdn_compile.chunk_kda, ref.chunk_kda_reference,
                             delta_inputs(T=21, per_key=True), chunk_size=8)
        _public_vs_reference(kdn_compile.recurrent_delta_rule, ref.recurrent_delta_rule_reference,
                             delta_inputs(T=9, state_v_first=True), state_v_first=True)
        _public_vs_reference(kdn_compile.diag_kdn, ref.diag_kdn_chunked, kdn_inputs(T=21),
                             scale=0.5, info_scale=0.8, chunk_size=8)
        _public_vs_reference(lambda state: (kdn_compile.state_fp8_qdq(state, 4),),
                             lambda state: (ref.state_fp8_qdq_reference(state, 4),),
                             {"state": torch.randn(2, 4, 10, dtype=torch.float64)})


def test_w_quantizer_path_matches_reference():
    x = delta_inputs(T=30)
    quantizer = lambda w: kdn_compile.state_fp8_qdq(w.transpose(-1, -2), 4).transpose(-1, -2)  # noqa
    ref_quantizer = lambda w: ref.state_fp8_qdq_reference(w.transpose(-1, -2), 4).transpose(-1, -2)  # noqa
    _public_vs_reference(
        lambda **a: kdn_compile.chunk_gdn(**a, chunk_size=8, w_quantizer=quantizer),
        lambda **a: ref.chunk_gdn_reference(**a, chunk_size=8, w_quantizer=ref_quantizer), x,
    )


def test_output_dtypes_follow_inputs():
    x = {n: t.float() for n, t in delta_inputs(T=5).items()}
    x["q"], x["k"], x["v"] = (x[n].bfloat16() for n in ("q", "k", "v"))
    o, s = kdn_compile.chunk_gdn(**x)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    y = {n: t.float() for n, t in kdn_inputs(T=5).items()}
    o, m, p = kdn_compile.diag_kdn(**y, scale=1.0, info_scale=1.0)
    assert o.dtype == m.dtype == p.dtype == torch.float32


# -- capture -------------------------------------------------------------------------------


def _compile_over_lengths(fn, make_inputs, lengths=(17, 33, 50)):
    """Compile with fullgraph and dynamic shapes; compare values and grads to eager."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for T in lengths:
        inputs = make_inputs(T)
        eager_in = {n: t.detach().clone().requires_grad_(t.is_floating_point()) for n, t in inputs.items()}
        comp_in = {n: t.detach().clone().requires_grad_(t.is_floating_point()) for n, t in inputs.items()}
        out_e, out_c = fn(**eager_in), compiled(**comp_in)
        grads = _grads_like(out_e)
        torch.autograd.backward(out_e, grads)
        torch.autograd.backward(out_c, grads)
        for a, b in zip(out_c, out_e):
            assert_close(a, b, 1e-12, f"compiled value T={T}")
        for n, t in eager_in.items():
            if t.requires_grad:
                assert_close(comp_in[n].grad, t.grad, 1e-10, f"compiled grad {n} T={T}")
    assert counters["stats"]["unique_graphs"] <= 2, counters["stats"]
    assert counters["recompiles"] == {} or sum(counters["recompiles"].values()) <= 1
    assert not counters["graph_break"], counters["graph_break"]


def test_compile_chunk_gdn_fullgraph_dynamic():
    _compile_over_lengths(
        lambda **x: kdn_compile.chunk_gdn(**x, chunk_size=16),
        lambda T: delta_inputs(T=T, K=4, V=4, seed=T),
    )


def test_compile_chunk_gdn_w_quantizer_and_varlen():
    def make(T):
        x = delta_inputs(B=1, T=T, K=4, V=4, seed=T, N=3)
        x["cu_seqlens"] = torch.tensor([0, 5, T // 2, T])
        return x

    _compile_over_lengths(
        lambda **x: kdn_compile.chunk_gdn(**x, chunk_size=16, state_qdq=True,
                                          w_quantizer=lambda w: w.clamp(-0.5, 0.5)),
        make,
    )


def test_compile_chunk_kda_recurrent_diag_kdn():
    def fn(**x):
        d = {n: x[n] for n in ("q", "k", "v", "g", "beta", "initial_state")}
        o1, s1 = kdn_compile.chunk_kda(**d, chunk_size=16)
        o2, s2 = kdn_compile.recurrent_delta_rule(**d)
        kd = {n: x["kdn_" + n] for n in ("q", "k", "v", "log_alpha", "omega", "r", "memory", "precision")}
        o3, m3, p3 = kdn_compile.diag_kdn(**kd, scale=0.5, info_scale=0.9, chunk_size=16)
        return o1, s1, o2, s2, o3, m3, p3

    def make(T):
        x = delta_inputs(T=T, K=4, V=4, per_key=True, seed=T)
        x.update({"kdn_" + n: t for n, t in kdn_inputs(T=T, K=4, V=4, seed=T).items()})
        return x

    _compile_over_lengths(fn, make)


def test_compile_chunk_kda_kernel_op_fullgraph_dynamic():
    """``kdn::chunk_kda`` itself (backend "triton"), whose outputs end with the kernels'
    saved tensors: eager and traced alike take its reference branch on the CPU here
    (float64; tracing), with placeholders for the saved tensors."""
    with kdn_compile.use_backend("triton"):
        _compile_over_lengths(
            lambda **x: kdn_compile.chunk_kda(**x, chunk_size=16),
            lambda T: delta_inputs(T=T, K=4, V=4, per_key=True, seed=T),
        )


def test_backend_switch_guards_and_validates():
    from torch._dynamo.utils import counters

    x = delta_inputs(T=9, K=4, V=4)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda **a: kdn_compile.chunk_gdn(**a), fullgraph=True)
    seen = []
    with kdn_compile.use_backend("auto"):
        seen.append(compiled(**x)[0])
    with kdn_compile.use_backend("reference"):
        seen.append(compiled(**x)[0])
    assert counters["stats"]["unique_graphs"] == 2  # the switch is guarded on
    assert_close(seen[0], seen[1], 1e-12, "backends agree on CPU")
    assert kdn_compile.get_backend() == "auto"
    with pytest.raises(ValueError, match="backend must be one of"):
        kdn_compile.set_backend("cuda")


def test_compile_with_permuted_inputs_matches_eager():
    """Fakes promise contiguous outputs whatever the input strides (a transposed v)."""
    def fn(q, k, vt, g, beta):
        v = vt.transpose(1, 2)  # [B, H, T, V] -> [B, T, H, V], not contiguous
        o1, _ = kdn_compile.chunk_gdn(q, k, v, g, beta, chunk_size=8)
        o2, _ = kdn_compile.recurrent_delta_rule(q, k, v, g, beta)
        return o1 + 1.0, o2 * 2.0

    x = delta_inputs(T=13, Hk=2, Hv=2, K=4, V=4, with_state=False)
    vt = x["v"].transpose(1, 2).contiguous()
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for a, b in zip(compiled(x["q"], x["k"], vt, x["g"], x["beta"]),
                    fn(x["q"], x["k"], vt, x["g"], x["beta"])):
        assert_close(a, b, 1e-12, "permuted v")


@pytest.mark.parametrize("name", ["chunk_kda", "diag_kdn"])
def test_autocast_leaves_the_ops_alone(name):
    """Under autocast the ops compute as outside it: same values and gradients (nothing
    inside them autocasts to bfloat16, whose CPU triangular solve does not exist)."""
    if name == "chunk_kda":
        x = delta_inputs(B=1, T=10, Hk=1, Hv=1, K=4, V=3, per_key=True, dtype=torch.float32,
                         requires_grad=True)
        run = lambda: kdn_compile.chunk_kda(**x, chunk_size=4)  # noqa: E731
    else:
        x = kdn_inputs(B=1, T=10, H=1, K=4, V=3, dtype=torch.float32, requires_grad=True)
        run = lambda: kdn_compile.diag_kdn(**x, scale=0.5, info_scale=0.8, chunk_size=4)  # noqa: E731
    expected = run()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run()
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and torch.equal(a, b)
    leaves = list(x.values())
    grads = torch.autograd.grad(sum(o.sum() for o in got), leaves)
    for a, b in zip(grads, torch.autograd.grad(sum(o.sum() for o in expected), leaves)):
        assert torch.equal(a, b)
