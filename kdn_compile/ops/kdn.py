"""``kdn`` ops of the Diagonal Kalman Delta Network: Kalman gain scan + two-key memory."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kdn_compile import reference as ref
from kdn_compile.ops._registry import FamilyOps
from kdn_compile.reference._common import work_dtype


def _diag_kdn_signature(
    q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, omega: Tensor, r: Tensor,
    memory: Tensor, precision: Tensor, cu_seqlens: Optional[Tensor],
    scale: float, info_scale: float, chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor]: ...


def _diag_kdn_reference(q, k, v, log_alpha, omega, r, memory, precision, cu_seqlens,
                        scale, info_scale, chunk_size):
    return ref.diag_kdn_reference(
        q, k, v, log_alpha, omega, r, memory, precision, scale=scale,
        info_scale=info_scale, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
    )


def _diag_kdn_fake(q, k, v, log_alpha, omega, r, memory, precision, cu_seqlens, scale,
                   info_scale, chunk_size):
    dtype = work_dtype(q.dtype)
    return (
        torch.empty_like(v),
        memory.new_empty(memory.shape, dtype=dtype),
        precision.new_empty(precision.shape, dtype=dtype),
    )


DIAG_KDN = FamilyOps(
    "diag_kdn", _diag_kdn_signature, _diag_kdn_reference, _diag_kdn_fake,
    differentiable=("q", "k", "v", "log_alpha", "omega", "r", "memory", "precision"),
)


@torch.library.triton_op("kdn::diag_kdn", mutates_args=())
def diag_kdn_op(
    q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, omega: Tensor, r: Tensor,
    memory: Tensor, precision: Tensor, cu_seqlens: Optional[Tensor],
    scale: float, info_scale: float, chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Diag-KDN; launches Triton where it can, else the reference op."""
    # Kernel branch: added with the Kalman gain and two-key Triton kernels (lowering/).
    return torch.ops.kdn.diag_kdn_reference(
        q, k, v, log_alpha, omega, r, memory, precision, cu_seqlens, scale, info_scale,
        chunk_size,
    )


DIAG_KDN.attach_autograd(diag_kdn_op, DIAG_KDN.reference_backward)
