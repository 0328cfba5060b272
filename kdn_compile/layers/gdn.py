"""Gated DeltaNet layer: projections, short conv, gates, ``kdn`` delta rule, gated norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kdn_compile
from kdn_compile._checks import check_state, num_sequences
from kdn_compile.layers._common import (
    GatedRMSNorm,
    ShortConv,
    check_sizes,
    convolved_qkv,
    decay_rate_log,
    heads,
    l2_normalize,
    time_step_bias,
    work,
)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer, ``[B, T, D] -> [B, T, D]``.

    Per token: ``q, k, v`` from linear projections through a short causal
    depthwise convolution and SiLU; ``q, k`` L2-normalized per head
    (``q / sqrt(|q|^2 + 1e-6)``, as FLA's ``l2norm``); the
    decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (natural log, one per
    value head) and ``beta = sigmoid(b)``; the recurrence
    ``S_t = (I - beta_t k_t k_t^T) exp(g_t) S_{t-1} + beta_t k_t v_t^T``,
    ``o_t = S_t^T q_t / sqrt(K)`` by :func:`kdn_compile.chunk_gdn` (or
    :func:`kdn_compile.recurrent_delta_rule` for a single decode token); then
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

    ``forward(x, state=None, cu_seqlens=None) -> (y, state)``: ``state`` is
    ``None`` (start of sequence) or the dict returned by the previous call,
    ``{"conv": [N, conv_size - 1, 2 * Hk * K + Hv * V], "recurrent": [N, Hv, K, V]}``
    (the recurrent state in float32, float64 for float64 inputs). With
    ``cu_seqlens`` (``[N + 1]`` int boundaries, ``B == 1``) the packed
    sequences stay independent, convolution included.

    Raises:
        ValueError: ``num_v_heads`` not a multiple of ``num_heads``, or a size
            (``hidden_size``, head counts and dims, ``chunk_size``, ``conv_size >= 2``) not a
            positive int.
        ValueError (forward): ``x`` not ``[B, T, D]``, ``cu_seqlens`` with ``B != 1`` or
            boundaries that do not start at 0, rise and end at ``T`` (checked before
            the packed convolution; on CUDA or while compiling a device-side assert,
            raised at the next synchronization), or a ``state`` entry not of the
            shape this layer returns for these rows (the message names it, e.g. ``state["conv"]``).
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
    ):
        super().__init__()
        check_sizes(hidden_size=hidden_size, num_heads=num_heads, head_dim=head_dim,
                    num_v_heads=num_v_heads, head_v_dim=head_v_dim, conv_size=conv_size,
                    chunk_size=chunk_size)
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        head_v_dim = head_dim if head_v_dim is None else head_v_dim
        if num_v_heads % num_heads != 0:
            raise ValueError(
                f"num_v_heads ({num_v_heads}) must be a multiple of num_heads ({num_heads})"
            )
        self.num_heads, self.head_dim = num_heads, head_dim
        self.num_v_heads, self.head_v_dim = num_v_heads, head_v_dim
        self.chunk_size = chunk_size
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
        return -self.A_log.exp() * F.softplus(work(self.a_proj(x)) + self.dt_bias)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        """The output gate before its activation, ``[B, T, Hv, V]``."""
        return heads(self.gate_proj(x), self.num_v_heads)

    def mix(self, q, k, v, g, beta, initial_state, cu_seqlens):
        """The sequence mixing: ``(o [B, T, Hv, V], final_state [N, Hv, K, V])``."""
        if q.shape[1] == 1:  # one decode token: the token recurrence (exact either way)
            return kdn_compile.recurrent_delta_rule(
                q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens
            )
        chunked = kdn_compile.chunk_kda if self.gate_per_key else kdn_compile.chunk_gdn
        return chunked(
            q, k, v, g, beta, chunk_size=self.chunk_size,
            initial_state=initial_state, cu_seqlens=cu_seqlens,
        )

    def forward(
        self,
        x: torch.Tensor,
        state: dict[str, torch.Tensor] | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        conv_cache = None if state is None else state["conv"]
        recurrent = None if state is None else state["recurrent"]
        q, k, v, conv_cache = convolved_qkv(self, x, conv_cache, cu_seqlens, self.num_v_heads)
        rows = num_sequences(x.shape[0], cu_seqlens)
        check_state('state["recurrent"]', recurrent,
                    (rows, self.num_v_heads, self.head_dim, self.head_v_dim))
        q, k = l2_normalize(q), l2_normalize(k)
        g = self.decay(x)
        beta = self.b_proj(x).sigmoid()
        o, recurrent = self.mix(q, k, v, g, beta, recurrent, cu_seqlens)
        o = self.norm(o, self.output_gate(x))
        return self.o_proj(o.flatten(-2)), {"conv": conv_cache, "recurrent": recurrent}
