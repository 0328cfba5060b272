"""Launch helpers shared by the chunked delta-rule kernels.

Chunk bookkeeping stays on the device: :func:`chunk_offsets` builds, with tensor
ops only, the index of each sequence's first chunk and :func:`chunk_spans` the
token span of each flat chunk. Grids are sized from shapes alone (an upper bound of
chunks; surplus programs return), so launchers stay fake-tensor safe and never sync.

Kernels load these indices (and ``cu_seqlens``) in their own body, never inside a
``@triton.jit`` helper: torch's mutation analysis of a ``wrap_triton`` kernel (its
TTIR before inlining) counts every pointer passed to a helper whose result reaches a
store address as written. A kernel seen writing its ``cu_seqlens`` gets a copy of it
at every launch, and one seen writing a tensor that an op saves for its backward
breaks AOTAutograd's partitioner (pytorch issue 174124). Helpers here take values.
`tests/_sm90_compile.py` checks what every kernel is seen to write.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = [
    "chunk_offsets",
    "chunk_owners",
    "chunk_spans",
    "dot_precision",
    "fixed_chunk",
    "fixed_sequence",
    "inverse_precision",
    "num_chunks_bound",
    "sm_count",
    "state_tile",
    "uncovered_inputs",
]


def chunk_offsets(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``[N + 1]`` int32: index of each sequence's first chunk, then the total.

    Device ops only (no host sync). Sequence ``n`` owns chunks
    ``[out[n], out[n + 1])`` of the flat chunk axis.
    """
    counts = (cu_seqlens[1:] - cu_seqlens[:-1] + chunk_size - 1) // chunk_size
    return torch.cat((counts.new_zeros(1), counts.cumsum(0))).to(torch.int32)


def chunk_owners(offsets: torch.Tensor, bound: int) -> torch.Tensor:
    """``[bound]`` int32: the sequence owning each flat chunk, ``N`` for surplus ones.

    ``offsets [N + 1]`` from :func:`chunk_offsets` (``offsets[-1] <= bound``).
    Device ops only, and none whose fake implementation guards on sizes (a
    ``searchsorted`` here made ``torch.export`` specialize on the length).
    """
    offsets = offsets.to(torch.int64)
    repeats = torch.cat((offsets.diff(), (bound - offsets[-1]).reshape(1)))
    owners = torch.arange(offsets.shape[0], device=offsets.device, dtype=torch.int32)
    return torch.repeat_interleave(owners, repeats, output_size=bound)


def chunk_spans(cu_seqlens: torch.Tensor, offsets: torch.Tensor, bound: int,
                chunk_size: int) -> torch.Tensor:
    """``[bound, 3]`` int32, row ``i`` for flat chunk ``i``: its first token, its sequence's
    end and its sequence, device ops only. The one chunk table of every packed kernel: a
    per-chunk program reads ``spans + 3 * i``, ``+ 1`` and ``+ 2`` (in the kernel body).

    Chunks belong to sequences in order (empty sequences own none); a surplus
    chunk (past ``offsets[-1]``) gets a first token at or past the last sequence's
    end: its program returns.
    """
    seq = chunk_owners(offsets, bound).clamp_max(offsets.shape[0] - 2)
    ids = torch.arange(bound, device=offsets.device, dtype=offsets.dtype)
    cu = cu_seqlens.to(offsets.dtype)
    t0 = cu[seq] + (ids - offsets[seq]) * chunk_size
    return torch.stack((t0, cu[seq + 1], seq), 1).to(torch.int32)


def num_chunks_bound(batch: int, length: int, num_seqs: int, chunk_size: int, varlen: bool):
    """Upper bound on the number of chunks, from shapes only.

    Fixed length: ``batch * ceil(length / chunk_size)`` exactly. Packed
    sequences (``length`` tokens in ``num_seqs`` runs) add at most one partial
    chunk per run: ``ceil(length / chunk_size) + num_seqs - 1``.
    """
    if varlen:
        return triton.cdiv(length, chunk_size) + num_seqs - 1
    return batch * triton.cdiv(length, chunk_size)


def uncovered_inputs(kernels: str, supports: str, chunk_size: int, q, v) -> ValueError:
    """The launchers' error for inputs their ``supports`` check refuses (``kernels`` names
    the family in the message): an uncovered input must not reach a kernel."""
    return ValueError(
        f"the {kernels} kernels do not cover chunk_size={chunk_size}, q/v dtypes "
        f"{q.dtype}/{v.dtype}, K={q.shape[-1]}, V={v.shape[-1]} (see {supports} for "
        f"what they cover): use the reference"
    )


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact fp32 for fp32 inputs (no tf32), else tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def inverse_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision of the products forming a ``(I + A)^-1`` stored in
    ``dtype``: exact float32 (``"ieee"``) for a float32 inverse; TF32 for one stored in
    half precision, whose rounding hides TF32's. (GDN prepare kernel, bf16, 8x4096x16, H100:
    0.291 ms against 0.324 exact, the stored inverse as far from a float64 one in both: the
    bf16 rounding of the float64 inverse, with normalized keys and with keys of norm 4.)
    """
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
def fixed_sequence(i_n, T, BT: tl.constexpr):
    """``(bos, eos, c0)`` (int64) of sequence ``i_n`` of a fixed-length batch: its token
    range and its first flat chunk."""
    bos = i_n.to(tl.int64) * T
    return bos, bos + T, i_n.to(tl.int64) * tl.cdiv(T, BT)


@triton.jit
def fixed_chunk(i_c, T, BT: tl.constexpr):
    """``(t0, eos)`` (int64) of flat chunk ``i_c`` of a fixed-length batch: its first
    token and its sequence's end."""
    nt = tl.cdiv(T, BT)
    bos = (i_c // nt).to(tl.int64) * T
    return bos + (i_c % nt).to(tl.int64) * BT, bos + T


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
