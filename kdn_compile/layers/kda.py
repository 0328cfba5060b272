"""Kimi Delta Attention layer: Gated DeltaNet with one decay per key channel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kdn_compile.layers._common import heads
from kdn_compile.layers.gdn import GatedDeltaNet
from kdn_compile.reference._common import to_work


class KimiDeltaAttention(GatedDeltaNet):
    """Kimi Delta Attention token mixer, ``[B, T, D] -> [B, T, D]``.

    The arguments and ``state`` of :class:`GatedDeltaNet` and its anatomy, with
    Kimi Linear's gates (the parameters of ``fla.layers.KimiDeltaAttention``):
    a per-key-channel decay ``g [B, T, Hv, K] = -exp(A_log)[h] *
    softplus(f_proj(x) + dt_bias)`` (natural log; ``f_proj`` low rank,
    ``D -> V -> Hv * K``; ``dt_bias`` has ``Hv * K`` entries), the recurrence
    ``S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T`` by
    :func:`kdn_compile.chunk_kda` (or :func:`kdn_compile.recurrent_delta_rule` for
    up to 8 tokens), and the output ``rmsnorm(o) * sigmoid(g_proj(x))``
    (``g_proj`` low rank, ``D -> V -> Hv * V``, with a bias) before ``o_proj``.
    Source: Kimi Team, "Kimi Linear: An Expressive, Efficient Attention
    Architecture" (2025).
    """

    gate_per_key = True
    output_activation = "sigmoid"

    def add_gate_projections(self, hidden_size: int, gates: int, value_width: int) -> None:
        """Low rank through ``V = head_v_dim``, as Kimi Linear's layer (and FLA's):
        ``f_proj`` (``D -> V -> Hv K``, the decay) and ``g_proj`` (``D -> V -> Hv V``
        with a bias, the output gate)."""
        rank = self.head_v_dim
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, rank, bias=False),
                                    nn.Linear(rank, gates, bias=False))
        self.g_proj = nn.Sequential(nn.Linear(hidden_size, rank, bias=False),
                                    nn.Linear(rank, value_width, bias=True))

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """Log decay ``g [B, T, Hv, K]``."""
        raw = heads(to_work(self.f_proj(x)), self.num_v_heads)
        raw = raw + self.dt_bias.view(self.num_v_heads, -1)
        return -self.A_log.exp()[:, None] * F.softplus(raw)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        """The output gate before its sigmoid, ``[B, T, Hv, V]``."""
        return heads(self.g_proj(x), self.num_v_heads)
