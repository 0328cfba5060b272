"""Launch grids stay inside CUDA's limits for many short sequences and many heads.

CUDA allows 2**31 - 1 programs on a grid's first axis but only 65535 on the second
and third. The launchers' host code runs here on CPU tensors with ``wrap_triton``
replaced by a recorder (no kernel runs), for 2100 packed sequences x 32 value heads
(67200 sequence-head pairs), forward and backward of every op with kernels.
"""

from __future__ import annotations

import pytest
import torch

import kdn_compile
from _helpers import interpreting, launch_recorder, launcher_modules
from _inputs import delta_inputs

pytestmark = pytest.mark.skipif(not interpreting(),
                                reason="the kernel path on CPU needs TRITON_INTERPRET=1")

N, HV, K = 2100, 32, 16
LIMITS = (2**31 - 1, 65535, 65535)


@pytest.fixture
def grids(monkeypatch):
    launches = []
    record = launch_recorder(launches)
    for module in launcher_modules():
        monkeypatch.setattr(module, "wrap_triton", record)
        if hasattr(module, "_launch"):  # its eager launches, direct, recorded too
            monkeypatch.setattr(module, "_launch", lambda kernel, grid, like: record(kernel)[grid])
    return launches


def _delta_inputs(per_key):
    """``q, k, v, g, beta`` of N packed one-token sequences over HV value heads."""
    return delta_inputs(1, N, 2, HV, K, K, per_key=per_key, dtype=torch.float32,
                        requires_grad=True, with_state=False).values()


def _check(grids, families):
    names = {kernel.fn.__name__ for kernel, *_ in grids}
    for family in families:
        assert any(family in name for name in names), f"no {family} kernel launched: {names}"
    for kernel, grid, *_ in grids:
        name = kernel.fn.__name__
        for axis, (size, limit) in enumerate(zip(grid, LIMITS)):
            assert 0 < size <= limit, f"{name}: grid axis {axis} = {size} > {limit}"


@pytest.mark.parametrize("fn", [kdn_compile.chunk_gdn, kdn_compile.chunk_kda], ids=["gdn", "kda"])
def test_many_short_sequences_many_heads(fn, grids):
    q, k, v, g, beta = _delta_inputs(per_key=fn is kdn_compile.chunk_kda)
    cu_seqlens = torch.arange(N + 1)
    with kdn_compile.use_backend("triton"):
        o, s = fn(q, k, v, g, beta, cu_seqlens=cu_seqlens)
        torch.autograd.grad(o.sum() + s.sum(), [q, k, v, g, beta])
    _check(grids, ["fwd", "bwd"])


def test_quantization_aware_paths_many_short_sequences(grids):
    """FP8 state QDQ with a w_quantizer (the WY kernels), and the standalone QDQ kernel."""
    q, k, v, g, beta = _delta_inputs(per_key=False)
    with kdn_compile.use_backend("triton"):
        o, s = kdn_compile.chunk_gdn(q, k, v, g, beta, cu_seqlens=torch.arange(N + 1),
                                     state_qdq=True, w_quantizer=lambda w: 0.5 * w)
        torch.autograd.grad(o.sum() + s.sum(), [q, k, v, g, beta])
        kdn_compile.state_fp8_qdq(torch.zeros(N, HV, K, K))
    _check(grids, ["wy_fwd", "wy_bwd", "wy_grad", "fp8_qdq"])


def test_diag_kdn_many_short_sequences(grids):
    gen = torch.Generator().manual_seed(1)
    x = {n: torch.randn(1, N, HV, K, generator=gen).requires_grad_()
         for n in ("q", "k", "v", "log_alpha", "omega")}
    with torch.no_grad():
        x["log_alpha"].copy_(-x["log_alpha"].abs())
    r = torch.rand(1, N, HV, generator=gen).requires_grad_()
    memory, precision = torch.zeros(N, HV, K, K), torch.ones(N, HV, K)
    with kdn_compile.use_backend("triton"):
        out = kdn_compile.diag_kdn(x["q"], x["k"], x["v"], x["log_alpha"], x["omega"], r, memory,
                                   precision, scale=0.25, info_scale=1.0,
                                   cu_seqlens=torch.arange(N + 1))
        torch.autograd.grad(out[0].sum(), [x["q"], x["k"], x["v"]])
    _check(grids, ["kalman_gain", "two_key"])


def test_launchers_refuse_uncovered_head_sizes():
    """The launchers themselves refuse what the supports checks refuse (GDN: K = 24;
    two-key: fp16 K=32, V=16, not checked on the H200): a direct call raises a named
    ValueError, no kernel starts."""
    from kdn_compile.lowering.chunk_gdn_bwd import chunk_gdn_bwd
    from kdn_compile.lowering.chunk_gdn_fwd import chunk_gdn_fwd
    from kdn_compile.lowering.two_key_bwd import two_key_bwd
    from kdn_compile.lowering.two_key_fwd import two_key_fwd

    h = torch.float16
    q, k = torch.zeros(1, 8, 1, 32, dtype=h), torch.zeros(1, 8, 1, 32, dtype=h)
    v, g, beta = torch.zeros(1, 8, 1, 16, dtype=h), torch.zeros(1, 8, 1), torch.zeros(1, 8, 1)
    kw = dict(chunk_size=64, scale=1.0, state_v_first=False)
    q24 = torch.zeros(1, 8, 1, 24, dtype=h)  # GDN: powers of two from 16 to 256
    with pytest.raises(ValueError, match=r"GDN kernels do not cover .*K=24, V=16"):
        chunk_gdn_fwd(q24, q24, v, g, beta, None, None, **kw)
    with pytest.raises(ValueError, match=r"GDN kernels do not cover .*K=24, V=16"):
        chunk_gdn_bwd(q24, q24, v, g, beta, None, None, v, None, **kw)
    gk = torch.zeros(1, 8, 1, 32)
    with pytest.raises(ValueError, match=r"two-key Triton kernels do not cover .*K=32, V=16"):
        two_key_fwd(q, k, k, v, gk, None, None, **kw)
    with pytest.raises(ValueError, match=r"two-key Triton kernels do not cover .*K=32, V=16"):
        two_key_bwd(q, k, k, v, gk, None, None, *([None] * 10), v, None, **kw)


def test_chunk_spans_skip_empty_sequences_and_end_surplus_chunks():
    from kdn_compile.lowering._launch import chunk_offsets, chunk_spans, num_chunks_bound

    cu = torch.tensor([0, 0, 70, 70, 71, 200])  # empty, 2 chunks, empty, 1, 3 chunks
    offsets = chunk_offsets(cu, 64)
    bound = num_chunks_bound(1, 200, 5, 64, True)
    spans = chunk_spans(cu, offsets, bound, 64).tolist()
    # first token, sequence end, sequence
    real = [[0, 70, 1], [64, 70, 1], [70, 71, 3], [71, 200, 4], [135, 200, 4], [199, 200, 4]]
    assert spans[:6] == real
    assert bound > 6 and all(t0 >= end for t0, end, _ in spans[6:]), spans
