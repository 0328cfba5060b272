"""Shared pieces of the two-key, per-key-decay chunked kernels (KDA and Diag-KDN memory).

The recurrence, per value head, with state ``S [K, V]``::

    S_t = (I - w_t k_t^T) diag(exp(c_t)) S_{t-1} + w_t v_t^T,   o_t = scale * S_t^T q_t

Chunks hold ``BT = 64`` tokens split into four sub-blocks of ``BC = 16``. Inside a
chunk the pair weights ``exp(c_t - c_s)`` (``s <= t``, ``c`` the in-chunk
cumulative log decay per key channel) enter tensor-core products only as
factored operands, never as ``exp(+large)``:

* between sub-blocks ``j < i`` the factors are taken about a token ``b`` between
  them (the first token of block ``i``, for all earlier blocks at once; in the
  backward's column terms of block ``j``, its last token, for all later blocks at
  once): ``exp(c_t - c_b) <= 1`` and
  ``exp(c_b - c_s) <= 1`` for any decay (no bound needed);
* inside a sub-block of the forward's pairs kernel each half of 8 tokens uses
  its 4th token ``r`` as the reference: the largest exponent is ``4 * max|g|``
  (3 tokens on the row side, 4 on the column side). The backward's rows kernel
  takes the whole sub-block about its 8th token ``m`` in one pass (half the
  products of halves) where every ``|c_t - c_m|`` there is at most
  ``WHOLE_BLOCK_SPAN = 60``, else each quarter of 4 tokens about its 2nd token
  (largest exponent ``2 * max|g|``), in a loop: unrolled, the fallback sets the
  whole kernel's registers (250 against 168 as a loop, sm_90, Triton 3.6) and the
  backward takes 1.2x its time even where no block takes it. The test is per
  program and key slice, on the loaded ``c``. The one pass makes the whole
  backward 0.991x its time in halves at 8x4096x16 (H200); in the forward it makes
  the whole forward 1.034x slower, so the forward keeps halves.

A factor up to ``e^X`` leaves room for product operands up to ``e^(88.7 - X)``
before float32 (``3.4e38``) overflows. The backward's operands are gradients of
any size (``dA``, ``dR``), hence exponents of at most 60 there (``2.5e12`` of
room; halves' 80 would leave ``6e3``, which gradients at the bound exceed: inf
``dq``, NaN ``dg``). The forward's are the keys: at 80, ``|k|``,
``|w|`` up to ``6e3`` (KDA's keys are L2-normalized in practice).

Bound relied on: every per-token log decay ``g >= LOG_DECAY_BOUND = -20``
(``4 * 20 = 80 < 88.7``, the float32 exponent limit). Beyond about ``-22`` per
token the diagonal blocks overflow, so the kernels floor ``g`` themselves at a
``log_decay_floor >= LOG_DECAY_BOUND`` as they load it (KDA: the bound; Diag-KDN:
its memory floor ``log(1e-6) = -13.8``) and the backward gives zero ``dg`` where
``g`` sits below the floor (the floor's gradient); a NaN gate stays NaN. All chunk
algebra runs in float32. Products take the kernels' ``DOT_PREC``
(:func:`~kdn_compile.lowering._launch.dot_precision`): with bf16/fp16 inputs their
operands are the input dtype or tf32 (tensor cores); with fp32 inputs every
product is exact fp32 (``"ieee"``, no tf32). ``T = (I + A)^-1`` is
formed in exact fp32 for every dtype.

Sequences: every kernel reads the sequence bounds on the device (fixed-length batches as
bounds ``0, T, 2T, ...``). Chunks are numbered globally, as for GDN: a per-chunk kernel
reads its chunk's row of ``spans`` (first token, sequence end, sequence) and a
per-sequence kernel its sequence's first chunk in ``offsets``; both are built with device
ops (:func:`chunk_table`, from :mod:`._launch`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from ._launch import chunk_offsets, chunk_spans, sm_count, uncovered_inputs

BT = 64  # tokens per chunk (the only supported chunk size)
BC = 16  # sub-block of the intra-chunk algebra (smallest tensor-core tile)
LOG_DECAY_BOUND = -20.0
WHOLE_BLOCK_SPAN = tl.constexpr(60.0)  # see the module docstring

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def tokens_major(t: torch.Tensor) -> torch.Tensor:
    """``[B, T, H, D]`` as a contiguous token-major ``[B * T, H, D]`` (what the kernels index)."""
    return t.reshape(-1, t.shape[-2], t.shape[-1]).contiguous()


def check_decay_floor(log_decay_floor: float) -> float:
    """``log_decay_floor`` as a float; ValueError unless a real number (not a bool) with
    ``LOG_DECAY_BOUND <= floor <= 0``."""
    try:
        floor = float(log_decay_floor)
    except (TypeError, ValueError, RuntimeError):
        floor = float("nan")
    if isinstance(log_decay_floor, bool) or not LOG_DECAY_BOUND <= floor <= 0.0:
        raise ValueError(
            f"log_decay_floor: expected a float in [{LOG_DECAY_BOUND}, 0] (the kernels' "
            f"bound), got {log_decay_floor!r}")
    return floor


def require_two_key_kernels(q: torch.Tensor, v: torch.Tensor, chunk_size: int) -> None:
    """Raise ValueError unless :func:`two_key_kernel_supports` covers these inputs."""
    if not two_key_kernel_supports(q, v, chunk_size=chunk_size):
        raise uncovered_inputs("two-key Triton", "two_key_kernel_supports", chunk_size, q, v)


def two_key_kernel_supports(
    q: torch.Tensor, v: torch.Tensor, *, chunk_size: int
) -> bool:
    """Whether the Triton kernels handle these inputs (else use the reference).

    Needs CUDA (or the Triton interpreter on CPU), ``chunk_size == 64``,
    fp16/bf16/fp32 inputs and key and value head sizes that were checked against
    the float64 reference on the H200 (Triton 3.6): 64 or 128 for half inputs,
    powers of two in ``[16, 128]`` for float32. Other half sizes are untested: the
    GDN kernels, with the same tile shapes, need launch configurations of their own
    there (see :func:`~kdn_compile.lowering.chunk_gdn_fwd.recurrence_config`).
    Reads shapes and dtypes only.
    """
    sizes = (16, 32, 64, 128) if q.dtype == torch.float32 else (64, 128)
    return (
        chunk_size == BT
        and q.dtype in _DTYPES
        and v.dtype == q.dtype
        and q.shape[-1] in sizes
        and v.shape[-1] in sizes
    )


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of stored intermediates and state-product operands."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32


def sequence_bounds(
    batch: int, length: int, cu_seqlens: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens as int32 on the device, N)``; fixed-length batches become packed.

    Raises:
        ValueError: ``cu_seqlens`` with a batch size other than 1.
    """
    if cu_seqlens is not None and batch != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1, got B = {batch}")
    if cu_seqlens is None:
        bounds = torch.arange(batch + 1, device=device, dtype=torch.int32) * length
        return bounds, batch
    return cu_seqlens.to(torch.int32), cu_seqlens.shape[0] - 1


def state_launch(wide: dict, narrow: dict, value_dim: int, seq_heads, device, *,
                 dtype: torch.dtype | None = None) -> dict:
    """Launch configuration of a sequential state pass, whose grid is sequences x value
    heads x value tiles: ``wide``, or ``narrow`` (narrower value tiles, so more
    programs) where ``wide``'s tiles would leave fewer than two programs per
    multiprocessor (as the GDN state passes narrow theirs). A symbolic ``seq_heads``
    (a dynamic batch or sequence count under ``torch.compile`` / ``torch.export``)
    takes ``wide``: no guard on it. With ``dtype`` float32 (the compute dtype) the
    choice comes back with one pipeline stage: two stages of float32 tiles need up to
    311 KB of shared memory (the backward pass at K = V = 256; sm_90 has 227 KB).

    At K = V = 128 on an H200 (132 multiprocessors) 8x4096x16 keeps ``wide`` (512
    programs at 32-wide tiles) and 1x32768x16 takes ``narrow`` (128 programs at 16
    against 64 at 32).
    """
    chosen = wide
    if is_concrete_int(seq_heads):  # also a SymInt of known value, as AOTAutograd sees it
        programs = int(seq_heads) * triton.cdiv(value_dim, min(wide["BV"], value_dim))
        if programs < 2 * sm_count(device):
            chosen = narrow
    return {**chosen, "num_stages": 1} if dtype == torch.float32 else chosen


def chunk_table(bounds: torch.Tensor, num_chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(spans [num_chunks + 1, 3], offsets [N + 1])`` int32 of :func:`~._launch.chunk_spans`
    and :func:`~._launch.chunk_offsets`, built on the device from the sequence bounds.

    The spare last row of ``spans`` (a surplus chunk) keeps its first size above 1 for
    every length: ``kdn::chunk_kda`` returns it, and a dimension that may be 1 makes
    ``torch.export`` guard on the sequence length (a contiguity check on the op's outputs).
    """
    offsets = chunk_offsets(bounds, BT)
    return chunk_spans(bounds, offsets, num_chunks + 1, BT), offsets


@triton.jit
def load_tile(ptr, t, o_r, m_r, i_h, o_d, H: tl.constexpr, D: tl.constexpr):
    """Rows ``t + o_r`` (valid where ``m_r``, zeros elsewhere), columns ``o_d`` of head
    ``i_h`` of a token-major ``[tokens, H, D]`` tensor, as float32.

    ``t`` is a scalar (64-bit offsets), ``o_r`` small relative rows (32-bit offsets).
    """
    p = ptr + (t.to(tl.int64) * H + i_h) * D + (o_r[:, None] * (H * D) + o_d[None, :])
    return tl.load(p, mask=m_r[:, None], other=0.0).to(tl.float32)


@triton.jit
def load_write_key(w, k, beta, t, o_r, m_r, i_h, i_hk, o_d, Hk: tl.constexpr, Hv: tl.constexpr,
                   K: tl.constexpr, HAS_BETA: tl.constexpr):
    """Rows ``t + o_r``, columns ``o_d`` of value head ``i_h``'s write key as float32:
    ``beta k`` formed here with ``HAS_BETA`` (KDA; ``k`` of key head ``i_hk``,
    ``beta [tokens, Hv]``), else ``w`` as stored."""
    if HAS_BETA:
        p_b = (t + o_r).to(tl.int64) * Hv + i_h
        b_beta = tl.load(beta + p_b, mask=m_r, other=0.0).to(tl.float32)
        return load_tile(k, t, o_r, m_r, i_hk, o_d, Hk, K) * b_beta[:, None]
    else:
        return load_tile(w, t, o_r, m_r, i_h, o_d, Hv, K)


def write_key_args(w, beta, kf: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The write key's kernel arguments ``(w, beta)``, token-major: exactly one of ``w``
    (``[B, T, Hv, K]``) and ``beta`` (``[B, T, Hv]``, KDA's ``w = beta k``) is given;
    the other slot gets ``kf`` (``k`` already token-major, :func:`tokens_major`; unread).

    Raises:
        ValueError: both or neither given, or a ``beta`` not a float ``[B, T, Hv]``.
    """
    if (w is None) == (beta is None):
        raise ValueError("w, beta: give exactly one (w for any write key, beta for KDA's "
                         f"w = beta k), got {type(w).__name__} and {type(beta).__name__}")
    tokens, hv = v.shape[0] * v.shape[1], v.shape[2]
    if beta is None:
        return tokens_major(w), kf
    if beta.shape != v.shape[:3] or not beta.is_floating_point():
        raise ValueError(f"beta: expected a float tensor of shape {tuple(v.shape[:3])} "
                         f"([B, T, Hv]), got {beta.dtype} of shape {tuple(beta.shape)}")
    return kf, beta.reshape(tokens, hv).contiguous()


@triton.jit
def load_rows(ptr, t, o_r, m_r, i_h, H: tl.constexpr, D: tl.constexpr):
    """:func:`load_tile` of every column."""
    return load_tile(ptr, t, o_r, m_r, i_h, tl.arange(0, D), H, D)


@triton.jit
def load_row(ptr, t, end, i_h, H: tl.constexpr, D: tl.constexpr):
    """Row ``t`` ``[D]`` as float32, zeros unless ``t < end``."""
    o_d = tl.arange(0, D)
    m = (o_d * 0 + t) < end
    return tl.load(ptr + (t.to(tl.int64) * H + i_h) * D + o_d, mask=m, other=0.0).to(tl.float32)


@triton.jit
def store_tile(ptr, value, t, o_r, m_r, i_h, o_d, H: tl.constexpr, D: tl.constexpr):
    """Store ``value`` where :func:`load_tile` reads (rows ``m_r`` only)."""
    p = ptr + (t.to(tl.int64) * H + i_h) * D + (o_r[:, None] * (H * D) + o_d[None, :])
    tl.store(p, value.to(ptr.dtype.element_ty), mask=m_r[:, None])


@triton.jit
def store_rows(ptr, value, t, o_r, m_r, i_h, H: tl.constexpr, D: tl.constexpr):
    """:func:`store_tile` of every column."""
    store_tile(ptr, value, t, o_r, m_r, i_h, tl.arange(0, D), H, D)


@triton.jit
def load_block(ptr, t, m_r, i_h, col0, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """``[BC, BC]`` block of a ``[tokens, H, BT]`` chunk matrix: rows ``t + .``, cols ``col0 + .``."""
    o_c = tl.arange(0, BC)
    p = ptr + (t.to(tl.int64) * H + i_h) * BT + col0 + (o_c[:, None] * (H * BT) + o_c[None, :])
    return tl.load(p, mask=m_r[:, None], other=0.0)


@triton.jit
def store_block(ptr, value, t, m_r, i_h, col0, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    o_c = tl.arange(0, BC)
    p = ptr + (t.to(tl.int64) * H + i_h) * BT + col0 + (o_c[:, None] * (H * BT) + o_c[None, :])
    tl.store(p, value.to(ptr.dtype.element_ty), mask=m_r[:, None])
