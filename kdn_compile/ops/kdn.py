"""``kdn`` ops of the Diagonal Kalman Delta Network: Kalman gain scan + two-key memory."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kdn_compile import reference as ref
from kdn_compile.lowering.kalman_gain import (
    kalman_gain_bwd,
    kalman_gain_fwd,
    kalman_gain_kernel_supports,
)
from kdn_compile.ops._dispatch import _tracing, can_launch
from kdn_compile.ops._registry import FamilyOps
from kdn_compile.reference._common import segments, work_dtype


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


def _gain_kernels(q, k, log_alpha, omega, r, precision, cu_seqlens) -> bool:
    """Whether the Kalman gain runs on its Triton kernels (``lowering/kalman_gain*.py``).

    Varlen while tracing stays on the reference: the interim memory math below
    reads ``cu_seqlens`` on the host.
    """
    return (
        can_launch(q)
        and kalman_gain_kernel_supports(k, log_alpha, omega, r, precision, cu_seqlens)
        and not (cu_seqlens is not None and _tracing(q))
    )


def _memory(q, k, v, log_alpha, gain, memory, cu_seqlens, scale, chunk_size):
    """Two-key memory from the gains by the reference math, one run per sequence.

    Interim: the two-key Triton kernels replace it. Returns ``(output, memory)``.
    """
    dtype = work_dtype(q.dtype)
    work = [x.to(dtype) for x in (q, k, v, log_alpha, gain)]
    memory = memory.to(dtype)
    outputs, memories = [], []
    for rows, times in segments(cu_seqlens, q.shape[0], q.shape[1]):
        o, m = ref.chunked_memory(*(x[:, times] for x in work), memory[rows], scale=scale,
                                  chunk_size=chunk_size)
        outputs.append(o)
        memories.append(m)
    return torch.cat(outputs, dim=1).to(v.dtype), torch.cat(memories, dim=0)


@torch.library.triton_op("kdn::diag_kdn", mutates_args=())
def diag_kdn_op(
    q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, omega: Tensor, r: Tensor,
    memory: Tensor, precision: Tensor, cu_seqlens: Optional[Tensor],
    scale: float, info_scale: float, chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Diag-KDN; launches Triton where it can, else the reference op."""
    if _gain_kernels(q, k, log_alpha, omega, r, precision, cu_seqlens):
        gain, final_precision, _, _ = kalman_gain_fwd(
            k, log_alpha, omega, r, precision, cu_seqlens, info_scale=info_scale)
        output, memory = _memory(q, k, v, log_alpha, gain, memory, cu_seqlens, scale, chunk_size)
        return output, memory, final_precision
    return torch.ops.kdn.diag_kdn_reference(
        q, k, v, log_alpha, omega, r, memory, precision, cu_seqlens, scale, info_scale,
        chunk_size,
    )


def _diag_kdn_backward(inputs, grads):
    """Gain kernels recomputed and reversed; the memory part through its reference math."""
    q, k, v, log_alpha, omega, r, memory, precision, cu_seqlens = (
        inputs[n] for n in ("q", "k", "v", "log_alpha", "omega", "r", "memory", "precision",
                            "cu_seqlens"))
    if not _gain_kernels(q, k, log_alpha, omega, r, precision, cu_seqlens):
        return DIAG_KDN.reference_backward(inputs, grads)
    doutput, dmemory, dprecision = grads
    info_scale = inputs["info_scale"]
    gain, _, chunk_cov, final_cov = kalman_gain_fwd(
        k, log_alpha, omega, r, precision, cu_seqlens, info_scale=info_scale)
    dtype = work_dtype(q.dtype)
    with torch.enable_grad():
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v, log_alpha, gain, memory)]
        output, memory_out = _memory(*leaves, cu_seqlens, inputs["scale"], inputs["chunk_size"])
        found = torch.autograd.grad((output, memory_out), leaves, (doutput, dmemory),
                                    allow_unused=True)
    dq, dk, dv, dlog_alpha, dgain, dmemory0 = (
        torch.zeros_like(x) if g is None else g for x, g in zip(leaves, found))
    dk_gain, dlog_alpha_gain, domega, dr, dprecision0 = kalman_gain_bwd(
        leaves[1].detach(), leaves[3].detach(), omega, r, precision, cu_seqlens, chunk_cov,
        final_cov, dgain, dprecision, info_scale=info_scale)
    return {
        "q": dq.to(q.dtype), "k": (dk + dk_gain).to(k.dtype), "v": dv.to(v.dtype),
        "log_alpha": (dlog_alpha + dlog_alpha_gain).to(log_alpha.dtype), "omega": domega,
        "r": dr, "memory": dmemory0.to(memory.dtype), "precision": dprecision0,
    }


DIAG_KDN.attach_autograd(diag_kdn_op, _diag_kdn_backward)
