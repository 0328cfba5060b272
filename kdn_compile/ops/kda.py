"""``kdn`` ops of chunked Kimi Delta Attention (per-key decay ``g [B, T, Hv, K]``)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kdn_compile import reference as ref
from kdn_compile.ops._registry import FamilyOps
from kdn_compile.ops._shapes import empty_state


def _chunk_kda_signature(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    chunk_size: int, scale: float, state_v_first: bool,
) -> tuple[Tensor, Tensor]: ...


def _chunk_kda_reference(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, scale,
                         state_v_first):
    return ref.chunk_kda_reference(
        q, k, v, g, beta, chunk_size=chunk_size, scale=scale, initial_state=initial_state,
        cu_seqlens=cu_seqlens, state_v_first=state_v_first,
    )


def _chunk_kda_fake(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, scale,
                    state_v_first):
    state = empty_state(q, cu_seqlens, v.shape[2], k.shape[3], v.shape[3], state_v_first)
    return torch.empty_like(v), state


CHUNK_KDA = FamilyOps(
    "chunk_kda", _chunk_kda_signature, _chunk_kda_reference, _chunk_kda_fake,
    differentiable=("q", "k", "v", "g", "beta", "initial_state"),
)


@torch.library.triton_op("kdn::chunk_kda", mutates_args=())
def chunk_kda_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    chunk_size: int, scale: float, state_v_first: bool,
) -> tuple[Tensor, Tensor]:
    """Chunked KDA; launches Triton where it can, else the reference op."""
    # Kernel branch: added with the two-key Triton kernels (lowering/).
    return torch.ops.kdn.chunk_kda_reference(
        q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, scale, state_v_first
    )


CHUNK_KDA.attach_autograd(chunk_kda_op, CHUNK_KDA.reference_backward)
