"""Forward of the two-key, per-key-decay chunked delta rule (KDA, Diag-KDN memory).

Four launches (see :mod:`two_key_common` for the decay factoring and its bound):

1. ``_two_key_fwd_decay_kernel`` (one program per chunk, 64-key slice and value head):
   the in-chunk cumulative log decay ``c`` of ``g`` floored at ``log_decay_floor``,
   and the decayed keys ``q e^c``, ``k e^c``, ``w e^{c_last - c}`` (all stored).
2. ``_two_key_fwd_pairs_kernel`` (one program per chunk, 16-row block and value
   head): that block's rows of the strictly lower
   ``A[t, s] = sum_i k_ti e^{c_ti - c_si} w_si`` (float32) and of the lower ``R``
   (``q`` in place of ``k``, diagonal included); the earlier blocks' columns in one
   product factored about the block's first row, the diagonal block in halves.
3. ``_two_key_fwd_solve_kernel`` (one program per chunk and value head):
   ``T = (I + A)^-1`` (stored).
4. ``_two_key_fwd_state_kernel`` (one program per sequence, value head and value
   tile, sequential over chunks): ``X = T (v - (k e^c) S)`` (``T`` applied in the
   pass: ``T k e^c`` and ``T v`` are never written), the output
   ``o = scale((q e^c) S + R X)`` from the chunk's start state ``S`` and ``X`` as stored
   (in the compute dtype), ``S <- e^{c_last} S + (w e^{c_last - c})^T X``; saves each
   chunk's start state and ``X`` for the backward.

Math source: the WY form of :func:`kdn_compile.reference.two_key_chunk_recurrence`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from kdn_compile.lowering._launch import dot_precision, num_chunks_bound
from kdn_compile.lowering._tiles import dot32, inv_unit_lower
from kdn_compile.lowering.two_key_common import (
    BC,
    BT,
    LOG_DECAY_BOUND,
    check_decay_floor,
    chunk_table,
    compute_dtype,
    load_block,
    load_row,
    load_rows,
    load_tile,
    load_write_key,
    require_two_key_kernels,
    sequence_bounds,
    state_launch,
    store_block,
    store_tile,
    tokens_major,
    write_key_args,
)


# Launch configurations: the pairs kernel (16-key slices, 2 warps: the whole forward
# 0.945x its time at 32 / 4 warps at 8x4096x16 and 1x32768x16, H200); the state pass for half
# inputs (32-wide value tiles: twice the programs of 64 for the sequential pass; with the
# output in the pass, ptxas sm_90 of Triton 3.9, bf16 K = V = 128: 212 registers and 132 KB
# of shared memory at BV=32, 4 warps, 2 stages, no spills; 255 registers and 48 bytes of
# spill at BV=64), and where that leaves fewer than two programs per multiprocessor 16-wide
# tiles with three stages (see state_launch; the whole forward 0.91x its time at two stages
# at 1x32768x16, H200, before the output joined the pass; float32 inputs take one stage).
PAIRS_LAUNCH = {"BK": 16, "num_warps": 2, "num_stages": 1}
STATE_LAUNCH = {"BV": 32, "num_warps": 4, "num_stages": 2}
STATE_LAUNCH_NARROW = {"BV": 16, "num_warps": 4, "num_stages": 3}


@triton.jit
def _row_of(b_x, r):
    """Row ``r`` (relative, may lie outside the tile: zeros) of a register tile, as a vector."""
    o_r = tl.arange(0, b_x.shape[0])
    return tl.sum(tl.where(o_r[:, None] == r, b_x, 0.0), 0)


@triton.jit
def _two_key_fwd_decay_kernel(
    q, k, w, beta, g, c, qd, kd, wl,
    spans, floor,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    HAS_BETA: tl.constexpr,
):
    """The in-chunk cumulative log decay ``c`` (of ``g`` floored at ``floor``) and ``q e^c``,
    ``k e^c``, ``w e^{c_last - c}`` of one chunk, key slice and value head."""
    floor = tl.cast(floor, tl.float32)  # Inductor passes Python floats as fp64
    i_c, i_k, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (Hv // Hk)
    # index loads in the kernel body, not a helper: see _launch.py on mutation analysis
    t0 = tl.load(spans + 3 * i_c).to(tl.int64)
    eos = tl.load(spans + 3 * i_c + 1).to(tl.int64)
    if t0 >= eos:  # a surplus chunk
        return
    o_t = tl.arange(0, BT)
    m_t = t0 + o_t < eos
    o_k = i_k * BK + tl.arange(0, BK)
    # rows past the sequence end load g = 0: c stays flat there, so its last row is c_last
    b_g = load_tile(g, t0, o_t, m_t, i_h, o_k, Hv, K)
    # floored with a comparison, not tl.maximum, which would turn a NaN gate into the floor
    b_c = tl.cumsum(tl.where(b_g < floor, floor, b_g), axis=0)
    b_e = tl.exp(b_c)
    store_tile(c, b_c, t0, o_t, m_t, i_h, o_k, Hv, K)
    store_tile(qd, load_tile(q, t0, o_t, m_t, i_hk, o_k, Hk, K) * b_e, t0, o_t, m_t, i_h, o_k, Hv, K)
    store_tile(kd, load_tile(k, t0, o_t, m_t, i_hk, o_k, Hk, K) * b_e, t0, o_t, m_t, i_h, o_k, Hv, K)
    b_el = tl.exp(_row_of(b_c, BT - 1)[None, :] - b_c)
    b_w = load_write_key(w, k, beta, t0, o_t, m_t, i_h, i_hk, o_k, Hk, Hv, K, HAS_BETA)
    store_tile(wl, b_w * b_el, t0, o_t, m_t, i_h, o_k, Hv, K)


@triton.jit
def _diag_half(b_k, b_q, b_w, b_c, b_cr, m_r, start, acc_a, acc_r, DOT_PREC: tl.constexpr):
    """Add a diagonal block's ``sum_k x_tk e^{c_tk - c_sk} w_sk`` (``x = k``, ``q``) over the
    half of its columns from ``start`` to ``acc_a``, ``acc_r`` (rows at or below
    ``start``; the caller masks the upper triangle).

    Factored about ``b_cr``, the ``c`` of the half's 4th row (clipped to the last valid
    one): exponents stay within ``4 * max|g|`` (:mod:`two_key_common`).
    """
    BC: tl.constexpr = b_c.shape[0]
    o_r = tl.arange(0, BC)
    row_ok = m_r & (o_r >= start)
    col_ok = row_ok & (o_r < start + BC // 2)
    b_f = tl.where(row_ok[:, None], tl.exp(b_c - b_cr[None, :]), 0.0)
    b_wt = tl.trans(tl.where(col_ok[:, None], b_w * tl.exp(b_cr[None, :] - b_c), 0.0))
    acc_a = tl.dot(b_k * b_f, b_wt, acc_a, input_precision=DOT_PREC)
    acc_r = tl.dot(b_q * b_f, b_wt, acc_r, input_precision=DOT_PREC)
    return acc_a, acc_r


@triton.jit
def _two_key_fwd_pairs_kernel(
    q, k, w, beta, c, ascr, rmat,
    spans,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, HAS_BETA: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    i_c, i_i, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (Hv // Hk)
    # index loads in the kernel body, not a helper: see _launch.py on mutation analysis
    t0 = tl.load(spans + 3 * i_c).to(tl.int64)
    eos = tl.load(spans + 3 * i_c + 1).to(tl.int64)
    if t0 >= eos:  # a surplus chunk
        return
    ti = t0 + i_i * BC
    if ti >= eos:
        return
    o_t = tl.arange(0, BT)
    m_j = (o_t < i_i * BC) & (t0 + o_t < eos)
    o_r = tl.arange(0, BC)
    m_r = ti + o_r < eos
    last = tl.minimum(ti + BC, eos) - 1
    # Row block i of A (strictly lower) and R (lower): the earlier blocks' columns in one
    # product, factored about block i's first row (both factors at most 1 for any
    # decay), and the diagonal block (see _diag_half).
    acc_a = tl.zeros([BC, BT], dtype=tl.float32)
    acc_r = tl.zeros([BC, BT], dtype=tl.float32)
    d_a = tl.zeros([BC, BC], dtype=tl.float32)
    d_r = tl.zeros([BC, BC], dtype=tl.float32)
    for i_k in range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_c = load_tile(c, ti, o_r, m_r, i_h, o_k, Hv, K)
        b_k = load_tile(k, ti, o_r, m_r, i_hk, o_k, Hk, K)
        b_q = load_tile(q, ti, o_r, m_r, i_hk, o_k, Hk, K)
        b_w = load_write_key(w, k, beta, ti, o_r, m_r, i_h, i_hk, o_k, Hk, Hv, K, HAS_BETA)
        # the diagonal block, one half of its columns at a time (a loop, not unrolled:
        # 128 registers against 154 at 32-key slices on 4 warps, sm_90)
        for half in range(2):
            start = half * (BC // 2)
            b_cr = tl.load(c + (tl.minimum(ti + start + BC // 4 - 1, last) * Hv + i_h) * K + o_k)
            d_a, d_r = _diag_half(b_k, b_q, b_w, b_c, b_cr, m_r, start, d_a, d_r, DOT_PREC)
        if i_i > 0:
            b_cf = tl.load(c + (ti * Hv + i_h) * K + o_k)
            b_f = tl.where(m_r[:, None], tl.exp(b_c - b_cf[None, :]), 0.0)
            b_ct = load_tile(c, t0, o_t, m_j, i_h, o_k, Hv, K)
            b_wt = load_write_key(w, k, beta, t0, o_t, m_j, i_h, i_hk, o_k, Hk, Hv, K, HAS_BETA)
            b_wt = tl.trans(tl.where(m_j[:, None], b_wt * tl.exp(b_cf[None, :] - b_ct), 0.0))
            acc_a = tl.dot(b_k * b_f, b_wt, acc_a, input_precision=DOT_PREC)
            acc_r = tl.dot(b_q * b_f, b_wt, acc_r, input_precision=DOT_PREC)
    below = o_r[:, None] > o_r[None, :]
    # the earlier blocks' columns and zeros right of the diagonal block; then that block
    m_off = (o_t < i_i * BC) | (o_t >= i_i * BC + BC)
    _store_row_block(ascr, acc_a, ti, m_r, i_h, m_off, Hv, BT, BC)
    _store_row_block(rmat, acc_r, ti, m_r, i_h, m_off, Hv, BT, BC)
    store_block(ascr, tl.where(below, d_a, 0.0), ti, m_r, i_h, i_i * BC, Hv, BT, BC)
    store_block(rmat, tl.where(below | (o_r[:, None] == o_r[None, :]), d_r, 0.0),
                ti, m_r, i_h, i_i * BC, Hv, BT, BC)


@triton.jit
def _store_row_block(ptr, acc, t, m_r, i_h, m_cols, H: tl.constexpr, BT: tl.constexpr,
                     BC: tl.constexpr):
    """Store the columns ``m_cols`` of a ``[BC, BT]`` row block of a chunk matrix."""
    o_r = tl.arange(0, BC)
    o_t = tl.arange(0, BT)
    p = ptr + (t.to(tl.int64) * H + i_h) * BT + (o_r[:, None] * (H * BT) + o_t[None, :])
    tl.store(p, acc.to(ptr.dtype.element_ty), mask=m_r[:, None] & m_cols[None, :])


@triton.jit
def _store_blocks(ptr, b0, b1, b2, b3, t, m_r, i_h, H: tl.constexpr, BT: tl.constexpr,
                  BC: tl.constexpr):
    """Store one row of four ``[BC, BC]`` blocks of a chunk matrix."""
    store_block(ptr, b0, t, m_r, i_h, 0, H, BT, BC)
    store_block(ptr, b1, t, m_r, i_h, BC, H, BT, BC)
    store_block(ptr, b2, t, m_r, i_h, 2 * BC, H, BT, BC)
    store_block(ptr, b3, t, m_r, i_h, 3 * BC, H, BT, BC)


@triton.jit
def _two_key_fwd_solve_kernel(
    ascr, tmat,
    spans,
    Hv: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    """``T = (I + A)^-1``, stored."""
    tl.static_assert(BT == 4 * BC)
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    # index loads in the kernel body, not a helper: see _launch.py on mutation analysis
    t0 = tl.load(spans + 3 * i_c).to(tl.int64)
    eos = tl.load(spans + 3 * i_c + 1).to(tl.int64)
    if t0 >= eos:  # a surplus chunk
        return
    t1, t2, t3 = t0 + BC, t0 + 2 * BC, t0 + 3 * BC
    o_r = tl.arange(0, BC)
    m_0, m_1, m_2, m_3 = t0 + o_r < eos, t1 + o_r < eos, t2 + o_r < eos, t3 + o_r < eos
    # diagonal blocks: nilpotent products; below them: block products (all exact fp32), each
    # block row i as T_ij = -T_ii sum_l A_il T_lj summed column block by column block, so that
    # each block dies after its last use (sm_90, 2 warps: 203 registers; row at a time 247)
    t00 = inv_unit_lower(load_block(ascr, t0, m_0, i_h, 0, Hv, BT, BC), "ieee")
    t11 = inv_unit_lower(load_block(ascr, t1, m_1, i_h, BC, Hv, BT, BC), "ieee")
    t22 = inv_unit_lower(load_block(ascr, t2, m_2, i_h, 2 * BC, Hv, BT, BC), "ieee")
    t33 = inv_unit_lower(load_block(ascr, t3, m_3, i_h, 3 * BC, Hv, BT, BC), "ieee")
    t10 = -dot32(t11, dot32(load_block(ascr, t1, m_1, i_h, 0, Hv, BT, BC), t00))
    a20 = load_block(ascr, t2, m_2, i_h, 0, Hv, BT, BC)
    x0 = dot32(a20, t00)
    a21 = load_block(ascr, t2, m_2, i_h, BC, Hv, BT, BC)
    x0 += dot32(a21, t10)
    x1 = dot32(a21, t11)
    t20 = -dot32(t22, x0)
    t21 = -dot32(t22, x1)
    a30 = load_block(ascr, t3, m_3, i_h, 0, Hv, BT, BC)
    x0 = dot32(a30, t00)
    a31 = load_block(ascr, t3, m_3, i_h, BC, Hv, BT, BC)
    x0 += dot32(a31, t10)
    x1 = dot32(a31, t11)
    a32 = load_block(ascr, t3, m_3, i_h, 2 * BC, Hv, BT, BC)
    x0 += dot32(a32, t20)
    x1 += dot32(a32, t21)
    x2 = dot32(a32, t22)
    t30 = -dot32(t33, x0)
    t31 = -dot32(t33, x1)
    t32 = -dot32(t33, x2)
    b_zero = tl.zeros([BC, BC], dtype=tl.float32)
    _store_blocks(tmat, t00, b_zero, b_zero, b_zero, t0, m_0, i_h, Hv, BT, BC)
    _store_blocks(tmat, t10, t11, b_zero, b_zero, t1, m_1, i_h, Hv, BT, BC)
    _store_blocks(tmat, t20, t21, t22, b_zero, t2, m_2, i_h, Hv, BT, BC)
    _store_blocks(tmat, t30, t31, t32, t33, t3, m_3, i_h, Hv, BT, BC)


@triton.jit
def _two_key_fwd_state_kernel(
    kd, v, tmat, wl, c, qd, rmat, h, x, o, h0, ht,
    cu_seqlens, offsets, s_k, s_v, scale, cp, cp_every, cp_count,
    Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, DOT_PREC: tl.constexpr,
    CHECKPOINTS: tl.constexpr,
):
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    # One flat grid axis (value tiles fastest): sequences x heads can exceed 65535, the
    # limit of CUDA's second grid axis.
    i_v, i_nh = tl.program_id(0) % (V // BV), tl.program_id(0) // (V // BV)
    i_n, i_h = i_nh // Hv, i_nh % Hv
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    # State slots: each sequence owns one per chunk start plus one for its end.
    slot = tl.load(offsets + i_n).to(tl.int64) + i_n
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_r = tl.arange(0, BT)
    p_state = o_k[:, None] * s_k + o_v[None, :] * s_v
    p_slot = o_k[:, None] * V + o_v[None, :]
    p_kt = o_r[:, None] * (Hv * K) + o_k[None, :]
    p_vt = o_r[:, None] * (Hv * V) + o_v[None, :]
    if HAS_H0:
        b_s = tl.load(h0 + i_nh.to(tl.int64) * K * V + p_state).to(tl.float32)
    else:
        b_s = tl.zeros([K, BV], dtype=tl.float32)
    for j in range(tl.cdiv(eos - bos, BT)):
        t0 = bos + j * BT
        m_t = (t0 + o_r) < eos
        last = tl.minimum(t0 + BT, eos) - 1
        # the start state and the innovations in their stored dtype, as the backward reads them
        b_h = b_s.to(h.dtype.element_ty)
        tl.store(h + ((slot + j) * Hv + i_h) * K * V + p_slot, b_h)
        # X = T (v - (k e^c) S)
        b_kd = tl.load(kd + (t0 * Hv + i_h) * K + p_kt, mask=m_t[:, None], other=0.0)
        b_y = tl.load(v + (t0 * Hv + i_h) * V + p_vt, mask=m_t[:, None], other=0.0).to(tl.float32)
        b_y -= tl.dot(b_kd, b_h.to(b_kd.dtype), input_precision=DOT_PREC)
        b_t = load_rows(tmat, t0, o_r, m_t, i_h, Hv, BT).to(tmat.dtype.element_ty)
        b_x = tl.dot(b_t, b_y.to(b_t.dtype), input_precision=DOT_PREC)
        b_xs = b_x.to(x.dtype.element_ty)
        tl.store(x + (t0 * Hv + i_h) * V + p_vt, b_xs, mask=m_t[:, None])
        # o = scale ((q e^c) S + R X)
        b_qd = tl.load(qd + (t0 * Hv + i_h) * K + p_kt, mask=m_t[:, None], other=0.0)
        b_r = load_rows(rmat, t0, o_r, m_t, i_h, Hv, BT).to(b_xs.dtype)
        b_o = tl.dot(b_r, b_xs, input_precision=DOT_PREC)
        b_o += tl.dot(b_qd, b_h.to(b_qd.dtype), input_precision=DOT_PREC)
        tl.store(o + (t0 * Hv + i_h) * V + p_vt, (scale * b_o).to(o.dtype.element_ty),
                 mask=m_t[:, None])
        b_wl = tl.load(wl + (t0 * Hv + i_h) * K + p_kt, mask=m_t[:, None], other=0.0)
        b_el = tl.exp(load_row(c, last, eos, i_h, Hv, K))
        b_s = b_s * b_el[:, None] + tl.dot(tl.trans(b_wl), b_x.to(b_wl.dtype),
                                           input_precision=DOT_PREC)
        if CHECKPOINTS:  # the state after every cp_every whole chunks: cp [N, C, Hv, K, V]
            # a predicated store, not a branch: the pipelined loop stays one block
            i_c = (j + 1) // cp_every - 1
            keep = ((j + 1) % cp_every == 0) & (i_c < cp_count) & (t0 + BT <= eos)
            p_cp = cp + ((i_n.to(tl.int64) * cp_count + tl.maximum(i_c, 0)) * Hv + i_h) * K * V
            # (p_slot below K * V: all kept, or none)
            tl.store(p_cp + p_slot, b_s, mask=p_slot < tl.where(keep, K * V, 0))
    p_end = ((slot + tl.cdiv(eos - bos, BT)) * Hv + i_h) * K * V
    tl.store(h + p_end + p_slot, b_s.to(h.dtype.element_ty))
    tl.store(ht + i_nh.to(tl.int64) * K * V + p_state, b_s)


def two_key_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    *,
    chunk_size: int,
    scale: float,
    state_v_first: bool,
    log_decay_floor: float = LOG_DECAY_BOUND,
    beta: torch.Tensor | None = None,
    checkpoints: torch.Tensor | None = None,
    checkpoint_every: int = 0,
) -> tuple[torch.Tensor, ...]:
    """Chunked two-key delta rule with per-key decay on the GPU (or the Triton interpreter).

    Args:
        q, k: ``[B, T, Hk, K]`` read and erase keys; value head ``h`` reads key
            head ``h // (Hv // Hk)`` (the repeat is never materialized).
        w: ``[B, T, Hv, K]`` write keys (the Kalman gain for Diag-KDN), or None with
            ``beta``.
        v: ``[B, T, Hv, V]`` values.
        log_decay: ``[B, T, Hv, K]`` natural-log decays, any float dtype; the
            kernels floor them at ``log_decay_floor`` as they read them.
        initial_state: ``[N, Hv, K, V]`` (``[N, Hv, V, K]`` with ``state_v_first``) or None.
        cu_seqlens: ``[N + 1]`` int32/int64 packed boundaries on the device (``B == 1``) or None.
        chunk_size: must be 64 (see :func:`two_key_kernel_supports`).
        scale: output scale.
        state_v_first: layout of ``initial_state`` and the final state.
        log_decay_floor: the floor of ``log_decay``, in ``[LOG_DECAY_BOUND, 0]``
            (``LOG_DECAY_BOUND = -20``: see :mod:`two_key_common`).
        beta: ``[B, T, Hv]`` or None: KDA's write key ``w = beta k``, formed in the
            kernels (give ``w`` or ``beta``, not both).
        checkpoints: float32 ``[N, C, Hv, K, V]`` (key-first whatever
            ``state_v_first``) or None: receives the state after every
            ``checkpoint_every`` tokens (a multiple of 64) of each sequence, checkpoint
            ``c`` after ``(c + 1) * checkpoint_every``; those past a sequence's end are
            left as they are.

    Returns:
        ``(o, final_state, c, qd, kd, wl, tmat, rmat, h, x, spans, offsets)``:
        ``o`` like ``v``; ``final_state`` float32 in the state layout; the rest are
        saved for :func:`two_key_bwd`: float32 cumulative decay ``c``; ``q e^c``,
        ``k e^c``, ``w e^{c_last - c}`` per value head; the inverse ``T`` and the
        readout ``R`` per chunk row; the states at every chunk boundary
        ``h`` (one slot per chunk start plus one per sequence end); the innovations
        ``x``; the chunk table (:func:`~.two_key_common.chunk_table`).

    Raises:
        ValueError: inputs that :func:`two_key_kernel_supports` does not cover,
            ``log_decay_floor`` outside ``[LOG_DECAY_BOUND, 0]``, both or neither of
            ``w`` and ``beta``, a ``beta`` not a float ``[B, T, Hv]`` tensor, or
            ``cu_seqlens`` with ``B != 1``.

    Source of the math: :func:`kdn_compile.reference.two_key_chunk_recurrence`.
    """
    require_two_key_kernels(q, v, chunk_size)
    floor = check_decay_floor(log_decay_floor)
    qf, kf, vf, gf = (tokens_major(t) for t in (q, k, v, log_decay))
    wf, betaf = write_key_args(w, beta, kf, v)
    batch, length, hk, key_dim = q.shape
    hv, value_dim = v.shape[2], v.shape[3]
    dt = compute_dtype(q.dtype)
    prec = dot_precision(q.dtype)
    bounds, num_seqs = sequence_bounds(batch, length, cu_seqlens, q.device)
    num_chunks = num_chunks_bound(batch, length, num_seqs, BT, cu_seqlens is not None)
    spans, offsets = chunk_table(bounds, num_chunks)
    tokens = batch * length
    c = q.new_empty((tokens, hv, key_dim), dtype=torch.float32)
    qd, kd, wl = (q.new_empty((tokens, hv, key_dim), dtype=dt) for _ in range(3))
    ascr = q.new_empty((tokens, hv, BT), dtype=torch.float32)
    tmat = q.new_empty((tokens, hv, BT), dtype=dt)
    rmat = q.new_empty((tokens, hv, BT), dtype=dt)
    # Packed sequences: num_chunks is an upper bound and its surplus slots are never
    # written; zeros keep the saved tensors deterministic (kdn::chunk_kda returns them).
    alloc = q.new_zeros if cu_seqlens is not None else q.new_empty
    h = alloc((num_chunks + num_seqs, hv, key_dim, value_dim), dtype=dt)
    x = q.new_empty((tokens, hv, value_dim), dtype=dt)
    o = v.new_empty(v.shape)
    state_shape = (num_seqs, hv, value_dim, key_dim) if state_v_first else (
        num_seqs, hv, key_dim, value_dim)
    final_state = q.new_empty(state_shape, dtype=torch.float32)
    s_k, s_v = (1, key_dim) if state_v_first else (value_dim, 1)
    h0 = initial_state.contiguous() if initial_state is not None else final_state

    wrap_triton(_two_key_fwd_decay_kernel)[(num_chunks, key_dim // min(64, key_dim), hv)](
        qf, kf, wf, betaf, gf, c, qd, kd, wl,
        spans, floor,
        Hk=hk, Hv=hv, K=key_dim, BT=BT, BK=min(64, key_dim), HAS_BETA=beta is not None,
        num_warps=4, num_stages=1,
    )
    wrap_triton(_two_key_fwd_pairs_kernel)[(num_chunks, BT // BC, hv)](
        qf, kf, wf, betaf, c, ascr, rmat,
        spans,
        Hk=hk, Hv=hv, K=key_dim, BT=BT, BC=BC, BK=min(PAIRS_LAUNCH["BK"], key_dim),
        HAS_BETA=beta is not None, DOT_PREC=prec, num_warps=PAIRS_LAUNCH["num_warps"],
        num_stages=PAIRS_LAUNCH["num_stages"],
    )
    wrap_triton(_two_key_fwd_solve_kernel)[(num_chunks, hv)](
        ascr, tmat, spans, Hv=hv, BT=BT, BC=BC, num_warps=2, num_stages=1,
    )
    state = state_launch(STATE_LAUNCH, STATE_LAUNCH_NARROW, value_dim, num_seqs * hv, q.device,
                         dtype=dt)
    state_v = min(state["BV"], value_dim)
    wrap_triton(_two_key_fwd_state_kernel)[(triton.cdiv(value_dim, state_v) * num_seqs * hv,)](
        kd, vf, tmat, wl, c, qd, rmat, h, x, o, h0, final_state,
        bounds, offsets, s_k, s_v, scale, checkpoints, max(checkpoint_every // BT, 1),
        0 if checkpoints is None else checkpoints.shape[1],
        Hv=hv, K=key_dim, V=value_dim, BT=BT, BV=state_v,
        HAS_H0=initial_state is not None, DOT_PREC=prec, CHECKPOINTS=checkpoints is not None,
        num_warps=state["num_warps"],
        num_stages=state["num_stages"],
    )
    return (o, final_state, c, qd, kd, wl, tmat, rmat, h, x, spans, offsets)
