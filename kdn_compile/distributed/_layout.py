"""Where a rank's tokens sit on the global time axis: the inputs of its two runs.

Rank ``r`` of ``R`` holds tokens ``[r L, (r + 1) L)`` of every batch row. Across its
slice, a sequence's memory moves by an affine map of the memory it enters with,
``S_end = A S_in + B`` (``A`` ``[K, K]`` per head), and its covariance by a Mobius map.
Each rank runs its slice once with its values from the initial state it knows and
once more with zero values from the identity: the second run's final state is ``A``
and its output ``u_t`` gives the correction ``o_t += S_in^T u_t`` once ``S_in`` is
known (:mod:`kdn_compile.reference.context` chains the maps).

A sequence that starts on this rank starts from the caller's initial state, known
here, so its piece is a constant map (``A = 0``); only the piece that continues a
sequence begun on an earlier rank (every row at fixed length on ranks ``> 0``; with
``cu_seqlens`` at most one, the sequence that holds the rank's first token) carries
an ``A``. Everything here reads ``cu_seqlens`` on its device: no host
synchronization, so it traces under ``torch.compile``.
"""

from __future__ import annotations

import torch

from kdn_compile._checks import check_cu_seqlens, check_tensor, num_sequences, sequence_of
from kdn_compile.reference.context import carry_mask


class SliceLayout:
    """The bookkeeping of one rank's slice.

    Args:
        q: this rank's ``[B, L, H, K]`` slice (its batch size, length and device).
        cu_seqlens: global ``[N + 1]`` boundaries on the whole ``T = R L`` axis, or None.
        rank, world: this rank and the group's size ``R``.

    Raises:
        ValueError: ``q`` not ``[B, L, H, K]``, ``cu_seqlens`` with ``B != 1``, or
            boundaries that do not start at 0, rise and end at ``R L`` (as
            :func:`kdn_compile.chunk_gdn` checks them).
        TypeError: ``q`` not a float tensor, ``cu_seqlens`` not an int32/int64 tensor.
    """

    def __init__(self, q: torch.Tensor, cu_seqlens: torch.Tensor | None, rank: int, world: int):
        check_tensor("q", q, layout="BTHK")
        self.rank, self.world = rank, world
        self.batch, self.length = q.shape[0], q.shape[1]
        self.start = rank * self.length
        self.packed = cu_seqlens is not None
        check_cu_seqlens(cu_seqlens, self.batch, q.device, world * self.length)
        self.sequences = num_sequences(self.batch, cu_seqlens)
        self.local_cu = None
        # the packed-sequence description that kdn_compile.reference.context reads
        self.carry_index = self.continues = self.ended = None
        if not self.packed:
            # every row starts on rank 0 and continues into the ranks after it
            self.starts_here = torch.full((self.batch,), rank == 0, device=q.device)
            return
        bounds = cu_seqlens.to(torch.long)
        self.local_bounds = (bounds - self.start).clamp(0, self.length)
        self.local_cu = self.local_bounds.to(cu_seqlens.dtype)
        firsts = torch.arange(world, device=q.device) * self.length  # each rank's first token
        # carry_index[r]: the sequence holding rank r's first token; continues[r]: it began
        # on an earlier rank
        self.carry_index = sequence_of(bounds, firsts).clamp_max(self.sequences - 1)
        self.continues = bounds[self.carry_index] < firsts
        # ended[r, n]: sequence n finished before rank r's first token (identity there)
        self.ended = (bounds[None, :-1] < firsts[:, None]) & (bounds[None, 1:] <= firsts[:, None])
        self.starts_here = bounds[:-1] >= self.start

    # -- before the exchange ------------------------------------------------------------
    def known_starts(self, state: torch.Tensor | None) -> torch.Tensor | None:
        """The value run's initial state ``[N, H, ...]``: ``state`` for the sequences that
        start on this rank (or later), zeros for the one continuing into it."""
        if state is None:
            return None
        # where, not zeros: the state gets a (zero) gradient on every rank
        return torch.where(self.starts_here.view(-1, *(1,) * (state.dim() - 1)), state, 0.0)

    def identity_starts(self, heads: int, key_dim: int, like: torch.Tensor) -> torch.Tensor:
        """The identity run's initial state ``[N, H, K, K]``: the identity on the
        continuing piece, zeros elsewhere (those pieces' ``A`` is 0)."""
        eye = torch.eye(key_dim, dtype=like.dtype, device=like.device)
        eye = eye.expand(self.sequences, heads, key_dim, key_dim)
        mask = carry_mask(self.rank, self.sequences, self.carry_index, self.continues,
                          like.device)
        return eye * mask.to(like.dtype)

    def carry_rows(self, end: torch.Tensor) -> torch.Tensor:
        """The rows of the identity run's final state that hold ``A``: ``[B', H, K, K]``,
        ``B' = B`` at fixed length, 1 with ``cu_seqlens``."""
        if not self.packed:
            return end
        return end.index_select(0, self.carry_index[self.rank:self.rank + 1])

    def carry_shape(self, heads: int, key_dim: int) -> tuple[int, ...]:
        """``[B, H, K, K]``: one ``A`` per row (packed sequences have ``B == 1``)."""
        return (self.batch, heads, key_dim, key_dim)

    def chain(self) -> dict:
        """The packed-sequence description the exchange ops take (None at fixed length)."""
        return dict(carry_index=self.carry_index, continues=self.continues, ended=self.ended)

    def restart_maps(self, maps: tuple, covariance: torch.Tensor) -> tuple:
        """Each token's covariance map ``(m00, m01, m10, m11)`` ``[B, L, H, K]``, where a
        sequence starts on this rank composed with the constant map to its initial
        ``covariance [N, H, K]``: the product over the slice is then the carry map of its
        last sequence (constant when that sequence starts here)."""
        steps = torch.arange(self.length, device=covariance.device)
        if not self.packed:
            if self.rank > 0:
                return maps
            first = (steps == 0)[None, :, None, None]
            start = covariance[:, None]
        else:
            sequence = sequence_of(self.local_bounds, steps).clamp_max(self.sequences - 1)
            first = (steps == self.local_bounds[sequence]) & self.starts_here[sequence]
            first = first[None, :, None, None]
            start = covariance[sequence][None]
        m00, m01, m10, m11 = maps
        zero = torch.zeros_like(m00)
        return (torch.where(first, zero, m00), torch.where(first, m00 * start + m01, m01),
                torch.where(first, zero, m10), torch.where(first, m10 * start + m11, m11))
