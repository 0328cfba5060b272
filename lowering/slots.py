"""Writing rows into a pool at named slots, padding rows skipped: one Triton kernel.

A pool of any trailing shape is viewed as ``[S, row_numel]``; program ``(b, j)`` copies
block ``j`` of ``rows[b]`` to ``pool[indices[b]]`` when ``0 <= indices[b] < S`` and does
nothing otherwise. Values are copied as stored (``rows`` has the pool's dtype), so a
float8 pool is written bit for bit. The grid depends on shapes only and nothing is
read on the host: a launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

__all__ = ["scatter_slots_fwd"]

_BLOCK = 1024  # elements per program: a row of a state pool is a few of these


@triton.jit
def _scatter_slots_kernel(pool, rows, indices, num_slots, row_numel, BLOCK: tl.constexpr):
    i_b, i_j = tl.program_id(0), tl.program_id(1)
    slot = tl.load(indices + i_b).to(tl.int64)
    if (slot >= 0) & (slot < num_slots):
        offsets = i_j * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < row_numel
        values = tl.load(rows + i_b.to(tl.int64) * row_numel + offsets, mask=mask)
        tl.store(pool + slot * row_numel + offsets, values, mask=mask)


def scatter_slots_fwd(pool: torch.Tensor, indices: torch.Tensor, rows: torch.Tensor) -> None:
    """``pool[indices[b]] = rows[b]`` for every ``indices[b] >= 0``, in place.

    ``pool [S, ...]`` contiguous; ``rows [B, ...]`` contiguous with the pool's dtype and
    trailing shape; ``indices [B]`` int32/int64 (negative: skipped).
    """
    batch = indices.shape[0]
    row_numel = pool[0].numel()
    if batch == 0 or row_numel == 0:
        return
    block = min(_BLOCK, triton.next_power_of_2(row_numel))
    wrap_triton(_scatter_slots_kernel)[(batch, triton.cdiv(row_numel, block))](
        pool, rows, indices, pool.shape[0], row_numel, BLOCK=block,
    )
