"""``kdn`` ops of chunked Kimi Delta Attention (per-key decay ``g [B, T, Hv, K]``).

* ``kdn::chunk_kda`` (triton_op) and ``kdn::chunk_kda_reference``: where the
  two-key Triton kernels of ``lowering/two_key_*.py`` cover the inputs (see
  :func:`_kda_kernels`) the op launches them with ``beta`` (the kernels form the
  write key ``w = beta k`` as they read it); its gradients then come from
  ``kdn::chunk_kda_bwd`` (triton_op), which runs the backward kernels on the
  forward's saved tensors. Elsewhere both take the reference.

``kdn::chunk_kda`` returns ``(o, final_state)`` followed by the ten tensors that
:func:`two_key_fwd` saves for :func:`two_key_bwd` (:data:`SAVED`; empty
placeholders on the reference branch), kept by its autograd for the backward
and not differentiable; :func:`kdn_compile.chunk_kda` returns the first two.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kdn_compile import reference as ref
from kdn_compile.ops._dispatch import TRITON, can_launch, metadata_only
from kdn_compile.ops._registry import FamilyOps, empty_grads, saved_placeholders
from kdn_compile.ops._shapes import empty_state

if TRITON:  # else every op takes its reference (see _dispatch.TRITON)
    from kdn_compile.lowering.two_key_bwd import two_key_bwd
    from kdn_compile.lowering.two_key_common import LOG_DECAY_BOUND, two_key_kernel_supports
    from kdn_compile.lowering.two_key_fwd import two_key_fwd


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
    return v.new_empty(v.shape), state


# The outputs of two_key_fwd after (o, final_state): what two_key_bwd reads, each with the
# dimension of its heads (where DTensor shards it); the chunk table (None) is the same on
# every rank.
SAVED = {"c": 1, "qd": 1, "kd": 1, "wl": 1, "tmat": 1, "rmat": 1, "h": 1, "x": 1,
         "spans": None, "offsets": None}

CHUNK_KDA = FamilyOps(
    "chunk_kda", _chunk_kda_signature, _chunk_kda_reference, _chunk_kda_fake,
    differentiable=("q", "k", "v", "g", "beta", "initial_state"),
)


def _kda_kernels(q, v, chunk_size) -> bool:
    """Whether ``kdn::chunk_kda`` runs on the two-key Triton kernels (else the reference).

    Kernels: a device that can launch them (CUDA, or eager CPU under
    ``TRITON_INTERPRET=1``) and the shapes and dtypes of
    :func:`~kdn_compile.lowering.two_key_common.two_key_kernel_supports` (chunk
    size 64; K and V in {64, 128} for half inputs, powers of two in [16, 128]
    for float32).
    """
    return can_launch(q) and two_key_kernel_supports(q, v, chunk_size=chunk_size)


# On the kernel path ``g`` is floored at the kernels' bound ``LOG_DECAY_BOUND = -20``
# per token (the kernels floor it as they read it: ``log_decay_floor``). They factor
# decays inside 8-token halves of a sub-block and overflow float32 below about -22 per
# token. A token decaying by ``e^-20`` instead of less keeps at most ``2e-9`` of the
# state it should erase, below float32 resolution, so the floor changes no result that
# float32 can show; its gradient is zero where it applies (the true one is below 2e-9).


@torch.library.triton_op("kdn::chunk_kda", mutates_args=())
def chunk_kda_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    chunk_size: int, scale: float, state_v_first: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
           Tensor, Tensor]:
    """Chunked KDA; launches Triton where it can, else the reference op.

    Returns ``(o, final_state, *saved)``: the kernels' :data:`SAVED` tensors, or
    empty placeholders after the reference.
    """
    if _kda_kernels(q, v, chunk_size):
        return two_key_fwd(
            q, k, None, v, g, initial_state, cu_seqlens,
            chunk_size=chunk_size, scale=scale, state_v_first=state_v_first,
            log_decay_floor=LOG_DECAY_BOUND, beta=beta,
        )
    o, final_state = torch.ops.kdn.chunk_kda_reference(
        q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, scale, state_v_first
    )
    return (o, final_state, *saved_placeholders(q, len(SAVED), v.shape[2]))


@torch.library.triton_op("kdn::chunk_kda_bwd", mutates_args=())
def chunk_kda_bwd_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    chunk_size: int, scale: float, state_v_first: bool,
    c: Tensor, qd: Tensor, kd: Tensor, wl: Tensor, tmat: Tensor, rmat: Tensor, h: Tensor,
    x: Tensor, spans: Tensor, offsets: Tensor,
    grad_o: Tensor, grad_state: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``kdn::chunk_kda`` on its kernel path: ``(dq, dk, dv, dg, dbeta, dh0)``.

    Takes the forward's inputs and its :data:`SAVED` outputs (nothing is
    recomputed); the kernels chain ``w = beta k`` (``dk`` gets
    ``beta dw``, ``dbeta = sum_K dw k``) and the gate's floor. ``grad_state`` may be
    None (zero); ``dh0`` is an empty tensor when ``initial_state`` is None.
    """
    if metadata_only(q):
        return empty_grads(q, (q, k, v, g, beta, initial_state))
    dq, dk, dbeta, dv, dg, dh0 = two_key_bwd(
        q, k, None, v, g, initial_state, cu_seqlens,
        c, qd, kd, wl, tmat, rmat, h, x, spans, offsets, grad_o, grad_state,
        chunk_size=chunk_size, scale=scale, state_v_first=state_v_first,
        log_decay_floor=LOG_DECAY_BOUND, beta=beta,
    )
    return (
        dq, dk, dv, dg, dbeta,
        q.new_empty(0) if initial_state is None else dh0.to(initial_state.dtype),
    )


CHUNK_KDA.attach_kernels(
    chunk_kda_op, chunk_kda_bwd_op, SAVED,
    lambda x: _kda_kernels(x["q"], x["v"], x["chunk_size"]),
)
