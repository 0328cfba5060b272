"""``kdn`` ops of chunked Gated DeltaNet (scalar decay per token and value head).

* ``kdn::chunk_gdn`` (triton_op) and ``kdn::chunk_gdn_reference``: the whole
  chunked recurrence, optional FP8 state fake quantization included. Where the
  Triton kernels of ``lowering/chunk_gdn_*.py`` cover the inputs (see
  :func:`_gdn_kernels`), the forward launches them and the backward is
  ``kdn::chunk_gdn_bwd`` (triton_op), which reuses the gates, ``(I + A)^-1`` and
  ``M`` that ``kdn::chunk_gdn`` returns after ``(o, final_state)`` (:data:`SAVED`;
  placeholders on the reference branch) and, with FP8 state quantization, the chunk
  start states as float8 values and scales (which hold them exactly: the backward
  recomputes no state); elsewhere both take the reference.

The same computation cut in two around the WY operand ``W`` (``w_quantizer``):
:mod:`kdn_compile.ops.gdn_wy`.
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
    saved_placeholders,
)
from kdn_compile.ops._shapes import empty_state

if TRITON:  # else every op takes its reference (see _dispatch.TRITON)
    from kdn_compile.lowering.chunk_gdn_bwd import chunk_gdn_bwd
    from kdn_compile.lowering.chunk_gdn_fwd import chunk_gdn_fwd, gdn_kernel_supports


def _chunk_gdn_signature(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    chunk_size: int, scale: float, state_v_first: bool,
    state_qdq: bool, state_qdq_block_v: int,
) -> tuple[Tensor, Tensor]: ...


def _chunk_gdn_reference(
    q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, scale, state_v_first,
    state_qdq, state_qdq_block_v,
):
    return ref.chunk_gdn_reference(
        q, k, v, g, beta, chunk_size=chunk_size, scale=scale,
        initial_state=initial_state, cu_seqlens=cu_seqlens, state_v_first=state_v_first,
        state_qdq=state_qdq, state_qdq_block_v=state_qdq_block_v,
    )


def _chunk_gdn_fake(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, scale,
                    state_v_first, state_qdq, state_qdq_block_v):
    state = empty_state(q, cu_seqlens, v.shape[2], k.shape[3], v.shape[3], state_v_first)
    return v.new_empty(v.shape), state


CHUNK_GDN = FamilyOps(
    "chunk_gdn", _chunk_gdn_signature, _chunk_gdn_reference, _chunk_gdn_fake,
    differentiable=("q", "k", "v", "g", "beta", "initial_state"),
)


def _gdn_kernels(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, state_qdq,
                 state_qdq_block_v) -> bool:
    """Whether ``kdn::chunk_gdn`` runs on its Triton kernels (else the reference).

    Kernels: a device that can launch them (CUDA, or eager CPU under
    ``TRITON_INTERPRET=1``) and the shapes and dtypes of
    :func:`~kdn_compile.lowering.chunk_gdn_fwd.gdn_kernel_supports` (chunk size 64; q, k,
    v in float16, bfloat16 or float32 with K and V powers of two in [16, 256]; with FP8
    state quantization a scale tile that
    :func:`~kdn_compile.lowering.chunk_gdn_fwd.qdq_tile_width` covers).
    """
    return can_launch(q) and gdn_kernel_supports(
        q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, state_qdq=state_qdq,
        state_qdq_block_v=state_qdq_block_v)


# The outputs of chunk_gdn_fwd after (o, final_state): what chunk_gdn_bwd takes as prepared
# (no chunk state: the kernels' backward recomputes them, under state_qdq the same float8
# states bit for bit), each with the dimension of its heads (where DTensor shards it).
SAVED = {"gc": 2, "ai": 2, "aqk": 2}


@torch.library.triton_op("kdn::chunk_gdn", mutates_args=())
def chunk_gdn_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    chunk_size: int, scale: float, state_v_first: bool,
    state_qdq: bool, state_qdq_block_v: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Chunked GDN; launches Triton where it can, else the reference op.

    Returns ``(o, final_state, *saved)``: the kernels' :data:`SAVED` tensors, or
    empty placeholders after the reference.
    """
    if _gdn_kernels(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, state_qdq,
                    state_qdq_block_v):
        out = chunk_gdn_fwd(
            q, k, v, g, beta, initial_state, cu_seqlens, chunk_size=chunk_size, scale=scale,
            state_v_first=state_v_first, state_qdq=state_qdq,
            state_qdq_block_v=state_qdq_block_v,
        )
        return out
    o, final_state = torch.ops.kdn.chunk_gdn_reference(
        q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, scale,
        state_v_first, state_qdq, state_qdq_block_v,
    )
    return (o, final_state, *saved_placeholders(q, len(SAVED), v.shape[2]))


@torch.library.triton_op("kdn::chunk_gdn_bwd", mutates_args=())
def chunk_gdn_bwd_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    chunk_size: int, scale: float, state_v_first: bool,
    state_qdq: bool, state_qdq_block_v: int,
    gc: Tensor, ai: Tensor, aqk: Tensor, grad_o: Tensor, grad_state: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``kdn::chunk_gdn`` on its kernel path: ``(dq, dk, dv, dg, dbeta, dh0)``.

    Takes the forward's :data:`SAVED` gates, ``(I + A)^-1`` and ``M``; recomputes the
    chunk states (with ``state_qdq``, the forward's float8 states bit for bit).
    ``grad_state`` may be None (zero); ``dh0`` is an empty tensor when
    ``initial_state`` is None.
    """
    if metadata_only(q):
        return empty_grads(q, (q, k, v, g, beta, initial_state))
    dq, dk, dv, dg, dbeta, dh0 = chunk_gdn_bwd(
        q, k, v, g, beta, initial_state, cu_seqlens, grad_o, grad_state,
        chunk_size=chunk_size, scale=scale, state_v_first=state_v_first,
        state_qdq=state_qdq, state_qdq_block_v=state_qdq_block_v,
        prepared=(gc, ai, aqk),
    )
    return dq, dk, dv, dg, dbeta, (q.new_empty(0) if dh0 is None else dh0)


CHUNK_GDN.attach_kernels(
    chunk_gdn_op, chunk_gdn_bwd_op, SAVED,
    lambda x: _gdn_kernels(x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"],
                           x["cu_seqlens"], x["chunk_size"], x["state_qdq"],
                           x["state_qdq_block_v"]),
)
