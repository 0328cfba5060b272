"""Gated DeltaNet layer: projections, short conv, gates, ``kdn`` delta rule, gated norm."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from kdn_compile.api import chunk_gdn, chunk_kda, recurrent_delta_rule
from kdn_compile.checkpoints import prefill_states
from kdn_compile._checks import check_callable, check_flag, check_state, fail, num_sequences
from kdn_compile.layers._serving import SlotCache, load_state, store_state
from kdn_compile.layers._state import LayerState, signature, state_entries
from kdn_compile.reference._common import to_work, work_dtype
from kdn_compile.reference.pools import POOL_BLOCK_V
from kdn_compile.layers._common import (
    GatedRMSNorm,
    ShortConv,
    check_eps,
    check_sizes,
    convolved_qkv,
    decay_rate_log,
    heads,
    l2_normalize,
    time_step_bias,
)
from kdn_compile.serving import MAX_DECODE_TOKENS, commit_states, delta_rule_decode


class GatedDeltaNet(SlotCache, nn.Module):
    """Gated DeltaNet token mixer, ``[B, T, D] -> [B, T, D]``.

    Per token: ``q, k, v`` from linear projections through a short causal
    depthwise convolution and SiLU; ``q, k`` L2-normalized per head
    (``q / sqrt(|q|^2 + 1e-6)``, as FLA's ``l2norm``); the
    decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (natural log, one per
    value head) and ``beta = sigmoid(b)``; the recurrence
    ``S_t = (I - beta_t k_t k_t^T) exp(g_t) S_{t-1} + beta_t k_t v_t^T``,
    ``o_t = S_t^T q_t / sqrt(K)`` by :func:`kdn_compile.chunk_gdn` (or
    :func:`kdn_compile.recurrent_delta_rule` for up to 8 tokens); then
    ``rmsnorm(o) * silu(gate_proj(x))`` and the output projection.
    Source: Yang, Kautz, Hatamizadeh, "Gated Delta Networks" (2024).

    Args:
        hidden_size: model width ``D``.
        num_heads: key heads ``Hk``.
        head_dim: key width ``K`` per head.
        num_v_heads: value heads ``Hv``, a multiple of ``num_heads``
            (default ``num_heads``); value head ``h`` reads key head
            ``h // (Hv // Hk)``.
        head_v_dim: value width ``V`` per head (default ``head_dim``).
        conv_size: taps of the short convolution (default 4).
        chunk_size: chunk length of the chunked recurrence (default 64).
        norm_eps: epsilon of the output RMSNorm (default 1e-5).
        state_qdq: quantization-aware training: FP8 E4M3 fake quantization of the
            recurrent state (:func:`kdn_compile.chunk_gdn`'s ``state_qdq``: the initial
            state and each chunk's final state; straight-through gradient).
        state_qdq_block_v: value columns per FP8 scale (default 64).
        w_quantizer: quantization-aware training: a callable fake-quantizing the WY
            operand ``W [B, T, Hv, K]`` (:func:`kdn_compile.chunk_gdn`'s
            ``w_quantizer``; e.g. :func:`kdn_compile.quantization.fp8_row_qdq`).
            With either, ``forward`` runs the chunked op at every length (the
            quantization is defined on it); ``step`` (serving) runs the plain
            recurrences, where a float8 pool stores the state quantized as
            ``state_qdq`` does (``state_qdq_block_v = 64``).

    ``forward(x, state=None, cu_seqlens=None) -> (y, state)``: ``state`` is
    ``None`` (start of sequence) or the dict returned by the previous call, a
    :class:`~kdn_compile.layers.LayerState`
    ``{"conv": [N, conv_size - 1, 2 * Hk * K + Hv * V], "recurrent": [N, Hv, K, V]}``
    (the recurrent state in float32, float64 for float64 inputs) that records the layer
    type and sizes (``made_by``, this layer's ``state_signature``). With
    ``cu_seqlens`` (``[N + 1]`` int boundaries, ``B == 1``) the packed
    sequences stay independent, convolution included.

    Serving (:doc:`/serving`): ``allocate_cache(num_slots, *,
    state_dtype=torch.float32, device=None)`` makes the slot pools (``"conv"``,
    ``"recurrent"`` and, for float8, ``"recurrent_scales"``; a
    :class:`~kdn_compile.layers.LayerCache` that records this layer's
    ``state_signature``, which ``step`` and ``reset_cache`` check), ``reset_cache(cache,
    slots)`` frees slots for reuse and ``step(x, cache, state_indices,
    cu_seqlens=None) -> y`` advances the named slots in place: prompts through
    :func:`kdn_compile.chunk_gdn`, decode steps of up to 8 tokens through
    :func:`kdn_compile.delta_rule_decode`. Speculative decoding: ``verify(x, cache,
    state_indices, drafts) -> y`` runs draft tokens without touching the pools, into
    the buffers of ``allocate_drafts(batch, tokens)``, and ``commit(cache,
    state_indices, accepted, drafts)`` keeps each row's accepted tokens.

    Raises:
        ValueError: ``num_v_heads`` not a multiple of ``num_heads``, or a size
            (``hidden_size``, head counts and dims, ``chunk_size``, ``conv_size >= 2``,
            ``state_qdq_block_v``) not a positive int; ``norm_eps`` not finite or negative;
            ``state_qdq`` or ``w_quantizer``
            on :class:`~kdn_compile.layers.KimiDeltaAttention` (the chunked KDA op has
            neither).
        TypeError: ``state_qdq`` not a bool, ``w_quantizer`` neither None nor callable,
            ``norm_eps`` not a real number.
        ValueError (forward): ``x`` not ``[B, T, D]``, ``cu_seqlens`` with ``B != 1`` or
            boundaries that do not start at 0, rise and end at ``T`` (checked before
            the packed convolution; on CUDA or while compiling a device-side assert,
            raised at the next synchronization), a ``state`` entry not of the
            shape this layer returns for these rows (the message names it, e.g.
            ``state["conv"]``), a ``state`` made by a layer of another type or sizes
            (a KimiDeltaAttention state, say, though its tensors have the same shapes), or
            a dict with other keys.
        TypeError (forward, step): ``x`` or ``state`` of the wrong type (a tensor as
            ``state``); ``x`` in another dtype than the parameters (``q_proj.weight``'s;
            not checked under ``torch.autocast``).
    """

    gate_per_key = False  # KimiDeltaAttention: one decay per key channel
    output_activation = "silu"  # of the output gate (KimiDeltaAttention: sigmoid)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        num_v_heads: int | None = None,
        head_v_dim: int | None = None,
        conv_size: int = 4,
        chunk_size: int = 64,
        norm_eps: float = 1e-5,
        state_qdq: bool = False,
        state_qdq_block_v: int = 64,
        w_quantizer: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        super().__init__()
        check_sizes(hidden_size=hidden_size, num_heads=num_heads, head_dim=head_dim,
                    num_v_heads=num_v_heads, head_v_dim=head_v_dim, conv_size=conv_size,
                    chunk_size=chunk_size, state_qdq_block_v=state_qdq_block_v)
        norm_eps = check_eps("norm_eps", norm_eps)
        check_flag("state_qdq", state_qdq)
        check_callable("w_quantizer", w_quantizer)
        if self.gate_per_key and (state_qdq or w_quantizer is not None):
            raise ValueError(f"{type(self).__name__} takes no state_qdq or w_quantizer: "
                             f"the chunked KDA op has neither")
        self.state_qdq, self.state_qdq_block_v = state_qdq, state_qdq_block_v
        self.w_quantizer = w_quantizer
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        head_v_dim = head_dim if head_v_dim is None else head_v_dim
        if num_v_heads % num_heads != 0:
            fail(ValueError,
                 f"num_v_heads ({num_v_heads}) must be a multiple of num_heads ({num_heads})")
        self.num_heads, self.head_dim = num_heads, head_dim
        self.num_v_heads, self.head_v_dim = num_v_heads, head_v_dim
        self.chunk_size = chunk_size
        self.state_signature = signature(
            self, hidden_size=hidden_size, num_heads=num_heads, head_dim=head_dim,
            num_v_heads=num_v_heads, head_v_dim=head_v_dim, conv_size=conv_size,
        )
        key_width, value_width = num_heads * head_dim, num_v_heads * head_v_dim
        gates = num_v_heads * head_dim if self.gate_per_key else num_v_heads

        self.q_proj = nn.Linear(hidden_size, key_width, bias=False)
        self.k_proj = nn.Linear(hidden_size, key_width, bias=False)
        self.v_proj = nn.Linear(hidden_size, value_width, bias=False)
        self.conv = ShortConv(2 * key_width + value_width, conv_size)
        self.add_gate_projections(hidden_size, gates, value_width)
        self.b_proj = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.A_log = nn.Parameter(decay_rate_log(num_v_heads))
        self.dt_bias = nn.Parameter(time_step_bias(gates))
        self.norm = GatedRMSNorm(head_v_dim, norm_eps, activation=self.output_activation)
        self.o_proj = nn.Linear(value_width, hidden_size, bias=False)

    def add_gate_projections(self, hidden_size: int, gates: int, value_width: int) -> None:
        """The decay and output-gate projections: ``a_proj``, ``gate_proj`` (full rank)."""
        self.a_proj = nn.Linear(hidden_size, gates, bias=False)
        self.gate_proj = nn.Linear(hidden_size, value_width, bias=False)

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """Log decay ``g [B, T, Hv]``: ``-exp(A_log) * softplus(a_proj(x) + dt_bias)``."""
        return -self.A_log.exp() * F.softplus(to_work(self.a_proj(x)) + self.dt_bias)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        """The output gate before its activation, ``[B, T, Hv, V]``."""
        return heads(self.gate_proj(x), self.num_v_heads)

    def mix(self, q, k, v, g, beta, initial_state, cu_seqlens):
        """The sequence mixing: ``(o [B, T, Hv, V], final_state [N, Hv, K, V])``.

        Up to 8 tokens (a length known while tracing, so an export with a dynamic
        length keeps the chunked op) run the token recurrence; exact either way.
        Quantization-aware training (``state_qdq``, ``w_quantizer``) runs the chunked op
        at every length.
        """
        quantized = self.state_qdq or self.w_quantizer is not None
        if not quantized and statically_known_true(q.shape[1] <= MAX_DECODE_TOKENS):
            return recurrent_delta_rule(
                q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens
            )
        if self.gate_per_key:
            return chunk_kda(q, k, v, g, beta, chunk_size=self.chunk_size,
                             initial_state=initial_state, cu_seqlens=cu_seqlens)
        return chunk_gdn(
            q, k, v, g, beta, chunk_size=self.chunk_size, initial_state=initial_state,
            cu_seqlens=cu_seqlens, state_qdq=self.state_qdq,
            state_qdq_block_v=self.state_qdq_block_v, w_quantizer=self.w_quantizer,
        )

    def mixer_inputs(self, x, q, k):
        """``(q, k, g, beta)``: q and k L2-normalized, the decay and the write strength."""
        return l2_normalize(q), l2_normalize(k), self.decay(x), self.b_proj(x).sigmoid()

    def output(self, o, x):
        """``o [B, T, Hv, V]`` through the gated norm and the output projection."""
        return self.o_proj(self.norm(o, self.output_gate(x)).flatten(-2))

    def forward(
        self,
        x: torch.Tensor,
        state: dict[str, torch.Tensor] | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``x [B, T, D]`` -> ``(y [B, T, D], state)``, continuing ``state`` (None: a fresh
        sequence) as the class docstring says; up to 8 tokens run the token-recurrence
        kernels (:func:`kdn_compile.recurrent_delta_rule`), longer inputs the chunked ones.
        Training and whole sequences; a server's slot pools use :meth:`step`."""
        conv_cache, recurrent = state_entries(self, state, ("conv", "recurrent"))
        q, k, v, conv_cache = convolved_qkv(self, x, conv_cache, cu_seqlens, self.num_v_heads)
        rows = num_sequences(x.shape[0], cu_seqlens)
        check_state('state["recurrent"]', recurrent,
                    (rows, self.num_v_heads, self.head_dim, self.head_v_dim))
        q, k, g, beta = self.mixer_inputs(x, q, k)
        o, recurrent = self.mix(q, k, v, g, beta, recurrent, cu_seqlens)
        state = LayerState(self.state_signature, {"conv": conv_cache, "recurrent": recurrent})
        return self.output(o, x), state

    # -- serving -------------------------------------------------------------------------
    def pool_layout(self, state_dtype):
        layout = {
            "conv": ((self.conv.kernel_size - 1, self.conv.weight.shape[0]),
                     self.q_proj.weight.dtype),
            "recurrent": ((self.num_v_heads, self.head_dim, self.head_v_dim), state_dtype),
        }
        if state_dtype == torch.float8_e4m3fn:
            tiles = -(-self.head_v_dim // POOL_BLOCK_V)
            layout["recurrent_scales"] = ((self.num_v_heads, tiles), torch.float32)
        return layout

    @property
    def _keeps_checkpoints(self) -> bool:
        return not self.state_qdq and self.w_quantizer is None

    def advance(self, x, cache, indices, cu_seqlens, decode, checkpoints=None):
        q, k, v = self._conv_step(x, cache, indices, cu_seqlens, self.num_v_heads, checkpoints)
        q, k, g, beta = self.mixer_inputs(x, q, k)
        if decode:
            o = delta_rule_decode(
                q, k, v, g, beta, cache["recurrent"], indices,
                pool_scales=cache.get("recurrent_scales"),
            )
        else:
            initial = load_state(cache, "recurrent", indices, work_dtype(x.dtype))
            if checkpoints is None:
                o, final = self.mix(q, k, v, g, beta, initial, cu_seqlens)
            else:  # the chunked op of mix, keeping the states at the checkpoints
                kept, every, count = checkpoints
                o, final, states = prefill_states(
                    q, k, v, g, beta, checkpoint_every=every, checkpoints=count, scale=None,
                    initial_state=initial, cu_seqlens=cu_seqlens)
                store_state(cache, "recurrent", kept, states)
            store_state(cache, "recurrent", indices, final)
        return self.output(o, x)

    # -- speculative decoding (SlotCache.verify / commit) ---------------------------------
    @property
    def _value_heads(self) -> int:
        return self.num_v_heads

    def _draft_layout(self, state_dtype):
        states = torch.float64 if state_dtype == torch.float64 else torch.float32
        return {"recurrent": (self.pool_layout(state_dtype)["recurrent"][0], states)}

    def _verify_mix(self, x, q, k, v, cache, indices, drafts):
        q, k, g, beta = self.mixer_inputs(x, q, k)
        return delta_rule_decode(q, k, v, g, beta, cache["recurrent"], indices,
                                 pool_scales=cache.get("recurrent_scales"),
                                 intermediate_states=drafts["recurrent"], update_state=False)

    def _commit_mix(self, cache, indices, accepted, drafts):
        commit_states(cache["recurrent"], indices, drafts["recurrent"], accepted,
                      pool_scales=cache.get("recurrent_scales"))
