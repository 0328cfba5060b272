"""The ops on the two-key kernels, eager on their kernel path (the interpreter on the CPU)
against the float64 references: ``kdn::chunk_kda`` (gradients, saved outputs, opcheck,
gates beyond the kernels' bound, a NaN gate) and ``kdn::diag_kdn`` with its memory on
these kernels; and each op's kernel branch traced on the CPU as on the GPU. The kernels
themselves: ``test_two_key_kernels.py``.
"""

from __future__ import annotations

import pytest
import torch

from _helpers import assert_close, count_calls, kernels, trace_kernel_paths
from _inputs import delta_inputs, kdn_inputs
from kdn_compile.lowering.two_key_common import LOG_DECAY_BOUND
from test_two_key_kernels import FP32_TOL, HALF_GATE_GRAD_TOL, HALF_TOL


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
    assert saved[-2].dtype == saved[-1].dtype == torch.int32  # spans, offsets
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
@pytest.mark.parametrize("reset", [False, True], ids=["deep", "minus_inf"])
def test_chunk_kda_op_floors_gates_below_the_kernel_bound(reset):
    """Gates far below ``LOG_DECAY_BOUND`` (e.g. -60, a KDA layer at the top of its
    init range), or ``-inf`` (a hard reset of some channels at some tokens), give finite
    results equal to the reference's, with zero ``dg`` there."""
    import kdn_compile
    from kdn_compile.reference import chunk_kda_reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    B, T, H, K = 1, 40, 1, 16
    x = delta_inputs(B, T, H, H, K, K, per_key=True, seed=5, gate_scale=1.0 if reset else 60.0,
                     with_state=False)
    if reset:
        x["g"][:, 10:13, :, :5] = -torch.inf
        x["g"][:, 30, :, 8:] = -torch.inf
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


@pytest.fixture(scope="module")
def kernel_path_traces():
    return trace_kernel_paths("gdn", "kda", "kdn", "export")


@pytest.mark.parametrize("which,expected", [("gdn", "counts [2, 3]"), ("kda", "counts [4, 4]"),
                                            ("kdn", "counts [7, 7]"),
                                            ("export", "exported kdn ['kdn.diag_kdn.default']")])
def test_kernel_path_traces_as_on_the_gpu(kernel_path_traces, which, expected):
    """The kernel branch traced on the CPU (tests/_trace_kernel_path.py, the four modes in
    one child process): the ops with their saved outputs through AOTAutograd's min-cut
    partitioner (a backward kernel that writes a saved chunk index fails there: "Node ...
    was invalid, but is output"), and the layers through torch.export with a dynamic length
    (a saved or scratch tensor with a dimension of one chunk makes it guard on the
    length)."""
    passed, output = kernel_path_traces[which]
    assert passed and expected in output, output
    if which == "export":
        assert "exported kda ['kdn.chunk_kda.default']" in output, output
        assert "exported gdn ['kdn.chunk_gdn.default']" in output, output
