"""Quantization-aware training on the kernels: the FP8 state QDQ kernel and the w_quantizer path.

CPU: the kernels run under ``TRITON_INTERPRET=1`` (conftest.py) at tiny sizes. The QDQ
kernel equals the reference bit for bit (values, scales, fake-quantized state); the
public functions take the kernel ops (backend ``"triton"``) and match the references,
gradients included. The GPU runs of the same checks: ``tests/test_qat_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

import kdn_compile
from _helpers import kernels, needs_kernels, trace_kernel_paths
from kdn_compile.quantization import fp8_row_qdq
from kdn_compile.reference.fp8 import e4m3_scale, quantize_state_fp8, state_fp8_qdq_reference



def fp8_states(shape, block_v, dtype, device="cpu", seed=0) -> torch.Tensor:
    """Random states whose columns span 15 decades, with an all-zero first tile in the first
    matrix (scale 1), a last tile of float32 subnormals in the last matrix (scale 1 too:
    zeros in float16), a ``-0.0`` and values that round to zero in E4M3."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * torch.logspace(-12, 3, shape[-1])
    x = x.reshape(-1, *shape[-2:])
    x[0, :, :block_v] = 0.0
    last = (shape[-1] - 1) // block_v * block_v
    x[-1, :, last:] = (x[-1, :, last:].double() * 1e-46).float()
    x[-1, 0, -1] = -0.0
    return x.reshape(shape).to(device=device, dtype=dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (``-0.0 != +0.0``), dtypes included."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))


QDQ_SHAPES = [
    # shape [..., K, V], block_v
    pytest.param((3, 2, 16, 40), 16, id="partial-last-tile"),
    pytest.param((2, 5, 7), 3, id="odd-sizes"),
    pytest.param((2, 200, 130), 64, id="tile-larger-than-registers"),
    pytest.param((9, 12), 64, id="one-tile-wider-than-V"),
]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape,block_v", QDQ_SHAPES)
def test_qdq_kernel_is_the_reference_bit_for_bit(shape, block_v, dtype):
    """Values and scales of quantize_state_fp8 and the QDQ of state_fp8_qdq_reference.
    (bfloat16: on the GPU, the interpreter truncates float32 to bfloat16.)"""
    from kdn_compile.lowering.fp8 import state_fp8_qdq_fwd

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = fp8_states(shape, block_v, dtype, device)
    values, scales = state_fp8_qdq_fwd(x, block_v, split=True)
    expected_values, expected_scales = quantize_state_fp8(x, block_v)
    assert same_bits(values, expected_values)
    assert same_bits(scales, expected_scales)
    assert scales.reshape(-1)[0] == 1.0, "all-zero tile"
    assert same_bits(state_fp8_qdq_fwd(x, block_v), state_fp8_qdq_reference(x, block_v))


def test_reference_tile_wider_than_v_is_one_tile_without_padding():
    """A ``block_v`` at or above V is one scale tile of the whole state, as the kernels take
    it: the same bits as ``block_v = V``, and no padding allocated (2^40 columns would not
    fit in memory)."""
    x = torch.randn(2, 16, 12, generator=torch.Generator().manual_seed(5))
    expected = state_fp8_qdq_reference(x, 12)
    for block_v in (13, 64, 2 ** 40):
        assert same_bits(state_fp8_qdq_reference(x, block_v), expected), block_v
    values, scales = quantize_state_fp8(x, 2 ** 40)
    assert scales.shape == (2, 1) and same_bits(values, quantize_state_fp8(x, 12)[0])


# -- the scale rule: amax * (1 / 448), or 1 below 2^-126 (the tile then stores zeros) ------------

# Tile amaxes from 0 through float32 subnormals and the threshold (448 * 2^-126 ~ 5.27e-36
# lies between 5e-36 and 6e-36) to the top of float32.
AMAXES = [0.0, 1e-45, 1e-43, 6e-43, 1e-40, 2.0 ** -126, 1e-37, 5e-36, 6e-36, 1e-30, 1.0, 1e30,
          3.4e38]


def below_threshold(amax: torch.Tensor) -> torch.Tensor:
    """Which tile (or row) amaxes take scale 1: ``amax * (1 / 448)`` below ``2^-126`` in
    float32 (``amax`` below ~5.27e-36), the rule itself rather than a rounded threshold (a
    row drawn from the 6e-36 tile can have its amax just above 5.27e-36)."""
    return amax.float() * (1.0 / 448.0) < 2.0 ** -126


def tiles_with_amax(amaxes, dtype=torch.float32, seed=0, k=4, v=8) -> torch.Tensor:
    """``[len(amaxes), k, v]``: one random tile per amax, uniform in ``[-amax, amax]`` with one
    element of magnitude ``amax`` (amaxes ``dtype`` cannot hold are the caller's concern)."""
    gen = torch.Generator().manual_seed(seed)
    amax = torch.tensor(amaxes, dtype=torch.float64)[:, None, None]
    x = (2 * torch.rand(len(amaxes), k, v, generator=gen, dtype=torch.float64) - 1) * amax
    x[:, 0, 0] = amax[:, 0, 0] * torch.where(torch.rand(len(amaxes), generator=gen) < 0.5, -1, 1)
    return x.to(dtype)


def e4m3_error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest ``|QDQ(x) - x|`` (float64) for values ``x`` of a tile of scale ``scale``: half
    an E4M3 step, ``2^-4 |x|`` in the normal range, ``2^-10 scale`` in the subnormal one, and
    the float32 rounding of the quotient and the product (one smallest subnormal)."""
    return (2.0 ** -4 * (1 + 2.0 ** -20)) * x.abs().double() + 2.0 ** -10 * scale.double() \
        + 2.0 ** -149


def test_scales_never_underflow_and_tiny_tiles_store_zeros(seed):
    """At every amax the scale is finite and positive and the QDQ finite: within half an E4M3
    step where the scale is ``amax * (1 / 448)``; scale 1 and zeros (off by at most the amax)
    for a tile below ``448 * 2^-126``."""
    x = tiles_with_amax(AMAXES, seed=seed)
    amax = x.abs().amax((-2, -1))
    assert torch.equal(amax, torch.tensor(AMAXES, dtype=torch.float32))
    scales = e4m3_scale(amax)
    assert torch.isfinite(scales).all() and (scales > 0).all(), scales
    values, tile_scales = quantize_state_fp8(x, 8)
    assert same_bits(tile_scales[:, 0], scales)
    y = state_fp8_qdq_reference(x, 8)
    assert torch.isfinite(y).all()
    tiny = below_threshold(amax)
    assert torch.equal(scales[tiny], torch.ones(int(tiny.sum())))
    assert torch.equal(y[tiny], torch.zeros_like(y[tiny]))
    assert ((y - x).abs()[tiny] <= amax[tiny, None, None]).all()
    normal = ~tiny
    assert torch.equal(scales[normal], amax[normal] * (1.0 / 448.0))
    assert (scales[normal] >= 2.0 ** -126).all()
    err = (y - x).abs().double()[normal]
    assert (err <= e4m3_error_bound(x[normal], scales[normal, None, None])).all()


@kernels
def test_qdq_kernel_is_the_reference_at_every_amax(seed):
    """The QDQ kernel == the reference bit for bit at every amax of :data:`AMAXES`: values,
    scales (1 below the threshold) and the QDQ, alone and through ``kdn_compile.state_fp8_qdq``."""
    from kdn_compile.lowering.fp8 import state_fp8_qdq_fwd

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = tiles_with_amax(AMAXES, seed=seed).to(device)
    values, scales = state_fp8_qdq_fwd(x, 8, split=True)
    expected_values, expected_scales = quantize_state_fp8(x, 8)
    assert same_bits(values, expected_values)
    assert same_bits(scales, expected_scales)
    assert torch.isfinite(scales).all() and (scales > 0).all()
    expected = state_fp8_qdq_reference(x, 8)
    assert torch.isfinite(expected).all()
    assert same_bits(state_fp8_qdq_fwd(x, 8), expected)
    with kdn_compile.use_backend("triton"):
        assert same_bits(kdn_compile.state_fp8_qdq(x, 8), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
def test_fp8_row_qdq_scales_in_float32_and_tiny_rows_give_zeros(dtype, seed):
    """``fp8_row_qdq`` on rows of every amax its dtype holds (float16 ones below 448 * 2^-14
    included, whose scales a float16 quotient would round or flush to 0): finite, zeros for
    a row below the threshold, within half an E4M3 step (and ``w``'s own rounding) of ``w``
    otherwise, and equal to the float32 computation rounded to ``dtype``."""
    info = torch.finfo(dtype)
    amaxes = [a for a in AMAXES + [6e-8, 1e-5, 1e-3, 6e4]
              if a == 0 or 0 < float(torch.tensor(a).to(dtype)) < float("inf")]
    w = tiles_with_amax(amaxes, dtype, seed=seed, k=3, v=16)
    y = fp8_row_qdq(w)
    assert y.dtype == dtype and torch.isfinite(y).all()
    amax = w.float().abs().amax(-1, keepdim=True).expand_as(w)
    tiny = below_threshold(amax)
    assert torch.equal(y[tiny], torch.zeros_like(y[tiny]))
    bound = (e4m3_error_bound(w, amax / 448) + info.eps * w.abs().double()
             + info.smallest_normal * info.eps)
    assert ((y - w).abs().double()[~tiny] <= bound[~tiny]).all()
    if dtype != torch.float32:
        assert same_bits(y, fp8_row_qdq(w.float()).to(dtype))


@pytest.mark.parametrize("backend", [
    "reference", pytest.param("triton", marks=(pytest.mark.interpreter, pytest.mark.gpu))])
def test_state_qdq_through_a_state_decayed_below_every_scale(backend, monkeypatch, seed):
    """``chunk_gdn(state_qdq=True)`` over three chunks, the middle one with ``beta = 0`` and
    gates summing to -100: the chunk state at its end is ``e^-100`` of the one before
    (float32 subnormals), which quantizes to zeros. Outputs, final state and gradients are
    finite and within half an E4M3 step (``2^-4``, relative) of the run without QDQ."""
    from _helpers import assert_close, count_calls
    from _inputs import delta_inputs
    from kdn_compile.ops import gdn

    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    x = delta_inputs(B=1, T=192, Hk=1, Hv=2, K=16, V=16, dtype=torch.float32, seed=seed)
    x["g"][:, 64:128] = -100 / 64
    x["beta"][:, 64:128] = 0.0
    calls = count_calls(monkeypatch, gdn, ("chunk_gdn_fwd",)) if backend == "triton" else []
    gen = torch.Generator().manual_seed(seed + 1)
    runs = []
    for qdq in (True, False):
        leaves = {n: t.to(device).requires_grad_() for n, t in x.items()}
        with kdn_compile.use_backend(backend):
            o, ht = kdn_compile.chunk_gdn(**leaves, state_qdq=qdq, state_qdq_block_v=16)
        if not runs:
            do = torch.randn(o.shape, generator=gen).to(device)
            dht = torch.randn(ht.shape, generator=gen).to(device)
        grads = torch.autograd.grad((o, ht), list(leaves.values()), (do, dht))
        runs.append((o, ht, grads))
    assert len(calls) == (2 if backend == "triton" else 0), "the kernels ran"
    (o, ht, grads), (plain_o, plain_ht, plain_grads) = runs
    for name, got, plain in [("o", o, plain_o), ("final state", ht, plain_ht),
                             *((f"d{n}", a, b) for n, a, b in zip(x, grads, plain_grads))]:
        assert torch.isfinite(got).all(), name
        assert_close(got, plain, 2.0 ** -4, name)


@needs_kernels
def test_state_fp8_qdq_takes_the_kernel_and_passes_gradients_through(monkeypatch):
    from kdn_compile.ops import fp8 as fp8_ops

    calls = []
    real = fp8_ops.state_fp8_qdq_fwd
    monkeypatch.setattr(fp8_ops, "state_fp8_qdq_fwd", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = fp8_states((2, 3, 8, 20), 8, torch.float32).requires_grad_()
    with kdn_compile.use_backend("triton"):
        y = kdn_compile.state_fp8_qdq(x, 8)
    assert calls == [1]
    assert same_bits(y.detach(), state_fp8_qdq_reference(x.detach(), 8))
    grad = torch.randn_like(x)
    y.backward(grad)
    assert torch.equal(x.grad, grad), "straight-through"


@pytest.fixture(scope="module")
def qat_kernel_path_traces():
    return trace_kernel_paths("gdn-qdq", "wy")


@pytest.mark.parametrize("which,expected", [("gdn-qdq", "counts [2, 3]"),
                                            ("wy", "counts [4, 4]")])
def test_qat_kernel_paths_trace_as_on_the_gpu(qat_kernel_path_traces, which, expected):
    """The kernel branches traced on the CPU (tests/_trace_kernel_path.py, both modes in one
    child process) with ``fullgraph=True`` through AOTAutograd's min-cut partitioner, as on
    the H200. ``gdn-qdq``: ``kdn::chunk_gdn`` with FP8 state QDQ: two forward launches
    (prepare, recurrence), three backward (the chunk states, float8 bit for bit, with
    ``delta``; state pass; gradients). ``wy``: ``chunk_gdn`` with a ``w_quantizer`` in the
    graph between the operands (prepare, W and U) and the recurrence (prepare, recurrence);
    backward: recomputed states, state pass, gradients, then the operands' gradients."""
    passed, output = qat_kernel_path_traces[which]
    assert passed and expected in output, output


# -- w_quantizer: the WY operands and the recurrence from them on their kernels ------------------


WY_CASES = [
    # id, B, T, Hk, Hv, K, V, cu_seqlens, state_v_first, state_qdq_block_v
    pytest.param(1, 70, 1, 2, 16, 32, None, False, None, id="T70-grouped"),
    pytest.param(2, 65, 1, 2, 32, 16, None, True, 16, id="T65-vfirst-qdq"),
    pytest.param(1, 100, 1, 2, 16, 16, [0, 0, 64, 100], False, 16, id="varlen-empty-qdq"),
]


def _grads(outputs, leaves, cotangents):
    names = [n for n, t in leaves.items() if t is not None]
    found = torch.autograd.grad(outputs, [leaves[n] for n in names], cotangents)
    return dict(zip(names, found))


@needs_kernels
@pytest.mark.parametrize("B,T,Hk,Hv,K,V,cu,state_v_first,block_v", WY_CASES)
def test_wy_kernels_match_reference(B, T, Hk, Hv, K, V, cu, state_v_first, block_v):
    """Both halves against their float64 references, values and every gradient: the
    operands ``W``, ``U``, and the recurrence from random ``W``, ``U`` (FP8 state QDQ too)."""
    from _helpers import assert_close, poisoned
    from _inputs import delta_inputs
    from kdn_compile.lowering import chunk_gdn_wy as wy
    from kdn_compile.reference import gdn_wy_operands_reference, gdn_wy_recurrence_reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
    x = delta_inputs(B=B, T=T, Hk=Hk, Hv=Hv, K=K, V=V, dtype=torch.float32, seed=T,
                     state_v_first=state_v_first, N=B if cu is None else len(cu) - 1)
    x = {n: t.to(device) for n, t in x.items()}
    gen = torch.Generator().manual_seed(1)
    rand = lambda *s: torch.randn(*s, generator=gen).to(device)  # noqa: E731
    exact = {n: t.double().requires_grad_() for n, t in x.items()}

    with poisoned():
        w, u, *prepared = wy.gdn_wy_operands_fwd(x["k"], x["v"], x["g"], x["beta"], cu_seqlens,
                                                 chunk_size=64)
    dw, du = rand(*w.shape), rand(*u.shape)
    with poisoned():
        grads = wy.gdn_wy_operands_bwd(x["k"], x["v"], x["g"], x["beta"], cu_seqlens, dw, du,
                                       chunk_size=64, prepared=prepared)
    rw, ru = gdn_wy_operands_reference(exact["k"], exact["v"], exact["g"], exact["beta"],
                                       chunk_size=64, cu_seqlens=cu_seqlens)
    assert w.dtype == u.dtype == torch.float32
    assert_close(w, rw, 1e-5, "W")
    assert_close(u, ru, 1e-5, "U")
    operands = {n: exact[n] for n in ("k", "v", "g", "beta")}
    expected = _grads((rw, ru), operands, (dw.double(), du.double()))
    for name, grad in zip(operands, grads):
        assert_close(grad, expected[name], 1e-5, f"operands d{name}")

    w, u = 0.3 * rand(*w.shape), rand(*u.shape)
    options = dict(chunk_size=64, scale=K ** -0.5, state_v_first=state_v_first,
                   state_qdq=block_v is not None, state_qdq_block_v=block_v or 64)
    args = (x["q"], x["k"], w, u, x["g"], x["initial_state"], cu_seqlens)
    with poisoned():
        o, ht, *prepared = wy.gdn_wy_recurrence_fwd(*args, **options)
    do, dht = rand(*o.shape), rand(*ht.shape)
    with poisoned():
        grads = wy.gdn_wy_recurrence_bwd(*args, do, dht, prepared=prepared, **options)
    inputs = {"q": exact["q"], "k": exact["k"], "w": w.double().requires_grad_(),
              "u": u.double().requires_grad_(), "g": exact["g"],
              "initial_state": exact["initial_state"]}
    ro, rh = gdn_wy_recurrence_reference(*list(inputs.values())[:5], cu_seqlens=cu_seqlens,
                                         initial_state=inputs["initial_state"], **options)
    assert_close(o, ro, 1e-4, "o")
    assert_close(ht, rh, 1e-4, "final state")
    expected = _grads((ro, rh), inputs, (do.double(), dht.double()))
    for name, grad in zip(inputs, grads):
        assert grad.dtype == (x.get(name, w)).dtype, name
        assert_close(grad, expected[name], 1e-4, f"recurrence d{name}")


@needs_kernels
def test_w_quantizer_runs_on_the_kernels_and_matches_reference(monkeypatch):
    """``chunk_gdn(..., w_quantizer=fp8_row_qdq)`` with the kernel ops (backend "triton"):
    both halves launch their kernels forward and backward, and values and gradients match
    ``chunk_gdn_reference`` with the same callable (float64)."""
    from _helpers import assert_close, count_calls, rel_error
    from _inputs import delta_inputs
    from kdn_compile.ops import gdn_wy
    from kdn_compile.reference import chunk_gdn_reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = delta_inputs(B=1, T=70, Hk=1, Hv=2, K=16, V=16, dtype=torch.float32, seed=3)
    leaves = {n: t.to(device).requires_grad_() for n, t in x.items()}
    calls = count_calls(monkeypatch, gdn_wy, (
        "gdn_wy_operands_fwd", "gdn_wy_operands_bwd", "gdn_wy_recurrence_fwd",
        "gdn_wy_recurrence_bwd"))
    with kdn_compile.use_backend("triton"):
        o, ht = kdn_compile.chunk_gdn(**leaves, w_quantizer=fp8_row_qdq, state_qdq=True,
                                      state_qdq_block_v=16)
    assert sorted(calls) == ["gdn_wy_operands_fwd", "gdn_wy_recurrence_fwd"]
    gen = torch.Generator().manual_seed(2)
    do = torch.randn(o.shape, generator=gen).to(device)
    dht = torch.randn(ht.shape, generator=gen).to(device)
    got = _grads((o, ht), leaves, (do, dht))
    assert sorted(calls) == sorted(["gdn_wy_operands_fwd", "gdn_wy_recurrence_fwd",
                                    "gdn_wy_operands_bwd", "gdn_wy_recurrence_bwd"])
    exact = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    ro, rh = chunk_gdn_reference(**exact, w_quantizer=fp8_row_qdq, state_qdq=True,
                                 state_qdq_block_v=16)
    assert_close(o, ro, 1e-4, "o")
    assert_close(ht, rh, 1e-4, "final state")
    plain = chunk_gdn_reference(**{n: t.detach() for n, t in exact.items()})[0]
    assert rel_error(ro, plain) > 1e-3, "the quantizer changes the output"
    expected = _grads((ro, rh), exact, (do.double(), dht.double()))
    for name, grad in got.items():
        assert_close(grad, expected[name], 1e-4, f"d{name}")
