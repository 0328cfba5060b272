"""Kimi Delta Attention layer: Gated DeltaNet with one decay per key channel."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kdn_compile.layers._common import heads, work
from kdn_compile.layers.gdn import GatedDeltaNet


class KimiDeltaAttention(GatedDeltaNet):
    """Kimi Delta Attention token mixer, ``[B, T, D] -> [B, T, D]``.

    The anatomy, arguments and ``state`` of :class:`GatedDeltaNet`, with a
    per-key-channel decay ``g [B, T, Hv, K] = -exp(A_log)[h] *
    softplus(a_proj(x) + dt_bias)`` (``dt_bias`` has ``Hv * K`` entries) and
    the recurrence ``S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} +
    beta_t k_t v_t^T`` by :func:`kdn_compile.chunk_kda` (or
    :func:`kdn_compile.recurrent_delta_rule` for a single decode token).
    Source: Kimi Team, "Kimi Linear: An Expressive, Efficient Attention
    Architecture" (2025).
    """

    gate_per_key = True

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """Log decay ``g [B, T, Hv, K]``."""
        raw = heads(work(self.a_proj(x)), self.num_v_heads)
        raw = raw + self.dt_bias.view(self.num_v_heads, -1)
        return -self.A_log.exp()[:, None] * F.softplus(raw)
