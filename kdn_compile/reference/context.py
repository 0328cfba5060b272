"""The ranks' state maps chained in rank order: the math of context parallelism.

Rank ``r`` of ``R`` holds tokens ``[r L, (r + 1) L)``. Over its slice a sequence's
memory moves by an affine map ``S_end = A S_in + B`` (``A`` ``[K, K]`` per head) and
its covariance by a Mobius map. Every rank contributes, per sequence, its ``B``
(``ends [R, N, H, K, V]``) and, for the one piece that continues a sequence begun
on an earlier rank, its ``A`` (``carries [R, B, H, K, K]``: every row at fixed length,
row 0 with packed sequences, zeros on rank 0). The pieces of sequences that start on
a rank are constant maps (their initial state is known there); a sequence that ended
before a rank passes through it unchanged.

Packed sequences are described by three tensors over the ranks: ``carry_index [R]``
(the sequence holding each rank's first token), ``continues [R]`` (it began on an
earlier rank) and ``ended [R, N]``; all None at fixed length. Everything here is
differentiable PyTorch; the ops of :mod:`kdn_compile.ops.exchange` run it around
their collectives.
"""

from __future__ import annotations

import torch

__all__ = [
    "carry_mask", "chain_states", "corrected_output", "incoming_covariance",
    "continued_precision",
]


def carry_mask(rank: int, sequences: int, carry_index, continues, device) -> torch.Tensor:
    """``[N, 1, 1, 1]`` bool: the sequence that continues into ``rank`` from an earlier one."""
    if carry_index is None:  # fixed length: every row, past rank 0
        return torch.full((sequences, 1, 1, 1), rank > 0, device=device)
    rows = torch.arange(sequences, device=device)
    return ((rows == carry_index[rank]) & continues[rank]).view(-1, 1, 1, 1)


def chain_states(ends, carries, rank: int, carry_index=None, continues=None, ended=None):
    """``(state entering rank, final state)`` from every rank's maps.

    Args:
        ends: ``[R, N, ...]`` each rank's state at the end of its pieces (``B``).
        carries: ``[R, B, H, K, K]`` each rank's ``A``, or None where every piece is a
            constant or the identity (the precision).
        rank: whose incoming state to return (None for rank 0).
        carry_index, continues, ended: the packed-sequence description, or None.
    """
    state, incoming = ends[0], None
    shape = (-1,) + (1,) * (state.dim() - 1)
    for r in range(1, ends.shape[0]):
        if r == rank:
            incoming = state
        if carry_index is None:
            state = ends[r] if carries is None else ends[r] + torch.matmul(carries[r], state)
            continue
        update = ends[r]
        if carries is not None:
            row = state.index_select(0, carry_index[r:r + 1])
            mask = carry_mask(r, state.shape[0], carry_index, continues, state.device)
            update = update + mask * torch.matmul(carries[r], row)
        state = torch.where(ended[r].view(shape), state, update)
    return incoming, state


def corrected_output(o, u, incoming, rank: int, carry_index=None) -> torch.Tensor:
    """``o_t + S_in^T u_t`` (``u`` is zero off the continuing piece), computed in the
    state's dtype and returned in ``o``'s."""
    if carry_index is not None:
        incoming = incoming.index_select(0, carry_index[rank:rank + 1])
    fix = torch.einsum("bthk,bhkv->bthv", u.to(incoming.dtype), incoming)
    return (o.to(incoming.dtype) + fix).to(o.dtype)


def incoming_covariance(maps, rank: int):
    """The covariance entering ``rank``'s continuing piece, ``[B, H, K]``, from each rank's
    carry map ``maps [R, B, H, K, 4]`` (rank 0's is constant); None for rank 0."""
    if rank == 0:
        return None
    covariance = torch.ones_like(maps[0, ..., 0])
    for m in maps[:rank]:
        covariance = (m[..., 0] * covariance + m[..., 1]) / (m[..., 2] * covariance + m[..., 3])
    return covariance


def continued_precision(precision, incoming, rank: int, carry_index=None, continues=None):
    """The precision ``[N, H, K]`` each sequence enters ``rank`` with: ``1 / incoming`` on
    the continuing piece, ``precision`` (the caller's) elsewhere."""
    if incoming is None:
        return precision.clone()
    mask = carry_mask(rank, precision.shape[0], carry_index, continues, precision.device)
    return torch.where(mask[..., 0], incoming.reciprocal(), precision)
