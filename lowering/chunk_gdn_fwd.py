"""Forward of chunked Gated DeltaNet in Triton: two launches.

Per chunk of ``BT = 64`` tokens and value head, with ``G`` the in-chunk
cumulative gate, ``A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j)`` (``j < i``)
and ``Ai = (I + A)^-1`` (the WY form of
:func:`kdn_compile.reference.chunk_gdn_reference`):

1. ``_chunk_gdn_prepare_kernel`` (one program per chunk and value head): ``G``,
   ``M = (q k^T) * exp(G_i - G_j)`` (``j <= i``) and ``Ai``. An ``Ai`` stored in half
   precision is inverted as one tile in registers with TF32 products
   (:func:`~._tiles.inv_unit_lower_tile`: ten ``64 x 64`` products, whose roundings the
   half-precision store hides, see :func:`~._launch.inverse_precision`). A float32 ``Ai``
   takes exact products on ``16 x 16`` blocks, through a float32 scratch buffer: diagonal
   blocks inverted by products of powers (:func:`inv_unit_lower`), joined by block
   products.
2. ``_chunk_gdn_fwd_kernel`` (one program per sequence, value head and tile of
   ``BV`` value columns, walking the chunks in order with the state in
   registers): ``delta = Ai (beta (v - (e^G k) S))``,
   ``o = scale ((e^G q) S + M delta)``,
   ``S <- e^{G_last} S + (e^{G_last - G} k)^T delta``. ``W`` and ``U`` are never
   written: ``Ai`` is applied in the loop. With ``RECOMPUTE`` (the backward) it
   writes each chunk's start state instead of ``o``, and ``delta`` where ``o`` would go
   when that buffer is given. With ``STATE_QDQ`` (FP8 state
   quantization) a program holds one whole ``[K, block_v]`` scale tile, quantizes the
   initial state and each chunk's final state (:mod:`.fp8`) and, where asked (the backward's
   recomputation, the ``w_quantizer`` path's forward), saves each chunk's start state as
   float8 values and a scale, exactly the state it used. With ``WY`` (the
   ``w_quantizer`` path, :mod:`.chunk_gdn_wy`) ``W`` and ``U`` are given:
   ``delta = U - W S``.

The forward returns ``G``, ``Ai``, ``M`` beside ``o`` and the final state; the backward
takes them (``prepared``), or runs the prepare kernel itself when they are not given, and
runs the recurrence again for the chunk start states (under ``STATE_QDQ`` the forward's
float8 states bit for bit; only the ``w_quantizer`` path's forward keeps its float8
states for its backward).

Gates: each ``g`` is floored at ``GDN_GATE_FLOOR = -128`` as it is loaded (a NaN
gate stays NaN), as the reference does: any decay through a floored gate is zero in
float32 anyway, and the floor bounds ``|G| <= 64 * 128``. ``G`` is summed and kept in
float64, and every decay is ``exp`` of a float64 difference rounded to float32: a
float32 ``G`` past a hard reset (``g = -1e4``) would keep too few digits for the
differences of the tokens after it (relative errors of ``1e-2`` at ``g = -1e5``); in
float64 every finite ``g <= 0`` stays within float32 rounding of the float64
reference. The backward gives zero ``dg`` below the floor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.library import wrap_triton

from kdn_compile.reference.delta_rule import GDN_GATE_FLOOR

from ._launch import (
    chunk_offsets,
    chunk_spans,
    dot_precision,
    fixed_chunk,
    fixed_sequence,
    inverse_precision,
    num_chunks_bound,
    sm_count,
    state_tile,
    uncovered_inputs,
)
from ._tiles import inv_dot, inv_unit_lower, inv_unit_lower_tile
from .fp8 import qdq_tile, soft_cast

__all__ = [
    "chunk_gdn_fwd", "gdn_kernel_covers", "gdn_kernel_supports", "gdn_layout", "gdn_prepare",
    "gdn_recompute_states", "qdq_tile_width", "recurrence_config", "require_gdn_kernels",
]

CHUNK = 64  # tokens per chunk: the kernels are written for 4 blocks of 16
_SUB = 16
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HEAD_DIMS = (16, 32, 64, 128, 256)
GATE_FLOOR = tl.constexpr(GDN_GATE_FLOOR)  # see the module docstring


def gdn_kernel_supports(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, *,
                        state_qdq=False, state_qdq_block_v=64) -> bool:
    """Whether the Triton GDN kernels cover these inputs (shapes and dtypes only).

    Covered: ``chunk_size == 64``; q, k, v in float16, bfloat16 or float32 (one
    dtype) with head sizes ``K``, ``V`` powers of two in ``[16, 256]`` (each
    size checked on the H200 against the float64 reference, forward and every
    gradient); ``g``/``beta`` floating and not
    float64; ``initial_state`` any floating dtype but float64; with ``state_qdq``, a
    ``state_qdq_block_v`` that :func:`qdq_tile_width` covers. Devices are the
    caller's concern. Reads no tensor values.
    """
    return v.dtype == q.dtype and gdn_kernel_covers(
        q, k, v.shape[-1], (g, beta, initial_state), chunk_size, state_qdq=state_qdq,
        state_qdq_block_v=state_qdq_block_v)


def gdn_kernel_covers(q, k, value_dim, others, chunk_size, *, state_qdq,
                      state_qdq_block_v) -> bool:
    """:func:`gdn_kernel_supports` for a ``v`` of q's dtype with ``V = value_dim``;
    ``others``: the gates and the initial state (None where absent). Reads shapes and
    dtypes only."""
    dims = (k.shape[-1], value_dim)
    if chunk_size != CHUNK or q.dtype not in _DTYPES or k.dtype != q.dtype:
        return False
    if not all(d in _HEAD_DIMS for d in dims):
        return False
    if state_qdq and qdq_tile_width(*dims, state_qdq_block_v, q.dtype) is None:
        return False
    return all(t.dtype in _DTYPES for t in others if t is not None)


def require_gdn_kernels(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size,
                        **qdq) -> None:
    """Raise ValueError unless :func:`gdn_kernel_supports` covers these inputs (``qdq``: its
    ``state_qdq`` and ``state_qdq_block_v``)."""
    if not gdn_kernel_supports(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, **qdq):
        raise uncovered_inputs("Triton GDN", "gdn_kernel_supports", chunk_size, q, v)


def gdn_layout(q, v, cu_seqlens):
    """``(B, T, N, Hk, Hv, K, V, number of chunks bound, chunk offsets, chunk spans)``
    (the last two None at fixed length; see :mod:`._launch`)."""
    batch, length, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    varlen = cu_seqlens is not None
    n = cu_seqlens.shape[0] - 1 if varlen else batch
    bound = num_chunks_bound(batch, length, n, CHUNK, varlen)
    offsets = chunk_offsets(cu_seqlens, CHUNK) if varlen else None
    spans = chunk_spans(cu_seqlens, offsets, bound, CHUNK) if varlen else None
    return batch, length, n, hk, hv, dk, dv, bound, offsets, spans


# (BV, num_stages, num_warps) of the plain GDN sequential passes at K = V = 128 in half
# precision, measured on an H100 (bf16, ms): with many programs (8x4096x16) the forward
# (64, 3, 4) 0.356 (32, 2, 4: 0.428; 64, 2, 4: 0.481), the recomputation (64, 2, 4) 0.311
# (64, 3, 4: 0.408), the state-gradient pass (64, 3, 8) 0.514 (64, 2, 4: 0.714); with fewer
# (4x4096x16) all three (32, 3, 4): forward 0.435, forward+backward 1.600 against 0.645 and
# 2.058 at (16, 3, 4); with few (1x32768x16) all three (16, 3, 4): 0.918 / 0.786 / 1.016
# against 1.020 / 0.930 / 1.132 at (32, 3, 4).
_WIDE = {"forward": (64, 3, 4), "recompute": (64, 2, 4), "state": (64, 3, 8)}
_MIDDLE = (32, 3, 4)
_NARROW = (16, 3, 4)


def recurrence_config(k_dim: int, v_dim: int, dtype: torch.dtype, seq_heads, device,
                      kernel: str | None = None) -> tuple[int, int, int]:
    """``(BV, num_stages, num_warps)`` of the sequential kernels (forward and backward state
    passes), whose grid is sequences x value heads x value tiles.

    ``kernel``: ``"forward"``, ``"recompute"`` (the backward's recurrence) or ``"state"``
    (the state-gradient pass) of the plain kernels; at ``K = V = 128`` in half precision
    these take the configurations measured for them: ``_WIDE`` where 64-wide value
    tiles give at least one program per multiprocessor (``seq_heads``: sequences x value
    heads; a symbolic count, as under ``torch.export``, counts as many), else ``_MIDDLE``
    (32-wide tiles, three stages, four warps) where 32-wide ones do, else ``_NARROW``
    (16-wide tiles, three stages, four warps).

    Else (other sizes, float32, and the FP8-QDQ and ``w_quantizer`` variants, ``kernel``
    None) narrow tiles buy parallelism when there are few sequences: the largest tile
    (at most 64, 32 for K = 256, 16 for float32 with K >= 128) that keeps two programs per
    multiprocessor. Two pipeline stages, except float32 with K >= 128 (one, to fit
    shared memory). Shared memory (ptxas, bf16, K = 128, two stages): 107 / 115 / 131 KB
    at BV 16 / 32 / 64; three stages at BV 64 overflow the 227 KB of sm_90 in the
    ``w_quantizer`` variants. With half inputs one stage is miscompiled by Triton 3.6 on
    Hopper (bf16 K = 256: wrong outputs at BV 16 and 32 with 4 or 8 warps, an illegal
    access at 8; fp16 K = 32, V = 16: wrong at 4 warps; bf16 K = 128: an illegal access
    at BV 32); two stages are right at every head size, and three at K = V = 128.
    """
    if kernel is not None and dtype != torch.float32 and k_dim == v_dim == 128:
        if not is_concrete_int(seq_heads):
            return _WIDE[kernel]
        sms = sm_count(device)
        if int(seq_heads) * (v_dim // 64) >= sms:
            return _WIDE[kernel]
        return _MIDDLE if int(seq_heads) * (v_dim // 32) >= sms else _NARROW
    row_bytes = k_dim * dtype.itemsize
    tile = min(v_dim, 64 if k_dim <= 128 else 32, 16 if row_bytes >= 512 else 64)
    while tile > 16 and seq_heads * (v_dim // tile) < 2 * sm_count(device):
        tile //= 2
    return tile, 1 if dtype == torch.float32 and k_dim >= 128 else 2, 4


# Bytes of a [K, BV] state tile (in the inputs' dtype) under QDQ: the largest tile the plain
# recurrences use with half inputs, K = 128 and BV = 64 (sm_90 cubin of Triton 3.9, bf16: 255
# registers a thread, no spills).
_QDQ_TILE_BYTES = 128 * 64 * 2


def qdq_tile_width(k_dim: int, v_dim: int, block_v: int, dtype: torch.dtype) -> int | None:
    """Value columns per program of the recurrence under state QDQ, or None where the
    kernels do not cover ``block_v``.

    A program holds one whole scale tile, ``[K, min(block_v, V)]``, so that its amax is
    local: covered when that width is a power of two from 16 (``tl.dot``) dividing ``V``
    and the tile is at most 16 KiB in ``dtype`` (half inputs: ``K = 128`` with the default
    64, ``K = 256`` up to 32; float32 inputs: half those widths).
    """
    width = min(block_v, v_dim)
    if width < 16 or width & (width - 1) or v_dim % width:
        return None
    return width if k_dim * width * dtype.itemsize <= _QDQ_TILE_BYTES else None


# -------------------------------------------------------------------------------------------
# 1. gates, (I + A)^-1 and the masked query-key products, one program per chunk and head


@triton.jit
def _rows(x, rows, eos, stride, D: tl.constexpr):
    """``[len(rows), D]`` tile of a row-major ``x`` (row stride ``stride``); zero past eos."""
    return tl.load(
        x + rows[:, None] * stride + tl.arange(0, D)[None, :],
        mask=(rows < eos)[:, None], other=0.0,
    )


@triton.jit
def _store_block(x, b_x, rows, eos, col, H: tl.constexpr, BT: tl.constexpr):
    """Rows ``rows`` (columns ``col .. col + BC``) of a ``[., H, BT]`` per-row matrix buffer."""
    o_c = col + tl.arange(0, b_x.shape[1])
    tl.store(x + rows[:, None] * (H * BT) + o_c[None, :], b_x.to(x.dtype.element_ty),
             mask=(rows < eos)[:, None])


@triton.jit
def _load_block(x, rows, eos, col, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    o_c = col + tl.arange(0, BC)
    return tl.load(x + rows[:, None] * (H * BT) + o_c[None, :], mask=(rows < eos)[:, None],
                   other=0.0)


@triton.jit
def _store_upper_zeros(x, r1, r2, r3, eos, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Zero the blocks above the diagonal, so readers load whole ``[BT, BT]`` rows."""
    b_z = tl.zeros([BC, BC], dtype=tl.float32)
    _store_block(x, b_z, r1, eos, BC, H, BT)
    _store_block(x, tl.zeros([BC, 2 * BC], dtype=tl.float32), r1, eos, 2 * BC, H, BT)
    _store_block(x, tl.zeros([BC, 2 * BC], dtype=tl.float32), r2, eos, 2 * BC, H, BT)
    _store_block(x, b_z, r3, eos, 3 * BC, H, BT)


@triton.jit
def _chunk_gdn_prepare_kernel(
    q, k, g, beta, gc, ai, aqk, scratch, spans, T,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, INV_PREC: tl.constexpr,
    WITH_M: tl.constexpr, WITH_AI: tl.constexpr, TILE_INV: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    if IS_VARLEN:  # index loads in the kernel body: see _launch.py
        t0 = tl.load(spans + 3 * i_c).to(tl.int64)
        eos = tl.load(spans + 3 * i_c + 1).to(tl.int64)
    else:
        t0, eos = fixed_chunk(i_c, T, BT)
    if t0 >= eos:
        return
    i_hk = i_h // (H // HK)
    o_t = tl.arange(0, BT)
    rows = t0 + o_t
    m_r = rows < eos
    # in-chunk cumulative gates in float64 (zero gate past the end), each gate floored with a
    # comparison, not tl.maximum, which would turn a NaN gate into the floor
    b_g = tl.load(g + rows * H + i_h, mask=m_r, other=0.0).to(tl.float32)
    b_gc = tl.cumsum(tl.where(b_g < GATE_FLOOR, GATE_FLOOR, b_g).to(tl.float64), 0)
    tl.store(gc + rows * H + i_h, b_gc, mask=m_r)
    b_beta = tl.load(beta + rows * H + i_h, mask=m_r, other=0.0).to(tl.float32)
    b_k = _rows(k + i_hk * K, rows, eos, HK * K, K)
    b_q = _rows(q + i_hk * K, rows, eos, HK * K, K)
    o_m = (rows[:, None] * H + i_h) * BT + o_t[None, :]
    # M = (q k^T) exp(G_i - G_j), j <= i
    m_lower = o_t[:, None] >= o_t[None, :]
    b_d = tl.exp(tl.where(m_lower, (b_gc[:, None] - b_gc[None, :]).to(tl.float32), float("-inf")))
    if WITH_M:
        b_m = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC) * b_d
        tl.store(aqk + o_m, b_m.to(aqk.dtype.element_ty), mask=m_r[:, None])
    if WITH_AI:
        # A = beta_i (k_i . k_j) exp(G_i - G_j), j < i, float32
        b_a = tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PREC) * b_d
        b_a = tl.where(o_t[:, None] > o_t[None, :], b_beta[:, None] * b_a, 0.0)
        if TILE_INV:  # half-precision Ai: the whole tile in registers, TF32 products
            b_ai = inv_unit_lower_tile(b_a, BC, INV_PREC)
            tl.store(ai + o_m, b_ai.to(ai.dtype.element_ty), mask=m_r[:, None])
        else:  # float32 Ai: exact products on 16 x 16 blocks, through the scratch buffer
            tl.store(scratch + o_m, b_a, mask=m_r[:, None])
            tl.debug_barrier()

            # (I + A)^-1 in 16 x 16 blocks: diagonal blocks by inv_unit_lower, then each block row
            # i as Ai_ij = -Ai_ii sum_l A_il Ai_lj, the sums taken column block by column block so
            # that each inverse block is dead after its last use (sm_90: 134 registers, 3 programs
            # per SM; the row-at-a-time order held all of them, 172 registers, 2 programs)
            scratch += i_h * BT
            ai += i_h * BT
            r1 = t0 + tl.arange(0, BC)
            r2 = r1 + BC
            r3 = r2 + BC
            r4 = r3 + BC
            b_i11 = inv_unit_lower(_load_block(scratch, r1, eos, 0, H, BT, BC), INV_PREC)
            _store_block(ai, b_i11, r1, eos, 0, H, BT)
            b_t1 = inv_dot(_load_block(scratch, r2, eos, 0, H, BT, BC), b_i11, INV_PREC)
            b_i22 = inv_unit_lower(_load_block(scratch, r2, eos, BC, H, BT, BC), INV_PREC)
            b_i21 = -inv_dot(b_i22, b_t1, INV_PREC)
            _store_block(ai, b_i21, r2, eos, 0, H, BT)
            _store_block(ai, b_i22, r2, eos, BC, H, BT)
            b_a31 = _load_block(scratch, r3, eos, 0, H, BT, BC)
            b_t1 = inv_dot(b_a31, b_i11, INV_PREC)
            b_a32 = _load_block(scratch, r3, eos, BC, H, BT, BC)
            b_t1 += inv_dot(b_a32, b_i21, INV_PREC)
            b_t2 = inv_dot(b_a32, b_i22, INV_PREC)
            b_i33 = inv_unit_lower(_load_block(scratch, r3, eos, 2 * BC, H, BT, BC), INV_PREC)
            b_i31 = -inv_dot(b_i33, b_t1, INV_PREC)
            b_i32 = -inv_dot(b_i33, b_t2, INV_PREC)
            _store_block(ai, b_i31, r3, eos, 0, H, BT)
            _store_block(ai, b_i32, r3, eos, BC, H, BT)
            _store_block(ai, b_i33, r3, eos, 2 * BC, H, BT)
            b_a41 = _load_block(scratch, r4, eos, 0, H, BT, BC)
            b_t1 = inv_dot(b_a41, b_i11, INV_PREC)
            b_a42 = _load_block(scratch, r4, eos, BC, H, BT, BC)
            b_t1 += inv_dot(b_a42, b_i21, INV_PREC)
            b_t2 = inv_dot(b_a42, b_i22, INV_PREC)
            b_a43 = _load_block(scratch, r4, eos, 2 * BC, H, BT, BC)
            b_t1 += inv_dot(b_a43, b_i31, INV_PREC)
            b_t2 += inv_dot(b_a43, b_i32, INV_PREC)
            b_t3 = inv_dot(b_a43, b_i33, INV_PREC)
            b_i44 = inv_unit_lower(_load_block(scratch, r4, eos, 3 * BC, H, BT, BC), INV_PREC)
            _store_block(ai, -inv_dot(b_i44, b_t1, INV_PREC), r4, eos, 0, H, BT)
            _store_block(ai, -inv_dot(b_i44, b_t2, INV_PREC), r4, eos, BC, H, BT)
            _store_block(ai, -inv_dot(b_i44, b_t3, INV_PREC), r4, eos, 2 * BC, H, BT)
            _store_block(ai, b_i44, r4, eos, 3 * BC, H, BT)
            _store_upper_zeros(ai, r1, r2, r3, eos, H, BT, BC)


# -------------------------------------------------------------------------------------------
# 2. the recurrence over chunks, state in registers


@triton.jit
def _qdq_state(b_h, hs, hs_scales, chunk, remaining, i_h, i_v, H: tl.constexpr,
               K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, SOFT_CAST: tl.constexpr):
    """E4M3 QDQ of the state tile ``[K, BV]`` (one scale tile), saved as the start state of
    flat chunk ``chunk`` (float8 values, float32 scale) when tokens ``remaining`` follow."""
    b_h, b_values, b_s = qdq_tile(b_h, SOFT_CAST)
    if hs is not None:
        if remaining > 0:
            p_s = hs + (chunk * H + i_h) * K * V
            tl.store(p_s + tl.arange(0, K)[:, None] * V + i_v * BV + tl.arange(0, BV)[None, :],
                     b_values)
            tl.store(hs_scales + (chunk * H + i_h) * (V // BV) + i_v, b_s)
    return b_h


@triton.jit
def _chunk_gdn_fwd_kernel(
    q, k, v, gc, beta, ai, aqk, w, o, h0, ht, hs, hs_scales, cu_seqlens, offsets, scale, T,
    cp, cp_every, cp_count,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, RECOMPUTE: tl.constexpr,
    STATE_V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
    STATE_QDQ: tl.constexpr, SOFT_CAST: tl.constexpr, WY: tl.constexpr,
    CHECKPOINTS: tl.constexpr,
):
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    # a head's value tiles on adjacent programs, so that they run in the same wave and
    # share their reads of q, k, Ai and M through L2
    i_nh, i_v = tl.program_id(0) // (V // BV), tl.program_id(0) % (V // BV)
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HK)
    if IS_VARLEN:  # index loads in the kernel body: see _launch.py
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        c0 = tl.load(offsets + i_n).to(tl.int64)
    else:
        bos, eos, c0 = fixed_sequence(i_n, T, BT)
    dt = k.dtype.element_ty
    b_h = tl.zeros([K, BV], dtype=tl.float32)
    if HAS_H0:
        b_h += tl.load(h0 + i_nh.to(tl.int64) * K * V
                       + state_tile(i_v, K, V, BV, STATE_V_FIRST)).to(tl.float32)
    if STATE_QDQ:  # the initial state, then each chunk's final state
        b_h = _qdq_state(b_h, hs, hs_scales, c0, eos - bos, i_h, i_v, H, K, V, BV, SOFT_CAST)
    o_t = tl.arange(0, BT)
    q += (bos * HK + i_hk) * K
    k += (bos * HK + i_hk) * K
    v += (bos * H + i_h) * V
    gc += bos * H + i_h
    if WY:
        w += (bos * H + i_h) * K
    else:
        beta += bos * H + i_h
        ai += (bos * H + i_h) * BT
    if not RECOMPUTE:
        aqk += (bos * H + i_h) * BT
    length = eos - bos
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    for i_t in range(0, tl.cdiv(length, BT)):
        if RECOMPUTE and not STATE_QDQ:  # (with STATE_QDQ, _qdq_state saves them)
            p_hs = hs + ((c0 + i_t) * H + i_h) * K * V
            tl.store(p_hs + o_k[:, None] * V + o_v[None, :], b_h.to(hs.dtype.element_ty))
        rows = i_t * BT + o_t
        m_r = (rows < length)[:, None]
        last = tl.minimum(i_t * BT + BT, length) - 1
        b_k = tl.load(k + rows[:, None] * (HK * K) + o_k[None, :], mask=m_r, other=0.0)
        b_v = tl.load(v + rows[:, None] * (H * V) + o_v[None, :], mask=m_r, other=0.0)
        b_gc = tl.load(gc + tl.minimum(rows, last) * H)  # float64
        b_gl = tl.load(gc + last * H)
        b_el = tl.exp((b_gl - b_gc).to(tl.float32))
        b_gc = b_gc.to(tl.float32)
        b_hc = b_h.to(dt)
        if WY:  # delta = U - W S: W and U given (v holds U)
            b_w = tl.load(w + rows[:, None] * (H * K) + o_k[None, :], mask=m_r, other=0.0)
            b_d = b_v.to(tl.float32) - tl.dot(b_w.to(dt), b_hc, input_precision=DOT_PREC)
        else:  # delta = Ai (beta (v - e^G (k S)))
            b_ai = tl.load(ai + rows[:, None] * (H * BT) + o_t[None, :], mask=m_r, other=0.0)
            b_beta = tl.load(beta + rows * H, mask=rows < length, other=0.0).to(tl.float32)
            b_ks = tl.dot(b_k, b_hc, input_precision=DOT_PREC)
            b_x = b_beta[:, None] * (b_v.to(tl.float32) - tl.exp(b_gc)[:, None] * b_ks)
            b_d = tl.dot(b_ai, b_x.to(dt), input_precision=DOT_PREC)
        if RECOMPUTE:
            if o is not None:  # delta, for the backward's grad kernel
                tl.store(o + (bos * H + i_h) * V + rows[:, None] * (H * V) + o_v[None, :],
                         b_d.to(o.dtype.element_ty), mask=m_r)
        else:
            b_q = tl.load(q + rows[:, None] * (HK * K) + o_k[None, :], mask=m_r, other=0.0)
            b_m = tl.load(aqk + rows[:, None] * (H * BT) + o_t[None, :], mask=m_r, other=0.0)
            b_o = tl.exp(b_gc)[:, None] * tl.dot(b_q, b_hc, input_precision=DOT_PREC)
            b_o += tl.dot(b_m, b_d.to(dt), input_precision=DOT_PREC)
            tl.store(o + (bos * H + i_h) * V + rows[:, None] * (H * V) + o_v[None, :],
                     (scale * b_o).to(o.dtype.element_ty), mask=m_r)
        # S <- e^{G_last} S + k^T (e^{G_last - G} delta)
        b_dl = (b_el[:, None] * b_d).to(dt)
        b_h = b_h * tl.exp(b_gl.to(tl.float32)) + tl.dot(tl.trans(b_k), b_dl, input_precision=DOT_PREC)
        if STATE_QDQ:
            b_h = _qdq_state(b_h, hs, hs_scales, c0 + i_t + 1, length - (i_t + 1) * BT, i_h,
                             i_v, H, K, V, BV, SOFT_CAST)
        if CHECKPOINTS:  # the state after every cp_every whole chunks: cp [N, C, H, K, V]
            # a predicated store, not a branch: the pipelined loop stays one block
            i_c = (i_t + 1) // cp_every - 1
            keep = ((i_t + 1) % cp_every == 0) & (i_c < cp_count) & ((i_t + 1) * BT <= length)
            p_cp = cp + ((i_n.to(tl.int64) * cp_count + tl.maximum(i_c, 0)) * H + i_h) * K * V
            p_tile = o_k[:, None] * V + o_v[None, :]  # (below K * V: all kept, or none)
            tl.store(p_cp + p_tile, b_h, mask=p_tile < tl.where(keep, K * V, 0))
    if not RECOMPUTE:
        tl.store(ht + i_nh.to(tl.int64) * K * V + state_tile(i_v, K, V, BV, STATE_V_FIRST), b_h)


def tile_inverse(dtype: torch.dtype) -> bool:
    """Whether the prepare kernel inverts a chunk's ``I + A`` as one tile in registers
    (:func:`~._tiles.inv_unit_lower_tile`, TF32 products), for ``Ai`` stored in ``dtype``:
    half precision; a float32 ``Ai`` takes exact products on 16 x 16 blocks instead."""
    return dtype != torch.float32


def gdn_prepare(q, k, g, beta, cu_seqlens, layout, *, with_m=True, with_ai=True):
    """Launch the prepare kernel: ``(G, Ai, M)``; ``G`` float64 ``[B, T, Hv]``, ``Ai`` and
    ``M`` ``[B, T, Hv, 64]`` in ``k``'s dtype (row ``t`` of its chunk's matrix). Without
    ``with_m`` (``q`` unused) or ``with_ai`` (``beta`` may be None) that one is None."""
    batch, length, n, hk, hv, dk, _, bound, _, spans = layout
    gc = torch.empty(g.shape, dtype=torch.float64, device=g.device)
    ai = k.new_empty((batch, length, hv, CHUNK)) if with_ai else None
    aqk = k.new_empty((batch, length, hv, CHUNK)) if with_m else None
    tile_inv = with_ai and tile_inverse(ai.dtype)
    scratch = (torch.empty((batch, length, hv, CHUNK), dtype=torch.float32, device=k.device)
               if with_ai and not tile_inv else None)
    wrap_triton(_chunk_gdn_prepare_kernel)[(bound, hv)](
        k if q is None else q, k, g, g if beta is None else beta,  # (read, unused)
        gc, ai, aqk, scratch, spans, length,
        H=hv, HK=hk, K=dk, BT=CHUNK, BC=_SUB,
        IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision(k.dtype),
        INV_PREC=inverse_precision(ai.dtype if with_ai else k.dtype),
        WITH_M=with_m, WITH_AI=with_ai, TILE_INV=tile_inv, num_warps=4,
    )
    return gc, ai, aqk


def _recurrence(q, k, v, gc, beta, ai, aqk, initial_state, cu_seqlens, layout, *,
                scale, state_v_first, recompute, qdq_block_v=0, w=None, deltas=False,
                keep_states=False, checkpoints=None, checkpoint_chunks=0):
    """The recurrence kernel: ``(o, ht, hs, hs_scales)``. ``recompute``: no ``ht``, the start
    state of every chunk in ``hs`` and, with ``deltas``, ``delta`` (like ``v``, in ``k``'s
    dtype) in place of ``o`` (else None). ``qdq_block_v > 0``: state QDQ, one program
    per scale tile, and ``hs`` float8 with its ``hs_scales`` (in the forward only with
    ``keep_states``; else both None there). ``w``: the WY operands given, ``W`` and ``U``
    in ``v`` (``beta``, ``ai`` unused). ``checkpoints``: float32 ``[N, C, Hv, K, V]``
    receiving the state after every ``checkpoint_chunks`` whole chunks of each sequence
    (the first ``C``; those past a sequence's end are not written)."""
    batch, length, n, hk, hv, dk, dv, bound, offsets, _ = layout
    plain = not qdq_block_v and w is None
    tile, stages, warps = recurrence_config(
        dk, dv, k.dtype, n * hv, v.device,
        ("recompute" if recompute else "forward") if plain else None)
    if qdq_block_v:
        tile = qdq_tile_width(dk, dv, qdq_block_v, k.dtype)
    shape = (n, hv, dv, dk) if state_v_first else (n, hv, dk, dv)
    o = ht = hs = hs_scales = None
    if not recompute:
        o = torch.empty(v.shape, dtype=q.dtype, device=v.device)
        ht = torch.empty(shape, dtype=torch.float32, device=v.device)
    elif deltas:
        o = torch.empty(v.shape, dtype=k.dtype, device=v.device)
    if qdq_block_v and (recompute or keep_states):
        hs = torch.empty((bound, hv, dk, dv), dtype=torch.float8_e4m3fn, device=v.device)
        hs_scales = torch.empty((bound, hv, dv // tile), dtype=torch.float32, device=v.device)
    elif recompute and not qdq_block_v:
        hs = k.new_empty((bound, hv, dk, dv))
    wrap_triton(_chunk_gdn_fwd_kernel)[(n * hv * (dv // tile),)](
        q, k, v, gc, beta, ai, aqk, w, o, initial_state, ht, hs, hs_scales, cu_seqlens, offsets,
        scale, length, checkpoints, max(checkpoint_chunks, 1),
        0 if checkpoints is None else checkpoints.shape[1],
        H=hv, HK=hk, K=dk, V=dv, BT=CHUNK, BV=tile,
        HAS_H0=initial_state is not None, RECOMPUTE=recompute,
        STATE_V_FIRST=state_v_first, IS_VARLEN=cu_seqlens is not None,
        DOT_PREC=dot_precision(k.dtype), STATE_QDQ=bool(qdq_block_v), SOFT_CAST=soft_cast(),
        WY=w is not None, CHECKPOINTS=checkpoints is not None, num_warps=warps,
        num_stages=stages,
    )
    return o, ht, hs, hs_scales


def _scale(scale, q):
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def chunk_gdn_fwd(q, k, v, g, beta, initial_state, cu_seqlens, *, chunk_size, scale,
                  state_v_first, state_qdq=False, state_qdq_block_v=64, checkpoints=None,
                  checkpoint_every=0):
    """Chunked GDN forward on the GPU (or under ``TRITON_INTERPRET=1``).

    Args:
        q, k: ``[B, T, Hk, K]``; v: ``[B, T, Hv, V]`` (one dtype among float16,
            bfloat16, float32); g: natural-log decays ``[B, T, Hv]``; beta:
            ``[B, T, Hv]``.
        initial_state: ``[N, Hv, K, V]`` (``[N, Hv, V, K]`` with
            ``state_v_first``) or None for zeros.
        cu_seqlens: ``[N + 1]`` int32/int64 on the device, ``B == 1``; or None.
        chunk_size: must be 64 (see :func:`gdn_kernel_supports`).
        scale: output scale (None: ``K ** -0.5``).
        state_qdq: E4M3 fake quantization of the state (:mod:`.fp8`), one scale per
            ``[K, state_qdq_block_v]`` tile of the key-first state: the initial state,
            then each chunk's final state after that chunk's readout.
        checkpoints: float32 ``[N, C, Hv, K, V]`` (key-first whatever ``state_v_first``)
            or None: receives the state after every ``checkpoint_every`` tokens (a
            multiple of 64) of each sequence, checkpoint ``c`` after ``(c + 1) *
            checkpoint_every`` tokens; those past a sequence's end are left as they are.

    Raises:
        ValueError: inputs that :func:`gdn_kernel_supports` does not cover.

    Returns:
        ``(o, final_state, gc, ai, aqk)``: ``o`` like ``v``; ``final_state`` float32 in
        the layout of ``initial_state``; then what :func:`chunk_gdn_bwd` can take as
        ``prepared`` instead of launching kernels again: the in-chunk cumulative gates
        ``gc`` (float64 ``[B, T, Hv]``), ``Ai = (I + A)^-1`` and ``M`` (``[B, T, Hv, 64]``
        in ``k``'s dtype, row ``t`` of its chunk's matrix). No chunk state is kept: the
        backward recomputes them (with ``state_qdq``, the same float8 states bit for bit).

    Math: :func:`kdn_compile.reference.chunk_gdn_reference` (FLA's WY form).
    """
    require_gdn_kernels(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size,
                        state_qdq=state_qdq, state_qdq_block_v=state_qdq_block_v)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    layout = gdn_layout(q, v, cu_seqlens)
    gc, ai, aqk = gdn_prepare(q, k, g, beta, cu_seqlens, layout)
    o, ht, _, _ = _recurrence(
        q, k, v, gc, beta, ai, aqk, initial_state, cu_seqlens, layout,
        scale=_scale(scale, q), state_v_first=state_v_first, recompute=False,
        qdq_block_v=state_qdq_block_v if state_qdq else 0, checkpoints=checkpoints,
        checkpoint_chunks=checkpoint_every // CHUNK,
    )
    return o, ht, gc, ai, aqk


def gdn_recompute_states(k, v, gc, beta, ai, initial_state, cu_seqlens, layout, *,
                         state_v_first, qdq_block_v=0, w=None, deltas=False):
    """Start state of every chunk (backward): ``(hs, None, delta)``, ``hs [chunks bound, Hv,
    K, V]`` in ``k``'s dtype; with ``qdq_block_v > 0`` (state QDQ) float8 ``hs`` and its
    scales, bit for bit the states the forward quantized. ``delta`` (like ``v``, ``k``'s dtype)
    with ``deltas``, else None. ``w``: from the WY operands ``W`` and ``U`` (in ``v``;
    ``beta`` and ``ai`` None)."""
    o, _, hs, hs_scales = _recurrence(
        k, k, v, gc, beta, ai, None, initial_state, cu_seqlens, layout,
        scale=1.0, state_v_first=state_v_first, recompute=True, qdq_block_v=qdq_block_v, w=w,
        deltas=deltas,
    )
    return hs, hs_scales, o
