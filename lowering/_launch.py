"""Launch helpers shared by the chunked delta-rule kernels.

Chunk bookkeeping stays on the device: :func:`chunk_offsets` builds, with tensor
ops only, the index of each sequence's first chunk, and the device function
:func:`locate_chunk` maps a program's flat chunk index to its sequence by binary
search over it. Grids are sized from shapes alone (an upper bound of chunks;
surplus programs return), so launchers stay fake-tensor safe and never sync.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = [
    "chunk_offsets",
    "dot_precision",
    "head_dims_verified",
    "locate_chunk",
    "num_chunks_bound",
    "sequence_span",
    "sequence_chunks",
    "sm_count",
    "state_tile",
]


def chunk_offsets(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``[N + 1]`` int32: index of each sequence's first chunk, then the total.

    Device ops only (no host sync). Sequence ``n`` owns chunks
    ``[out[n], out[n + 1])`` of the flat chunk axis.
    """
    counts = (cu_seqlens[1:] - cu_seqlens[:-1] + chunk_size - 1) // chunk_size
    return torch.cat((counts.new_zeros(1), counts.cumsum(0))).to(torch.int32)


def num_chunks_bound(batch: int, length: int, num_seqs: int, chunk_size: int, varlen: bool):
    """Upper bound on the number of chunks, from shapes only.

    Fixed length: ``batch * ceil(length / chunk_size)`` exactly. Packed
    sequences (``length`` tokens in ``num_seqs`` runs) add at most one partial
    chunk per run: ``ceil(length / chunk_size) + num_seqs - 1``.
    """
    if varlen:
        return triton.cdiv(length, chunk_size) + num_seqs - 1
    return batch * triton.cdiv(length, chunk_size)


def head_dims_verified(dtype: torch.dtype, *dims: int) -> bool:
    """Whether the chunked kernels (GDN, two-key) take head sizes ``dims`` in ``dtype``.

    The sizes that passed against the float64 reference on the H200 (Triton 3.6,
    2026-11-30): 64 and 128 for float16/bfloat16, powers of two in ``[16, 128]``
    for float32. Outside them the GDN kernels failed there (bf16 ``K = V = 256``: a
    wrong output; fp16 ``K = 32, V = 16``: an illegal memory access), and the
    two-key kernels, which share their tile shapes, were never checked; the
    interpreter's bounds check finds no out-of-buffer access at those sizes.
    Inputs outside take the reference.
    """
    allowed = (16, 32, 64, 128) if dtype == torch.float32 else (64, 128)
    return all(d in allowed for d in dims)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact fp32 for fp32 inputs (no tf32), else tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H200); 1 elsewhere."""
    if device.type != "cuda":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def sequence_span(i_n, cu_seqlens, T, IS_VARLEN: tl.constexpr):
    """Token range ``[bos, eos)`` (int64) of sequence ``i_n`` in the flat token axis."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    return bos, eos


@triton.jit
def sequence_chunks(i_n, cu_seqlens, offsets, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """``(bos, eos, c0)`` of sequence ``i_n``: its tokens and its first flat chunk index."""
    bos, eos = sequence_span(i_n, cu_seqlens, T, IS_VARLEN)
    if IS_VARLEN:
        c0 = tl.load(offsets + i_n).to(tl.int64)
    else:
        c0 = i_n.to(tl.int64) * tl.cdiv(T, BT)
    return bos, eos, c0


@triton.jit
def locate_chunk(i_c, cu_seqlens, offsets, T, N, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Sequence ``i_n``, in-sequence chunk ``i_t`` and ``[bos, eos)`` of flat chunk ``i_c``.

    Fixed length: ``N`` sequences of ``T`` tokens. Packed: binary search for the
    last ``n`` with ``offsets[n] <= i_c`` (``offsets`` from :func:`chunk_offsets`).
    A surplus program gets ``bos + i_t * BT >= eos`` and should return.
    """
    if IS_VARLEN:
        lo = i_c * 0
        hi = lo + N - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            ok = tl.load(offsets + mid) <= i_c
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        i_n = lo
        i_t = i_c - tl.load(offsets + i_n)
    else:
        nt = tl.cdiv(T, BT)
        i_n = i_c // nt
        i_t = i_c % nt
    bos, eos = sequence_span(i_n, cu_seqlens, T, IS_VARLEN)
    return i_n, i_t, bos, eos



@triton.jit
def state_tile(i_v, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
               STATE_V_FIRST: tl.constexpr):
    """Offsets of the ``[K, BV]`` tile ``i_v`` of one ``[K, V]`` state.

    With ``STATE_V_FIRST`` the state is stored ``[V, K]``; the tile is still
    presented key-major.
    """
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    if STATE_V_FIRST:
        return o_k[:, None] + o_v[None, :] * K
    return o_k[:, None] * V + o_v[None, :]
