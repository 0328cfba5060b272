"""``kdn`` ops of chunked Gated DeltaNet cut at its WY operand ``W``: the ``w_quantizer`` path.

``chunk_gdn(..., w_quantizer=f)`` calls two ops with the user's ``f`` (a Python callable,
which no schema can carry) between them, traced as ordinary Python:

* ``kdn::gdn_wy_operands`` (triton_op) and ``kdn::gdn_wy_operands_reference``:
  ``(W [B, T, Hv, K], U [B, T, Hv, V])`` in the working dtype;
* ``kdn::gdn_wy_recurrence`` (triton_op) and ``kdn::gdn_wy_recurrence_reference``: the
  chunk recurrence from ``f(W)`` and ``U``, FP8 state QDQ included.

Where the kernels of ``lowering/chunk_gdn_wy.py`` cover the inputs (see
:func:`_operand_kernels`, :func:`_recurrence_kernels`) the triton_ops launch them and
their backward is ``kdn::gdn_wy_operands_bwd`` / ``kdn::gdn_wy_recurrence_bwd``
(triton_ops) on the tensors the forward saved (:data:`OPERANDS_SAVED`,
:data:`RECURRENCE_SAVED`); elsewhere both take the reference.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kdn_compile import reference as ref
from kdn_compile.ops._dispatch import TRITON, can_launch, metadata_only
from kdn_compile.ops._registry import (
    FamilyOps,
    empty_grads,
    fill_placeholders,
    saved_placeholders,
)
from kdn_compile.ops._shapes import empty_state
from kdn_compile.reference._common import work_dtype

if TRITON:  # else every op takes its reference (see _dispatch.TRITON)
    from kdn_compile.lowering.chunk_gdn_fwd import gdn_kernel_supports
    from kdn_compile.lowering.chunk_gdn_wy import (
        gdn_wy_kernel_supports,
        gdn_wy_operands_bwd,
        gdn_wy_operands_fwd,
        gdn_wy_recurrence_bwd,
        gdn_wy_recurrence_fwd,
    )


# -- the operands -------------------------------------------------------------------------


def _operands_signature(
    k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    cu_seqlens: Optional[Tensor], chunk_size: int,
) -> tuple[Tensor, Tensor]: ...


def _operands_reference(k, v, g, beta, cu_seqlens, chunk_size):
    return ref.gdn_wy_operands_reference(
        k, v, g, beta, chunk_size=chunk_size, cu_seqlens=cu_seqlens
    )


def _operands_fake(k, v, g, beta, cu_seqlens, chunk_size):
    dtype = work_dtype(k.dtype)
    b, t, hv, dv = v.shape
    return k.new_empty((b, t, hv, k.shape[3]), dtype=dtype), v.new_empty((b, t, hv, dv), dtype=dtype)


GDN_WY_OPERANDS = FamilyOps(
    "gdn_wy_operands", _operands_signature, _operands_reference,
    _operands_fake, differentiable=("k", "v", "g", "beta"),
)

# What gdn_wy_operands_fwd returns after (W, U) and gdn_wy_operands_bwd takes as prepared,
# each with the dimension of its heads (where DTensor shards it).
OPERANDS_SAVED = {"gc": 2, "ai": 2}


def _operand_kernels(k, v, g, beta, cu_seqlens, chunk_size) -> bool:
    """Kernels for the operands: a device that can launch them and what
    :func:`~kdn_compile.lowering.chunk_gdn_fwd.gdn_kernel_supports` covers."""
    return can_launch(k) and gdn_kernel_supports(k, k, v, g, beta, None, cu_seqlens, chunk_size)


@torch.library.triton_op("kdn::gdn_wy_operands", mutates_args=())
def gdn_wy_operands_op(
    k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    cu_seqlens: Optional[Tensor], chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(W, U, *saved)``; Triton where it can (:data:`OPERANDS_SAVED`), else the reference
    op (placeholders)."""
    if _operand_kernels(k, v, g, beta, cu_seqlens, chunk_size):
        return gdn_wy_operands_fwd(k, v, g, beta, cu_seqlens, chunk_size=chunk_size)
    w, u = torch.ops.kdn.gdn_wy_operands_reference(k, v, g, beta, cu_seqlens, chunk_size)
    return (w, u, *saved_placeholders(k, len(OPERANDS_SAVED), v.shape[2]))


@torch.library.triton_op("kdn::gdn_wy_operands_bwd", mutates_args=())
def gdn_wy_operands_bwd_op(
    k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    cu_seqlens: Optional[Tensor], chunk_size: int, gc: Tensor, ai: Tensor,
    grad_w: Tensor, grad_u: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``kdn::gdn_wy_operands`` on its kernel path: ``(dk, dv, dg, dbeta)``."""
    if metadata_only(k):
        return empty_grads(k, (k, v, g, beta))
    return gdn_wy_operands_bwd(k, v, g, beta, cu_seqlens, grad_w, grad_u,
                               chunk_size=chunk_size, prepared=(gc, ai))


GDN_WY_OPERANDS.attach_kernels(
    gdn_wy_operands_op, gdn_wy_operands_bwd_op, OPERANDS_SAVED,
    lambda x: _operand_kernels(x["k"], x["v"], x["g"], x["beta"], x["cu_seqlens"],
                               x["chunk_size"]),
)


# -- the recurrence -------------------------------------------------------------------------


def _recurrence_signature(
    q: Tensor, k: Tensor, w: Tensor, u: Tensor, g: Tensor,
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    chunk_size: int, scale: float, state_v_first: bool,
    state_qdq: bool, state_qdq_block_v: int,
) -> tuple[Tensor, Tensor]: ...


def _recurrence_reference(q, k, w, u, g, initial_state, cu_seqlens, chunk_size,
                          scale, state_v_first, state_qdq, state_qdq_block_v):
    return ref.gdn_wy_recurrence_reference(
        q, k, w, u, g, chunk_size=chunk_size, scale=scale, initial_state=initial_state,
        cu_seqlens=cu_seqlens, state_v_first=state_v_first, state_qdq=state_qdq,
        state_qdq_block_v=state_qdq_block_v,
    )


def _recurrence_fake(q, k, w, u, g, initial_state, cu_seqlens, chunk_size, scale,
                     state_v_first, state_qdq, state_qdq_block_v):
    return q.new_empty(u.shape), empty_state(q, cu_seqlens, u.shape[2], k.shape[3], u.shape[3], state_v_first)


GDN_WY_RECURRENCE = FamilyOps(
    "gdn_wy_recurrence", _recurrence_signature, _recurrence_reference,
    _recurrence_fake, differentiable=("q", "k", "w", "u", "g", "initial_state"),
)

# What gdn_wy_recurrence_fwd returns after (o, final_state) and gdn_wy_recurrence_bwd takes
# as prepared (hs and hs_scales: the float8 chunk states of state_qdq, placeholders without),
# each with the dimension of its heads (where DTensor shards it).
RECURRENCE_SAVED = {"gc": 2, "aqk": 2, "hs": 1, "hs_scales": 1}


def _recurrence_kernels(q, k, w, u, g, initial_state, cu_seqlens, chunk_size, state_qdq,
                        state_qdq_block_v) -> bool:
    """Kernels for the recurrence: a device that can launch them and what
    :func:`~kdn_compile.lowering.chunk_gdn_wy.gdn_wy_kernel_supports` covers."""
    return can_launch(q) and gdn_wy_kernel_supports(
        q, k, w, u, g, initial_state, cu_seqlens, chunk_size, state_qdq=state_qdq,
        state_qdq_block_v=state_qdq_block_v)


@torch.library.triton_op("kdn::gdn_wy_recurrence", mutates_args=())
def gdn_wy_recurrence_op(
    q: Tensor, k: Tensor, w: Tensor, u: Tensor, g: Tensor,
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    chunk_size: int, scale: float, state_v_first: bool,
    state_qdq: bool, state_qdq_block_v: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(o, final_state, *saved)``; Triton where it can (:data:`RECURRENCE_SAVED`), else
    the reference op (placeholders)."""
    if _recurrence_kernels(q, k, w, u, g, initial_state, cu_seqlens, chunk_size, state_qdq,
                           state_qdq_block_v):
        out = gdn_wy_recurrence_fwd(
            q, k, w, u, g, initial_state, cu_seqlens, chunk_size=chunk_size, scale=scale,
            state_v_first=state_v_first, state_qdq=state_qdq,
            state_qdq_block_v=state_qdq_block_v,
        )
        return fill_placeholders(out, q, u.shape[2])
    o, final_state = torch.ops.kdn.gdn_wy_recurrence_reference(
        q, k, w, u, g, initial_state, cu_seqlens, chunk_size, scale, state_v_first, state_qdq,
        state_qdq_block_v,
    )
    return (o, final_state, *saved_placeholders(q, len(RECURRENCE_SAVED), u.shape[2]))


@torch.library.triton_op("kdn::gdn_wy_recurrence_bwd", mutates_args=())
def gdn_wy_recurrence_bwd_op(
    q: Tensor, k: Tensor, w: Tensor, u: Tensor, g: Tensor,
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    chunk_size: int, scale: float, state_v_first: bool,
    state_qdq: bool, state_qdq_block_v: int,
    gc: Tensor, aqk: Tensor, hs: Tensor, hs_scales: Tensor,
    grad_o: Tensor, grad_state: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``kdn::gdn_wy_recurrence`` on its kernel path: ``(dq, dk, dw, du, dg,
    dh0)``; ``dh0`` is an empty tensor when ``initial_state`` is None."""
    if metadata_only(q):
        return empty_grads(q, (q, k, w, u, g, initial_state))
    dq, dk, dw, du, dg, dh0 = gdn_wy_recurrence_bwd(
        q, k, w, u, g, initial_state, cu_seqlens, grad_o, grad_state,
        chunk_size=chunk_size, scale=scale, state_v_first=state_v_first,
        state_qdq=state_qdq, state_qdq_block_v=state_qdq_block_v,
        prepared=(gc, aqk) + ((hs, hs_scales) if state_qdq else (None, None)),
    )
    return dq, dk, dw, du, dg, (q.new_empty(0) if dh0 is None else dh0)


GDN_WY_RECURRENCE.attach_kernels(
    gdn_wy_recurrence_op, gdn_wy_recurrence_bwd_op, RECURRENCE_SAVED,
    lambda x: _recurrence_kernels(
        x["q"], x["k"], x["w"], x["u"], x["g"], x["initial_state"], x["cu_seqlens"],
        x["chunk_size"], x["state_qdq"], x["state_qdq_block_v"]),
)
