"""Every documented argument error, eagerly and under ``torch.compile(fullgraph=True)``.

Each case names a public call, its bad argument, the exception type and a pattern with the
argument's name, the expected and the received value. Compiled, the same exception type and
message must come out of Dynamo, with static shapes and with ``dynamic=True`` (sizes
symbolic: the message still shows concrete ones). Compiling stops at the error, so each
compiled case costs only the trace up to it (``backend="eager"``: nothing reaches Inductor).
"""

from __future__ import annotations

import traceback

import numpy
import pytest
import torch

import kdn_compile
from _inputs import delta_inputs, kdn_inputs
from kdn_compile import chunk_gdn, chunk_kda, delta_rule_decode, diag_kdn, diag_kdn_decode, fla
from kdn_compile import recurrent_delta_rule, state_fp8_qdq
from kdn_compile.layers import DiagKDN, GatedDeltaNet, KimiDeltaAttention

FP8, HALF = torch.float8_e4m3fn, torch.float16
COMPILED = ("static", "dynamic")


def gdn():
    """Delta-rule arguments: B=2, T=8, Hk=2, Hv=4, K=4, V=3, float64, with a state."""
    return delta_inputs(B=2, T=8, Hk=2, Hv=4, K=4, V=3)


def packed():
    """One batch row of two packed sequences (for ``cu_seqlens``)."""
    return delta_inputs(B=1, T=8, Hk=2, Hv=4, K=4, V=3, N=2)


def kdn():
    return {**kdn_inputs(B=2, T=9, H=2, K=4, V=3), "scale": 1.0, "info_scale": 1.0}


def decode():
    x = delta_inputs(B=2, T=2, Hk=1, Hv=2, K=4, V=3, dtype=torch.float32, with_state=False)
    return {**x, "state_pool": torch.zeros(3, 2, 4, 3), "state_indices": torch.tensor([0, 1])}


def kdn_decode():
    x = kdn_inputs(B=2, T=1, H=2, K=4, V=3, dtype=torch.float32)
    del x["memory"], x["precision"]
    return {**x, "memory_pool": torch.zeros(3, 2, 4, 3), "precision_pool": torch.ones(3, 2, 4),
            "state_indices": torch.tensor([0, 1]), "scale": 0.5, "info_scale": 1.0}


def on(fn, inputs, **change):
    """A case's call: ``fn`` with the arguments ``inputs()``, ``change`` applied (built
    when the case runs)."""
    return lambda: (fn, {**inputs(), **change})


def zeros(*shape, dtype=torch.float64, **kw):
    return torch.zeros(shape, dtype=dtype, **kw)


class Layers:
    """Tiny layers (D = 16, float32), a state from an eager call of each and a serving
    cache of each: the GDN and KDA layers' states and caches have the same keys and
    shapes."""

    def __init__(self):
        torch.manual_seed(0)
        self.gdn, self.kda = GatedDeltaNet(16, 2, 4), KimiDeltaAttention(16, 2, 4)
        self.kdn = DiagKDN(16, 2, 4)
        self.x = torch.randn(2, 6, 16)
        names = ("gdn", "kda", "kdn")
        with torch.no_grad():
            self.state = {name: getattr(self, name)(self.x)[1] for name in names}
        self.cache = {name: getattr(self, name).allocate_cache(3) for name in names}


_LAYERS = []


def L() -> Layers:  # noqa: N802  (built on first use, shared by the cases)
    if not _LAYERS:
        _LAYERS.append(Layers())
    return _LAYERS[0]


def layer(name, method="forward", **change):
    """A call of one of the tiny layers (``step`` on that layer's cache); a ``change``
    given as a function is applied to :class:`Layers`."""

    def make():
        own = L()
        args = {"x": own.x}
        if method == "step":
            args.update(cache=own.cache[name], state_indices=torch.tensor([0, 1]))
        args.update({k: v(own) if callable(v) else v for k, v in change.items()})
        return getattr(getattr(own, name), method), args

    return make


def _w_wrong_shape(w):
    return w[:, :4]


VE, TE, RE = ValueError, TypeError, RuntimeError
CASES = [
    # -- chunk_gdn --------------------------------------------------------------------------
    ("gdn-k-shape", on(chunk_gdn, gdn, k=zeros(2, 8, 2, 5)), VE,
     r"k must have q's shape \(2, 8, 2, 4\) = \[B, T, Hk, K\], got \(2, 8, 2, 5\)"),
    ("gdn-v-length", on(chunk_gdn, gdn, v=zeros(2, 7, 4, 3)), VE,
     r"v must be \[B=2, T=8, Hv, V\], got \(2, 7, 4, 3\)"),
    ("gdn-heads", on(chunk_gdn, gdn, v=zeros(2, 8, 3, 3)), VE,
     r"value heads Hv = 3 \(v \(2, 8, 3, 3\)\) must be a multiple of the key heads Hk = 2"),
    ("gdn-g-per-key", on(chunk_gdn, gdn, g=zeros(2, 8, 4, 4)), VE,
     r"g must have shape \(2, 8, 4\), got \(2, 8, 4, 4\)"),
    ("gdn-beta", on(chunk_gdn, gdn, beta=zeros(2, 8, 2)), VE,
     r"beta must have shape \(2, 8, 4\) = \[B, T, Hv\], got \(2, 8, 2\)"),
    ("gdn-q-int", on(chunk_gdn, gdn, q=zeros(2, 8, 2, 4, dtype=torch.int64)), TE,
     r"q must be float16, bfloat16, float32 or float64, got torch.int64"),
    ("gdn-q-list", on(chunk_gdn, gdn, q=[[0.0]]), TE,
     r"q must be a torch.Tensor, got list"),
    ("gdn-mixed-dtypes", on(chunk_gdn, gdn, v=zeros(2, 8, 4, 3, dtype=torch.float32)),
     TE, r"q, k, v must share a dtype, got torch.float64, torch.float64, torch.float32"),
    ("gdn-q-rank", on(chunk_gdn, gdn, q=zeros(2, 8, 4)), VE,
     r"q must have 4 dims, \[B, T, H, K\], got shape \(2, 8, 4\)"),
    ("gdn-no-keys", on(chunk_gdn, gdn, q=zeros(2, 8, 2, 0), k=zeros(2, 8, 2, 0),
                       initial_state=None), VE,
     r"q must have at least one head and K >= 1, got shape \(2, 8, 2, 0\)"),
    ("gdn-state-shape", on(chunk_gdn, gdn, initial_state=zeros(3, 4, 4, 3)), VE,
     r"initial_state must have shape \(2, 4, 4, 3\), got \(3, 4, 4, 3\)"),
    ("gdn-state-rank", on(chunk_gdn, gdn, initial_state=zeros(4, 4, 3)), VE,
     r"initial_state must have shape \(2, 4, 4, 3\), got \(4, 4, 3\)"),
    ("gdn-state-list", on(chunk_gdn, gdn, initial_state=[[[[0.0]]]]), TE,
     r"initial_state must be a torch.Tensor, got list"),
    ("gdn-state-device", on(chunk_gdn, gdn, initial_state=zeros(2, 4, 4, 3, device="meta")),
     VE, r"initial_state is on meta but q is on cpu"),
    ("gdn-chunk-zero", on(chunk_gdn, gdn, chunk_size=0), VE,
     r"chunk_size must be a positive finite int, got 0"),
    ("gdn-chunk-fraction", on(chunk_gdn, gdn, chunk_size=2.5), VE,
     r"chunk_size must be a positive finite int, got 2.5"),
    ("gdn-chunk-inf", on(chunk_gdn, gdn, chunk_size=float("inf")), VE,
     r"chunk_size must be a positive finite int, got inf"),
    ("gdn-chunk-str", on(chunk_gdn, gdn, chunk_size="64"), TE,
     r"chunk_size must be a positive int, got str"),
    ("gdn-chunk-none", on(chunk_gdn, gdn, chunk_size=None), TE,
     r"chunk_size must be a positive int, got NoneType"),
    ("gdn-block-v", on(chunk_gdn, gdn, state_qdq_block_v=0), VE,
     r"state_qdq_block_v must be a positive int, got 0"),
    ("gdn-block-v-huge", on(chunk_gdn, gdn, state_qdq_block_v=10**30), VE,
     r"state_qdq_block_v must be below 2\*\*63, got 1000000000000000000000000000000"),
    ("gdn-block-v-float", on(chunk_gdn, gdn, state_qdq_block_v=64.0), TE,
     r"state_qdq_block_v must be a positive int, got float"),
    ("gdn-chunk-huge", on(chunk_gdn, gdn, chunk_size=10**30), VE,
     r"chunk_size must be below 2\*\*63, got 1000000000000000000000000000000"),
    ("gdn-scale-str", on(chunk_gdn, gdn, scale="1"), TE,
     r"scale must be a float or None, got str"),
    ("gdn-scale-nan", on(chunk_gdn, gdn, scale=float("nan")), VE,
     r"scale must be finite, got nan"),
    ("gdn-flag", on(chunk_gdn, gdn, state_qdq="yes"), TE,
     r"state_qdq must be a bool, got str"),
    ("gdn-cu-batch", on(chunk_gdn, gdn, cu_seqlens=torch.tensor([0, 8])), VE,
     r"with cu_seqlens the batch size must be 1, got B = 2"),
    ("gdn-cu-dtype", on(chunk_gdn, packed, cu_seqlens=torch.tensor([0.0, 3.0, 8.0])),
     TE, r"cu_seqlens must be int32 or int64, got torch.float32"),
    ("gdn-cu-shape", on(chunk_gdn, packed, cu_seqlens=torch.tensor([0])), VE,
     r"cu_seqlens must be \[N \+ 1\] with N >= 1, got shape \(1,\)"),
    ("gdn-cu-device", on(chunk_gdn, packed, cu_seqlens=torch.tensor([0, 3, 8], device="meta")),
     VE, r"cu_seqlens is on meta but q is on cpu"),
    ("gdn-cu-state", on(chunk_gdn, packed, cu_seqlens=torch.tensor([0, 2, 5, 8])), VE,
     r"initial_state must have shape \(3, 4, 4, 3\), got \(2, 4, 4, 3\)"),
    ("gdn-w-shape", on(chunk_gdn, gdn, w_quantizer=_w_wrong_shape), VE,
     r"w_quantizer must return W's shape \(2, 8, 4, 4\) = \[B, T, Hv, K\] on cpu, "
     r"got \(2, 4, 4, 4\)"),
    ("gdn-w-not-callable", on(chunk_gdn, gdn, w_quantizer=3), TE,
     r"w_quantizer must be None or callable, got int"),
    ("gdn-w-none", on(chunk_gdn, gdn, w_quantizer=lambda w: None), TE,
     r"w_quantizer must return a float tensor, got NoneType"),
    ("gdn-w-detached", on(chunk_gdn, lambda: delta_inputs(B=2, T=8, Hk=2, Hv=4, K=4, V=3,
                                                          requires_grad=True),
                          w_quantizer=torch.Tensor.detach), VE,
     r"w_quantizer must keep W's gradient: W requires grad, its result does not"),
    # -- chunk_kda, recurrent_delta_rule ----------------------------------------------------
    ("kda-g-scalar", on(chunk_kda, gdn), VE,
     r"g must have shape \(2, 8, 4, 4\), got \(2, 8, 4\)"),
    ("kda-chunk-none", on(chunk_kda, gdn, g=zeros(2, 8, 4, 4), chunk_size=None), TE,
     r"chunk_size must be a positive int, got NoneType"),
    ("recurrent-g-rank", on(recurrent_delta_rule, gdn, g=zeros(2, 8, 4, 4, 1)), VE,
     r"g must have shape \(2, 8, 4\) or \(2, 8, 4, 4\), got \(2, 8, 4, 4, 1\)"),
    ("recurrent-state-layout", on(recurrent_delta_rule, gdn, state_v_first=True), VE,
     r"initial_state must have shape \(2, 4, 3, 4\), got \(2, 4, 4, 3\)"),
    # -- diag_kdn ---------------------------------------------------------------------------
    ("kdn-k-shape", on(diag_kdn, kdn, k=zeros(2, 9, 2, 8)), VE,
     r"k must have q's shape \(2, 9, 2, 4\) = \[B, T, H, K\], got \(2, 9, 2, 8\)"),
    ("kdn-r-rank", on(diag_kdn, kdn, r=zeros(2, 9, 2, 1)), VE,
     r"r must have 3 dims, \[B, T, H\], got shape \(2, 9, 2, 1\)"),
    ("kdn-r-shape", on(diag_kdn, kdn, r=zeros(2, 9, 3)), VE,
     r"r must have shape \(2, 9, 2\) = \[B, T, H\], got \(2, 9, 3\)"),
    ("kdn-v-heads", on(diag_kdn, kdn, v=zeros(2, 9, 3, 3)), VE,
     r"v must be \[B=2, T=9, H=2, V\], got \(2, 9, 3, 3\)"),
    ("kdn-no-state", on(diag_kdn, kdn, memory=None, precision=None), TE,
     r"memory must be a torch.Tensor, got NoneType"),
    ("kdn-memory-shape", on(diag_kdn, kdn, memory=zeros(2, 2, 4, 5)), VE,
     r"memory must have shape \(2, 2, 4, 3\), got \(2, 2, 4, 5\)"),
    ("kdn-precision-shape", on(diag_kdn, kdn, precision=zeros(1, 2, 4)), VE,
     r"precision must have shape \(2, 2, 4\), got \(1, 2, 4\)"),
    ("kdn-memory-rank", on(diag_kdn, kdn, memory=zeros(2, 4, 3)), VE,
     r"memory must have 4 dims, \[N, H, K, V\], got shape \(2, 4, 3\)"),
    ("kdn-precision-rank", on(diag_kdn, kdn, precision=zeros(2, 4)), VE,
     r"precision must have 3 dims, \[N, H, K\], got shape \(2, 4\)"),
    ("kdn-memory-list", on(diag_kdn, kdn, memory=[0.0]), TE,
     r"memory must be a torch.Tensor, got list"),
    ("kdn-mixed-dtypes", on(diag_kdn, kdn, v=zeros(2, 9, 2, 3, dtype=torch.float32)),
     TE, r"q, k, v must share a dtype, got torch.float64, torch.float64, torch.float32"),
    ("kdn-chunk-none", on(diag_kdn, kdn, chunk_size=None), TE,
     r"chunk_size must be a positive int, got NoneType"),
    ("kdn-scale-none", on(diag_kdn, kdn, scale=None), TE,
     r"scale must be a float, got NoneType"),
    # -- state_fp8_qdq ----------------------------------------------------------------------
    ("fp8-block-v", on(state_fp8_qdq, dict, state=zeros(4, 4), block_v=-1), VE,
     r"block_v must be a positive int, got -1"),
    ("fp8-block-v-huge", on(state_fp8_qdq, dict, state=zeros(4, 4), block_v=2**63), VE,
     r"block_v must be below 2\*\*63, got 9223372036854775808"),
    ("fp8-rank", on(state_fp8_qdq, dict, state=zeros(4)), VE,
     r"state must be \[\.\.\., K, V\], got shape \(4,\)"),
    ("fp8-int", on(state_fp8_qdq, dict, state=zeros(4, 4, dtype=torch.int32)), TE,
     r"state must be float16, bfloat16, float32 or float64, got torch.int32"),
    # -- serving ----------------------------------------------------------------------------
    ("decode-tokens", on(delta_rule_decode, decode, **delta_inputs(
        B=2, T=9, Hk=1, Hv=2, K=4, V=3, dtype=torch.float32, with_state=False)), VE,
     r"a decode step takes 1 <= T <= 8 tokens per row, got T = 9 \(q \(2, 9, 1, 4\)\)"),
    ("decode-pool-shape", on(delta_rule_decode, decode, state_pool=torch.zeros(3, 2, 3, 4)), VE,
     r"state_pool must be \[S, Hv, K, V\] = \(S, 2, 4, 3\), got \(3, 2, 3, 4\)"),
    ("decode-pool-dtype", on(delta_rule_decode, decode, state_pool=zeros(3, 2, 4, 3, dtype=HALF)),
     TE, r"state_pool must be float32, bfloat16, float8_e4m3fn, float64, got torch.float16"),
    ("decode-pool-strided", on(delta_rule_decode, decode,
                               state_pool=torch.zeros(3, 2, 3, 4).transpose(-1, -2)), VE,
     r"state_pool must be contiguous"),
    ("decode-indices-dtype", on(delta_rule_decode, decode, state_indices=torch.tensor([0.0, 1.0])),
     TE, r"state_indices must be int32 or int64, got torch.float32"),
    ("decode-indices-shape", on(delta_rule_decode, decode, state_indices=torch.tensor([0, 1, 2])),
     VE, r"state_indices must be \[B\] = \(2,\), got \(3,\)"),
    ("decode-fp8-scales", on(delta_rule_decode, decode, state_pool=zeros(3, 2, 4, 3, dtype=FP8)),
     VE, r"a float8_e4m3fn state_pool needs pool_scales \[S, Hv, ceil\(V / 64\)\] float32, "
         r"got None"),
    ("decode-scales-no-fp8", on(delta_rule_decode, decode, pool_scales=torch.ones(3, 2, 1)), VE,
     r"pool_scales go with a float8_e4m3fn state_pool, got a torch.float32 pool"),
    ("decode-intermediate", on(delta_rule_decode, decode,
                               intermediate_states=torch.zeros(2, 1, 2, 4, 3)), VE,
     r"intermediate_states must be \[B, T, Hv, K, V\] = \(2, 2, 2, 4, 3\), "
     r"got \(2, 1, 2, 4, 3\)"),
    ("decode-grad", on(delta_rule_decode, decode, v=torch.zeros(2, 2, 2, 3, requires_grad=True)),
     RE, r"decode steps are inference only, but v require grad"),
    ("kdn-decode-precision", on(diag_kdn_decode, kdn_decode, precision_pool=torch.ones(2, 2, 4)),
     VE, r"precision_pool must be \[S, H, K\] = \(3, 2, 4\), got \(2, 2, 4\)"),
    ("kdn-decode-memory-dtype", on(diag_kdn_decode, kdn_decode,
                                   memory_pool=zeros(3, 2, 4, 3, dtype=FP8)), TE,
     r"memory_pool must be float32, bfloat16, float64, got torch.float8_e4m3fn"),
    # -- kdn_compile.fla --------------------------------------------------------------------
    ("fla-head-first", on(fla.chunk_gated_delta_rule, gdn, head_first=True), TE,
     r"kdn_compile.fla.chunk_gated_delta_rule does not support head_first=True \(head_first: "),
    ("fla-neg-eigval", on(fla.chunk_gated_delta_rule, gdn, allow_neg_eigval=True), VE,
     r"allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True"),
    ("fla-no-a-log", on(fla.chunk_gated_delta_rule, gdn, use_gate_in_kernel=True), VE,
     r"A_log must be provided when use_gate_in_kernel=True"),
    ("fla-a-log-size", on(fla.chunk_gated_delta_rule, gdn, use_gate_in_kernel=True, A_log=zeros(3)),
     VE, r"A_log must have 4 elements \(\[Hv\]\) on cpu, got shape \(3,\) on cpu"),
    ("fla-chunk-size", on(fla.chunk_gated_delta_rule, gdn, chunk_size=128), VE,
     r"chunk_size must be one of 16, 32, 64 for Gated DeltaNet, got 128"),
    ("fla-gv", on(fla.fused_recurrent_gated_delta_rule, gdn, gv=zeros(2, 8, 4, 3)), TE,
     r"fused_recurrent_gated_delta_rule does not support gv=a torch.float64 tensor of shape "
     r"\(2, 8, 4, 3\)"),
    ("fla-no-g", on(fla.fused_recurrent_gated_delta_rule, gdn, g=None, use_gate_in_kernel=True,
                    A_log=zeros(4)), VE,
     r"g \(the raw gate input\) must be provided when use_gate_in_kernel=True"),
    ("fla-lower-bound", on(fla.chunk_kda, gdn, g=zeros(2, 8, 4, 4), safe_gate=True,
                           use_gate_in_kernel=True, lower_bound=-6.0), VE,
     r"lower_bound must be in \[-5, 0\) with safe_gate=True, got -6.0"),
    ("fla-kda-g", on(fla.fused_recurrent_kda, gdn), VE,
     r"g must be \[B, T, HV, K\] = \(2, 8, 4, 4\), got \(2, 8, 4\)"),
    ("fla-scale-inf", on(fla.fused_recurrent_kda, gdn, g=zeros(2, 8, 4, 4), scale=-float("inf")),
     VE, r"scale must be finite, got -inf"),
    ("fla-flag-numpy", on(fla.chunk_gated_delta_rule, gdn, output_final_state=numpy.bool_(True)),
     TE, r"output_final_state must be a bool, got numpy\.(bool|ndarray)"),
    ("fla-q-list", on(fla.chunk_kda, gdn, q=[0.0], use_qk_l2norm_in_kernel=True), TE,
     r"q must be a torch.Tensor, got list"),
    # -- layers: forward ----------------------------------------------------------------------
    ("layer-x-rank", layer("gdn", x=lambda own: own.x[0]), VE,
     r"x must be \[B, T, D\] \(3 dims\), got shape \(6, 16\)"),
    ("layer-x-width", layer("gdn", x=lambda own: own.x[..., :15]), VE,
     r"x must be \[B, T, D\] with D = hidden_size = 16, got shape \(2, 6, 15\)"),
    ("layer-cu-batch", layer("gdn", cu_seqlens=torch.tensor([0, 3, 6])), VE,
     r"with cu_seqlens the batch size must be 1, got B = 2"),
    ("layer-state-tensor", layer("gdn", state=torch.zeros(2, 3)), TE,
     r"state must be None or the dict \['conv', 'recurrent'\] that a GatedDeltaNet returns, "
     r"got Tensor"),
    ("layer-gdn-state-in-kda", layer("kda", state=lambda own: own.state["gdn"]), VE,
     r"state was made by GatedDeltaNet\(hidden_size=16, num_heads=2, head_dim=4, num_v_heads=2, "
     r"head_v_dim=4, conv_size=4\); this layer is KimiDeltaAttention\(hidden_size=16, "),
    ("layer-kdn-state-in-gdn", layer("gdn", state=lambda own: own.state["kdn"]), VE,
     r"state was made by DiagKDN\(hidden_size=16, num_heads=2, head_dim=4, head_v_dim=4, "
     r"conv_size=4\); this layer is GatedDeltaNet\("),
    ("layer-state-keys", layer("gdn", state=lambda own: dict(own.state["kdn"])), VE,
     r"state must be the dict \['conv', 'recurrent'\] that a GatedDeltaNet returns, "
     r"got keys \['conv', 'memory', 'precision'\]"),
    ("layer-state-conv", layer("gdn", x=lambda own: own.x[:1], state=lambda own: own.state["gdn"]),
     VE, r'state\["conv"\] must have shape \(1, 3, 24\), got \(2, 3, 24\)'),
    ("layer-kdn-memory", layer("kdn", state=lambda own: {**own.state["kdn"],
                                                         "memory": torch.zeros(2, 2, 4, 5)}), VE,
     r'state\["memory"\] must have shape \(2, 2, 4, 4\), got \(2, 2, 4, 5\)'),
    ("layer-x-float64", layer("gdn", x=lambda own: own.x.double()), TE,
     r"x must be torch.float32, the dtype of this GatedDeltaNet's parameters, "
     r"got torch.float64"),
    ("layer-kda-x-bfloat16", layer("kda", x=lambda own: own.x.bfloat16()), TE,
     r"x must be torch.float32, the dtype of this KimiDeltaAttention's parameters, "
     r"got torch.bfloat16"),
    ("layer-kdn-x-float16", layer("kdn", x=lambda own: own.x.half()), TE,
     r"x must be torch.float32, the dtype of this DiagKDN's parameters, got torch.float16"),
    # -- layers: step -------------------------------------------------------------------------
    ("step-x-rank", layer("gdn", "step", x=lambda own: own.x[0]), VE,
     r"x must be \[B, T, D\] \(3 dims\), got shape \(6, 16\)"),
    ("step-cache-list", layer("gdn", "step", cache=[]), TE,
     r"cache must be the dict of allocate_cache, got list"),
    ("step-indices-dtype", layer("gdn", "step", state_indices=torch.tensor([0.0, 1.0])), TE,
     r"state_indices must be int32 or int64, got torch.float32"),
    ("step-indices-shape", layer("gdn", "step", state_indices=torch.tensor([0])), VE,
     r"state_indices must be \[B\] = \(2,\), got \(1,\)"),
    ("step-kda-cache-in-gdn", layer("gdn", "step", cache=lambda own: own.cache["kda"]), VE,
     r"cache was allocated by KimiDeltaAttention\(hidden_size=16, num_heads=2, head_dim=4, "
     r"num_v_heads=2, head_v_dim=4, conv_size=4\); this layer is GatedDeltaNet\("),
    ("step-kdn-cache-in-kda", layer("kda", "step", cache=lambda own: own.cache["kdn"]), VE,
     r"cache was allocated by DiagKDN\(hidden_size=16, num_heads=2, head_dim=4, head_v_dim=4, "
     r"conv_size=4\); this layer is KimiDeltaAttention\("),
    ("step-x-float64", layer("gdn", "step", x=lambda own: own.x.double()), TE,
     r"x must be torch.float32, the dtype of this GatedDeltaNet's parameters, "
     r"got torch.float64"),
    ("step-kda-x-bfloat16", layer("kda", "step", x=lambda own: own.x.bfloat16()), TE,
     r"x must be torch.float32, the dtype of this KimiDeltaAttention's parameters, "
     r"got torch.bfloat16"),
    ("step-kdn-x-float16", layer("kdn", "step", x=lambda own: own.x.half()), TE,
     r"x must be torch.float32, the dtype of this DiagKDN's parameters, got torch.float16"),
]


def _through_dynamo(error: BaseException) -> bool:
    return any("torch/_dynamo" in frame.filename.replace("\\", "/")
               for frame in traceback.extract_tb(error.__traceback__))


@pytest.mark.parametrize("mode", ("eager",) + COMPILED)
@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_documented_error(case, mode):
    """The exception type and the message (argument, expected, received) of eager mode,
    also out of ``torch.compile(fullgraph=True)`` with static and dynamic shapes."""
    _, make, error, message = case
    fn, kwargs = make()
    if mode != "eager":
        fn = torch.compile(fn, fullgraph=True, dynamic=mode == "dynamic", backend="eager")
    with pytest.raises(error, match=message) as raised:
        fn(**kwargs)
    assert _through_dynamo(raised.value) == (mode != "eager")


def test_messages_after_an_automatic_dynamic_recompile():
    """Default ``torch.compile`` recompiles with symbolic sizes (and chunk size) once they
    change; a bad argument after that still gets concrete sizes in its message."""

    def run(q, k, v, g, beta, initial_state, chunk_size):
        return kdn_compile.chunk_gdn(q, k, v, g, beta, initial_state=initial_state,
                                     chunk_size=chunk_size)

    compiled = torch.compile(run, fullgraph=True, backend="eager")
    for length, chunk_size in ((8, 4), (12, 8)):  # the second call recompiles dynamic
        o, _ = compiled(**delta_inputs(B=2, T=length, Hk=2, Hv=4, K=4, V=3), chunk_size=chunk_size)
        assert o.shape == (2, length, 4, 3)
    bad = delta_inputs(B=2, T=16, Hk=2, Hv=4, K=4, V=3, per_key=True)
    with pytest.raises(ValueError, match=r"g must have shape \(2, 16, 4\), got \(2, 16, 4, 4\)"):
        compiled(**bad, chunk_size=4)
    with pytest.raises(ValueError, match=r"chunk_size must be a positive finite int, got 0"):
        compiled(**delta_inputs(B=2, T=16, Hk=2, Hv=4, K=4, V=3), chunk_size=0)


SMALL = {"B": 1, "T": 6, "Hk": 1, "Hv": 1, "K": 4, "V": 3}
KERNEL_SIZES = {"B": 1, "T": 8, "Hk": 1, "Hv": 1, "K": 16, "V": 16, "dtype": torch.float32}
DOUBLE_BACKWARD = [  # (op, call, inputs, backend)
    ("chunk_gdn", lambda x: kdn_compile.chunk_gdn(**x, chunk_size=4), SMALL, "auto"),
    ("chunk_gdn", lambda x: kdn_compile.chunk_gdn(**x), KERNEL_SIZES, "triton"),
    ("chunk_kda", lambda x: kdn_compile.chunk_kda(**x, chunk_size=4), dict(SMALL, per_key=True),
     "auto"),
    ("recurrent_delta_rule", lambda x: kdn_compile.recurrent_delta_rule(**x), SMALL, "auto"),
    ("state_fp8_qdq", lambda x: (kdn_compile.state_fp8_qdq(x["initial_state"]),), SMALL, "auto"),
]


@pytest.mark.parametrize("name,call,sizes,backend", DOUBLE_BACKWARD,
                         ids=[f"{d[0]}-{d[3]}" for d in DOUBLE_BACKWARD])
def test_double_backward_names_the_op(name, call, sizes, backend):
    """First-order gradients under ``create_graph=True`` are the usual ones; a backward
    through them raises NotImplementedError naming the op (the kernels' backward as the
    reference's)."""
    x = delta_inputs(**sizes, requires_grad=True)
    leaves = list(x.values())
    with kdn_compile.use_backend(backend):
        plain = torch.autograd.grad(call(x)[0].square().sum(), leaves, allow_unused=True)
        grads = torch.autograd.grad(call(x)[0].square().sum(), leaves, create_graph=True,
                                    allow_unused=True)
    for a, b in zip(plain, grads):
        assert (a is None and b is None) or torch.equal(a, b)
    with pytest.raises(NotImplementedError, match=rf"kdn::{name} has no double backward"):
        sum(g.square().sum() for g in grads if g is not None).backward()


@pytest.mark.parametrize("name,call,sizes,backend", DOUBLE_BACKWARD[:1] + DOUBLE_BACKWARD[2:],
                         ids=[d[0] for d in DOUBLE_BACKWARD[:1] + DOUBLE_BACKWARD[2:]])
def test_forward_mode_ad_is_refused(name, call, sizes, backend):
    """A tangent (torch.func.jvp, forward_ad) raises NotImplementedError naming the
    function and the argument, where PyTorch would drop it and return the output as a
    constant (a zero tangent)."""
    x = delta_inputs(**sizes)
    key, shown = ("initial_state", "state") if name == "state_fp8_qdq" else ("v", "v")

    def run(tensor):
        return call(dict(x, **{key: tensor}))[0]

    message = rf"kdn_compile.{name} has no forward-mode AD, got a tangent on {shown} "
    with pytest.raises(NotImplementedError, match=message):
        torch.func.jvp(run, (x[key],), (torch.ones_like(x[key]),))


def test_forward_mode_ad_is_refused_by_the_decode_step():
    x = delta_inputs(**SMALL)
    pool = torch.zeros(2, 1, 4, 3, dtype=torch.float64)

    def run(v):
        return delta_rule_decode(x["q"], x["k"], v, x["g"], x["beta"], pool, torch.tensor([1]))

    with pytest.raises(NotImplementedError, match=r"kdn_compile.delta_rule_decode has no "
                                                  r"forward-mode AD, got a tangent on v "):
        torch.func.jvp(run, (x["v"],), (torch.ones_like(x["v"]),))


def test_double_backward_of_diag_kdn_names_the_op():
    x = kdn_inputs(B=1, T=6, H=1, K=4, V=3, requires_grad=True)
    (dv,) = torch.autograd.grad(
        kdn_compile.diag_kdn(**x, scale=1.0, info_scale=1.0, chunk_size=4)[0].sum(), x["v"],
        create_graph=True)
    with pytest.raises(NotImplementedError, match=r"kdn::diag_kdn has no double backward"):
        dv.sum().backward()
