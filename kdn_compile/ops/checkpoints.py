"""``kdn`` ops of a prompt's prefill that keeps the states at checkpoints (prefix caches).

* ``kdn::diag_kdn_checkpoints`` (triton_op) and ``kdn::diag_kdn_checkpoints_reference``:
  Diag-KDN's ``(output, memory, precision)`` with the memories ``[N, C, H, K, V]`` and
  precisions ``[N, C, H, K]`` at the checkpoints: the memory from the two-key kernel's
  stores, the precision from the gain scan's covariance entering each chunk.
* ``kdn::chunk_checkpoints`` (triton_op) and ``kdn::chunk_checkpoints_reference``:
  chunked GDN (``g [B, T, Hv]``) or KDA (``g [B, T, Hv, K]``) returning ``(o,
  final_state, states)`` with ``states [N, C, Hv, K, V]`` the state after every
  ``checkpoint_every`` tokens of each sequence (zero past its end). The triton_op runs
  the forward kernels of ``lowering/chunk_gdn_fwd.py`` or ``lowering/two_key_fwd.py``,
  whose sequential pass stores the state at those chunk boundaries, where they cover
  the inputs, and the reference op elsewhere (CPU, float64, while tracing on the CPU).

Forward only (serving runs under ``torch.no_grad``); training uses ``kdn::chunk_gdn`` and
``kdn::chunk_kda``, whose outputs these equal bit for bit on the same path.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kdn_compile.ops._dispatch import TRITON
from kdn_compile.ops._shapes import empty_state
from kdn_compile.ops.gdn import _gdn_kernels
from kdn_compile.ops.kda import _kda_kernels
from kdn_compile.ops.kdn import _gain_kernels, _memory_kernels
from kdn_compile.reference import LOG_MEMORY_ALPHA_FLOOR
from kdn_compile.reference._common import work_dtype
from kdn_compile.reference.checkpoints import (
    chunk_checkpoints_reference,
    diag_kdn_checkpoints_reference,
)

if TRITON:
    from kdn_compile.lowering.chunk_gdn_fwd import chunk_gdn_fwd
    from kdn_compile.lowering.kalman_gain import kalman_gain_fwd, precision_at_checkpoints
    from kdn_compile.lowering.two_key_common import LOG_DECAY_BOUND
    from kdn_compile.lowering.two_key_fwd import two_key_fwd

CHUNK = 64


@torch.library.custom_op("kdn::chunk_checkpoints_reference", mutates_args=())
def chunk_checkpoints_reference_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: float,
    checkpoint_every: int, checkpoints: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """The exact reference
    (:func:`kdn_compile.reference.checkpoints.chunk_checkpoints_reference`)."""
    out = chunk_checkpoints_reference(
        q, k, v, g, beta, checkpoint_every=checkpoint_every, checkpoints=checkpoints,
        chunk_size=CHUNK, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
    )
    return tuple(t.contiguous().clone() for t in out)  # the fake's layout, no aliasing


@chunk_checkpoints_reference_op.register_fake
def _fake(q, k, v, g, beta, initial_state, cu_seqlens, scale, checkpoint_every, checkpoints):
    hv, dk, dv = v.shape[2], k.shape[3], v.shape[3]
    final_state = empty_state(q, cu_seqlens, hv, dk, dv, False)
    states = q.new_empty((final_state.shape[0], checkpoints, hv, dk, dv),
                         dtype=work_dtype(q.dtype))
    return v.new_empty(v.shape), final_state, states


def _kernels(q, k, v, g, beta, initial_state, cu_seqlens) -> bool:
    """Where ``kdn::chunk_kda`` (per-key ``g``) or ``kdn::chunk_gdn`` (no state
    quantization) run their kernels."""
    if g.dim() == 4:
        return _kda_kernels(q, v, CHUNK)
    return _gdn_kernels(q, k, v, g, beta, initial_state, cu_seqlens, CHUNK, False, 64)


def chunk_checkpoints_body(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: float,
    checkpoint_every: int, checkpoints: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Chunked GDN or KDA with the states at checkpoints; Triton where it can, else the
    reference op."""
    if not _kernels(q, k, v, g, beta, initial_state, cu_seqlens):
        return torch.ops.kdn.chunk_checkpoints_reference(
            q, k, v, g, beta, initial_state, cu_seqlens, scale, checkpoint_every, checkpoints)
    hv, dk, dv = v.shape[2], k.shape[3], v.shape[3]
    n = initial_state.shape[0] if initial_state is not None else (
        q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1)
    states = q.new_zeros((n, checkpoints, hv, dk, dv), dtype=torch.float32)
    if g.dim() == 4:
        o, final_state = two_key_fwd(
            q, k, None, v, g, initial_state, cu_seqlens, chunk_size=CHUNK, scale=scale,
            state_v_first=False, log_decay_floor=LOG_DECAY_BOUND, beta=beta,
            checkpoints=states, checkpoint_every=checkpoint_every)[:2]
    else:
        o, final_state = chunk_gdn_fwd(
            q, k, v, g, beta, initial_state, cu_seqlens, chunk_size=CHUNK, scale=scale,
            state_v_first=False, checkpoints=states, checkpoint_every=checkpoint_every)[:2]
    return o, final_state, states


chunk_checkpoints_op = torch.library.triton_op(
    "kdn::chunk_checkpoints", chunk_checkpoints_body, mutates_args=())


@torch.library.custom_op("kdn::diag_kdn_checkpoints_reference", mutates_args=())
def diag_kdn_checkpoints_reference_op(
    q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, omega: Tensor, r: Tensor,
    memory: Tensor, precision: Tensor, cu_seqlens: Optional[Tensor], scale: float,
    info_scale: float, checkpoint_every: int, checkpoints: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The exact reference
    (:func:`kdn_compile.reference.checkpoints.diag_kdn_checkpoints_reference`)."""
    out = diag_kdn_checkpoints_reference(
        q, k, v, log_alpha, omega, r, memory, precision, scale=scale, info_scale=info_scale,
        checkpoint_every=checkpoint_every, checkpoints=checkpoints, chunk_size=CHUNK,
        cu_seqlens=cu_seqlens)
    return tuple(t.contiguous().clone() for t in out)


@diag_kdn_checkpoints_reference_op.register_fake
def _kdn_fake(q, k, v, log_alpha, omega, r, memory, precision, cu_seqlens, scale, info_scale,
              checkpoint_every, checkpoints):
    dtype = work_dtype(q.dtype)
    n, h, dk, dv = memory.shape
    return (v.new_empty(v.shape), memory.new_empty(memory.shape, dtype=dtype),
            precision.new_empty(precision.shape, dtype=dtype),
            memory.new_empty((n, checkpoints, h, dk, dv), dtype=dtype),
            precision.new_empty((n, checkpoints, h, dk), dtype=dtype))


def diag_kdn_checkpoints_body(
    q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, omega: Tensor, r: Tensor,
    memory: Tensor, precision: Tensor, cu_seqlens: Optional[Tensor], scale: float,
    info_scale: float, checkpoint_every: int, checkpoints: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Diag-KDN with its states at checkpoints; Triton where both the gain and the memory
    kernels run, else the reference op."""
    if not (_gain_kernels(q, k, log_alpha, omega, r, precision, cu_seqlens)
            and _memory_kernels(q, v, CHUNK)):
        return torch.ops.kdn.diag_kdn_checkpoints_reference(
            q, k, v, log_alpha, omega, r, memory, precision, cu_seqlens, scale, info_scale,
            checkpoint_every, checkpoints)
    n, h, dk, dv = memory.shape
    half = k.dtype in (torch.float16, torch.bfloat16)  # the gains as kdn::diag_kdn stores them
    gain, final_precision, chunk_cov, _ = kalman_gain_fwd(
        k, log_alpha, omega, r, precision, cu_seqlens, info_scale=info_scale,
        gain_dtype=k.dtype if half else torch.float32)
    memories = q.new_zeros((n, checkpoints, h, dk, dv), dtype=torch.float32)
    output, final_memory = two_key_fwd(
        q, k, gain, v, log_alpha, memory, cu_seqlens, chunk_size=CHUNK, scale=scale,
        state_v_first=False, log_decay_floor=LOG_MEMORY_ALPHA_FLOOR, checkpoints=memories,
        checkpoint_every=checkpoint_every)[:2]
    precisions = precision_at_checkpoints(chunk_cov, final_precision, k, cu_seqlens,
                                          checkpoint_every, checkpoints)
    return output, final_memory, final_precision, memories, precisions


diag_kdn_checkpoints_op = torch.library.triton_op(
    "kdn::diag_kdn_checkpoints", diag_kdn_checkpoints_body, mutates_args=())
