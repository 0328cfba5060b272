"""Exact reference of a prompt's prefill that also keeps its states at checkpoints.

A prefix cache for a recurrent model needs the state after the first ``m`` tokens of a
prompt for several ``m``: every ``checkpoint_every`` tokens. The chunked recurrence
passes through those states when ``checkpoint_every`` is a multiple of the chunk size;
the reference runs the prompt once for its outputs and final state, then each sequence
again in pieces of ``checkpoint_every`` tokens, each piece from the state the previous
one left (the chunks start at the same tokens as in one run).
"""

from __future__ import annotations

import torch

from kdn_compile._checks import num_sequences
from kdn_compile.reference._common import segments, work_dtype
from kdn_compile.reference.delta_rule import chunk_gdn_reference, chunk_kda_reference
from kdn_compile.reference.kdn import diag_kdn_reference

__all__ = ["chunk_checkpoints_reference", "diag_kdn_checkpoints_reference"]


def chunk_checkpoints_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    checkpoint_every: int,
    checkpoints: int,
    chunk_size: int = 64,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked GDN (``g [B, T, Hv]``) or KDA (``g [B, T, Hv, K]``) with the states at
    checkpoints.

    Args:
        q, k, v, g, beta, scale, initial_state, cu_seqlens: as
            :func:`~kdn_compile.reference.chunk_gdn_reference` (key-first states).
        checkpoint_every: tokens between checkpoints, a positive multiple of
            ``chunk_size``.
        checkpoints: ``C >= 0``, the checkpoints kept per sequence.

    Returns:
        ``(o, final_state, states)``: ``o`` and ``final_state`` as the chunked reference
        gives them; ``states [N, C, Hv, K, V]`` in the state dtype (float32, or float64 for
        float64 inputs), ``states[n, c]`` the state of sequence ``n`` after its first
        ``(c + 1) * checkpoint_every`` tokens, zero where the sequence is shorter.
    """
    run = chunk_kda_reference if g.dim() == 4 else chunk_gdn_reference
    batch, length, hv = v.shape[0], v.shape[1], v.shape[2]
    n = num_sequences(batch, cu_seqlens)
    dtype = work_dtype(q.dtype)
    o, final_state = run(q, k, v, g, beta, chunk_size=chunk_size, scale=scale,
                         initial_state=initial_state, cu_seqlens=cu_seqlens)
    states = q.new_zeros((n, checkpoints, hv, k.shape[-1], v.shape[-1]), dtype=dtype)
    if initial_state is None:
        initial_state = q.new_zeros((n, hv, k.shape[-1], v.shape[-1]), dtype=dtype)
    batch_rows = slice(None) if cu_seqlens is None else slice(0, 1)
    for rows, times in segments(cu_seqlens, batch, length):
        state = initial_state[rows].to(dtype)
        for c in range(min(checkpoints, (times.stop - times.start) // checkpoint_every)):
            piece = slice(times.start + c * checkpoint_every,
                          times.start + (c + 1) * checkpoint_every)
            _, state = run(*(t[batch_rows, piece] for t in (q, k, v, g, beta)),
                           chunk_size=chunk_size, scale=scale, initial_state=state)
            states[rows, c] = state
    return o, final_state, states


def diag_kdn_checkpoints_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_alpha: torch.Tensor,
    omega: torch.Tensor,
    r: torch.Tensor,
    memory: torch.Tensor,
    precision: torch.Tensor,
    *,
    scale: float,
    info_scale: float,
    checkpoint_every: int,
    checkpoints: int,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Diag-KDN (:func:`~kdn_compile.reference.diag_kdn_reference`) with its states at
    checkpoints: ``(output, memory, precision, memories [N, C, H, K, V], precisions [N, C,
    H, K])``, ``memories[n, c]`` and ``precisions[n, c]`` the state of sequence ``n`` after
    its first ``(c + 1) * checkpoint_every`` tokens (zero where the sequence is shorter);
    the rest as the reference gives it."""
    output, final_memory, final_precision = diag_kdn_reference(
        q, k, v, log_alpha, omega, r, memory, precision, scale=scale, info_scale=info_scale,
        chunk_size=chunk_size, cu_seqlens=cu_seqlens)
    n, h, dk, dv = memory.shape
    memories = final_memory.new_zeros((n, checkpoints, h, dk, dv))
    precisions = final_precision.new_zeros((n, checkpoints, h, dk))
    batch_rows = slice(None) if cu_seqlens is None else slice(0, 1)
    for rows, times in segments(cu_seqlens, q.shape[0], q.shape[1]):
        m, p = memory[rows], precision[rows]
        for c in range(min(checkpoints, (times.stop - times.start) // checkpoint_every)):
            piece = slice(times.start + c * checkpoint_every,
                          times.start + (c + 1) * checkpoint_every)
            _, m, p = diag_kdn_reference(
                *(t[batch_rows, piece] for t in (q, k, v, log_alpha, omega, r)), m, p,
                scale=scale, info_scale=info_scale, chunk_size=chunk_size)
            memories[rows, c], precisions[rows, c] = m, p
    return output, final_memory, final_precision, memories, precisions
