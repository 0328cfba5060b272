"""Backward of the two-key, per-key-decay chunked delta rule.

Per chunk, with start state ``S0``, end-state gradient ``dS1`` and the forward's
``X = T (v - (k e^c) S0)``::

    dY  = T^T (scale R^T do + (w e^{c_last - c}) dS1)          (= dv)
    dS0 = e^{c_last} dS1 + scale (q e^c)^T do - (k e^c)^T dY
    dA  = -strict(dY X^T),   dR = scale lower(do X^T)

Four launches:

1. ``_two_key_bwd_state_kernel`` (sequential over chunks, backwards): ``dY`` and
   each chunk's end-state gradient ``dS1``; ``dh0`` at the end.
2. ``_two_key_bwd_pair_kernel`` (one program per chunk): ``dA`` and ``dR``.
3. ``_two_key_bwd_rows_kernel`` (one program per chunk, 16-row block, key slice and
   value head): ``dq``, ``dk``, ``dw`` from the pair terms (the earlier blocks' columns
   and the later blocks' rows each in one product, the diagonal block whole or in quarters; see
   :mod:`two_key_common` for the factoring) and the state terms, and
   ``dc = q dq + k dk - w dw``. For KDA (``w = beta k``) it chains ``w`` itself:
   ``dk + beta dw`` and per-slice partial sums of ``dbeta = sum_K dw k``.
4. ``_two_key_bwd_decay_kernel`` (one program per chunk, key slice and value head):
   ``dlog_decay`` as the reverse in-chunk cumulative sum of ``dc``, plus the
   whole-chunk terms of ``c_last``; zero where ``g`` sits below the floor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from kdn_compile.lowering._launch import dot_precision
from kdn_compile.lowering.two_key_common import (
    BC,
    BT,
    LOG_DECAY_BOUND,
    WHOLE_BLOCK_SPAN,
    check_decay_floor,
    compute_dtype,
    load_write_key,
    load_block,
    load_row,
    load_rows,
    load_tile,
    require_two_key_kernels,
    sequence_bounds,
    state_launch,
    store_rows,
    store_tile,
    tokens_major,
    write_key_args,
)


# Launch configuration of the rows kernel: key slice, value tile, warps, stages.
# Half inputs: the fastest of 24 configurations (H200, 8x4096x16: the whole backward
# 4.66 ms against 7.93 at 32 / 64 / 4 / 1). float32 tiles spill 2 KB there (sm_90), so
# float32 takes 32-key slices and one stage.
ROWS_LAUNCH = {"BK": 64, "BV": 64, "num_warps": 4, "num_stages": 2}
ROWS_LAUNCH_FP32 = {"BK": 32, "BV": 64, "num_warps": 4, "num_stages": 1}
# The state-gradient pass for half inputs: 32-wide value tiles at 8 warps and 3 stages
# (the whole backward 0.978x its time at 4 warps and 2 stages, 8x4096x16, H200; 177
# registers, no spill, 220 KB of shared memory on sm_90; 64-wide tiles 1.05x), and where
# that leaves fewer than two programs per multiprocessor 16-wide tiles with three stages
# (see state_launch; the whole backward 0.94x its time at two stages at 1x32768x16). One
# stage is an illegal memory access at every tile width and warp count (Triton 3.6);
# float32 inputs take one stage (see state_launch) and pass their CUDA tests.
STATE_LAUNCH = {"BV": 32, "num_warps": 8, "num_stages": 3}
STATE_LAUNCH_NARROW = {"BV": 16, "num_warps": 4, "num_stages": 3}


@triton.jit
def _two_key_bwd_state_kernel(
    qd, kd, wl, c, tmat, rmat, do, dht, dh, dv, dh0,
    cu_seqlens, offsets, s_k, s_v, scale,
    Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, HAS_DHT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    # One flat grid axis (value tiles fastest): sequences x heads can exceed 65535, the
    # limit of CUDA's second grid axis.
    i_v, i_nh = tl.program_id(0) % (V // BV), tl.program_id(0) // (V // BV)
    i_n, i_h = i_nh // Hv, i_nh % Hv
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    first = tl.load(offsets + i_n).to(tl.int64)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_bt = tl.arange(0, BT)
    p_state = i_nh.to(tl.int64) * K * V + (o_k[:, None] * s_k + o_v[None, :] * s_v)
    if HAS_DHT:
        b_ds = tl.load(dht + p_state).to(tl.float32)
    else:
        b_ds = tl.zeros([K, BV], dtype=tl.float32)
    nt = tl.cdiv(eos - bos, BT)
    for jj in range(nt):
        j = nt - 1 - jj
        t0 = bos + j * BT
        m_t = (t0 + o_bt) < eos
        last = tl.minimum(t0 + BT, eos) - 1
        p_h = dh + ((first + j) * Hv + i_h) * K * V + (o_k[:, None] * V + o_v[None, :])
        tl.store(p_h, b_ds.to(dh.dtype.element_ty))
        p_x = (t0 * Hv + i_h) * V + (o_bt[:, None] * (Hv * V) + o_v[None, :])
        p_kt = (t0 * Hv + i_h) * K + (o_bt[:, None] * (Hv * K) + o_k[None, :])
        b_do = tl.load(do + p_x, mask=m_t[:, None], other=0.0)
        b_wl = tl.load(wl + p_kt, mask=m_t[:, None], other=0.0)
        b_r = load_rows(rmat, t0, o_bt, m_t, i_h, Hv, BT).to(b_wl.dtype)
        b_dxt = scale * tl.dot(tl.trans(b_r), b_do.to(b_wl.dtype), input_precision=DOT_PREC)
        b_dxt += tl.dot(b_wl, b_ds.to(b_wl.dtype), input_precision=DOT_PREC)
        b_t = load_rows(tmat, t0, o_bt, m_t, i_h, Hv, BT).to(b_wl.dtype)
        b_dy = tl.dot(tl.trans(b_t), b_dxt.to(b_wl.dtype), input_precision=DOT_PREC)
        tl.store(dv + p_x, b_dy, mask=m_t[:, None])
        b_qd = tl.load(qd + p_kt, mask=m_t[:, None], other=0.0)
        b_kd = tl.load(kd + p_kt, mask=m_t[:, None], other=0.0)
        b_el = tl.exp(load_row(c, last, eos, i_h, Hv, K))
        b_ds = b_ds * b_el[:, None] + scale * tl.dot(tl.trans(b_qd), b_do.to(b_qd.dtype),
                                                     input_precision=DOT_PREC)
        b_ds -= tl.dot(tl.trans(b_kd), b_dy.to(b_kd.dtype), input_precision=DOT_PREC)
    tl.store(dh0 + p_state, b_ds)


@triton.jit
def _two_key_bwd_pair_kernel(
    x, do, dv, dascr, drscr,
    spans, scale,
    Hv: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """``dA = -strict(dY X^T)`` and ``dR = scale lower(do X^T)`` of one chunk."""
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    # index loads in the kernel body, not a helper: see _launch.py on mutation analysis
    t0 = tl.load(spans + 3 * i_c).to(tl.int64)
    eos = tl.load(spans + 3 * i_c + 1).to(tl.int64)
    if t0 >= eos:  # a surplus chunk
        return
    o_bt = tl.arange(0, BT)
    m_t = (t0 + o_bt) < eos
    b_da = tl.zeros([BT, BT], dtype=tl.float32)
    b_dr = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        p_x = (t0 * Hv + i_h) * V + (o_bt[:, None] * (Hv * V) + o_v[None, :])
        # float32 operands (tf32 for half inputs): with bf16 operands do @ x^T gives a 7%
        # error in dq on Hopper with Triton 3.6.
        b_x = tl.load(x + p_x, mask=m_t[:, None], other=0.0).to(tl.float32)
        b_do = tl.load(do + p_x, mask=m_t[:, None], other=0.0).to(tl.float32)
        b_dy = tl.load(dv + p_x, mask=m_t[:, None], other=0.0)
        b_da += tl.dot(b_dy, tl.trans(b_x), input_precision=DOT_PREC)
        b_dr += tl.dot(b_do, tl.trans(b_x), input_precision=DOT_PREC)
    b_da = -tl.where(o_bt[:, None] > o_bt[None, :], b_da, 0.0)
    b_dr = scale * tl.where(o_bt[:, None] >= o_bt[None, :], b_dr, 0.0)
    store_rows(dascr, b_da, t0, o_bt, m_t, i_h, Hv, BT)
    store_rows(drscr, b_dr, t0, o_bt, m_t, i_h, Hv, BT)


@triton.jit
def _diag_terms(b_daii, b_drii, b_w, b_k, b_q, b_fr, b_fc, b_dkp, b_dqp, b_dwp,
                DOT_PREC: tl.constexpr):
    """Add a diagonal block's pair terms to ``dk``, ``dq``, ``dw`` (``b_dkp``, ``b_dqp``,
    ``b_dwp``), the pair weights ``e^{c_t - c_s}`` factored as the row factors ``b_fr``
    (``e^{c_t - c_r}``) times the column factors ``b_fc`` (``e^{c_r - c_s}``), each zero
    outside the rows / columns of the pass (see two_key_common)."""
    b_wc = b_w * b_fc
    b_dkp += tl.dot(b_daii, b_wc, input_precision=DOT_PREC) * b_fr
    b_dqp += tl.dot(b_drii, b_wc, input_precision=DOT_PREC) * b_fr
    b_dwp += (
        tl.dot(tl.trans(b_daii), b_k * b_fr, input_precision=DOT_PREC)
        + tl.dot(tl.trans(b_drii), b_q * b_fr, input_precision=DOT_PREC)
    ) * b_fc
    return b_dkp, b_dqp, b_dwp


@triton.jit
def _two_key_bwd_rows_kernel(
    q, k, w, c, h, dh, x, do, dv, dascr, drscr, beta,
    dq, dk, dw, dc, wds, dbeta, dvo,
    spans, scale,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_BETA: tl.constexpr, CAST_DV: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """``dq``, ``dk``, ``dw`` and ``dc = q dq + k dk - w dw`` of one 16-row block, key
    slice and value head; ``wds``: the block's column sums of ``w dw_state``.

    ``HAS_BETA`` (``w = beta k``): ``dk`` takes ``dk + beta dw`` and ``dbeta`` this key
    slice's ``sum dw k`` in place of ``dw``. ``CAST_DV``: the first key slice copies
    ``dv`` (float32) into ``dvo`` (the value dtype)."""
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    NB: tl.constexpr = BT // BC
    i_p, i_k, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_c, i_i = i_p // NB, i_p % NB
    i_hk = i_h // (Hv // Hk)
    # index loads in the kernel body, not a helper: see _launch.py on mutation analysis
    t0 = tl.load(spans + 3 * i_c).to(tl.int64)
    eos = tl.load(spans + 3 * i_c + 1).to(tl.int64)
    if t0 >= eos:  # a surplus chunk
        return
    i_n = tl.load(spans + 3 * i_c + 2)
    ti = t0 + i_i * BC
    if ti >= eos:
        return
    last = tl.minimum(t0 + BT, eos) - 1
    o_r = tl.arange(0, BC)
    m_r = ti + o_r < eos
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    b_c = load_tile(c, ti, o_r, m_r, i_h, o_k, Hv, K)
    b_q = load_tile(q, ti, o_r, m_r, i_hk, o_k, Hk, K)
    b_k = load_tile(k, ti, o_r, m_r, i_hk, o_k, Hk, K)
    b_w = load_write_key(w, k, beta, ti, o_r, m_r, i_h, i_hk, o_k, Hk, Hv, K, HAS_BETA)

    # Pair terms against the earlier blocks' columns (one product, factored about this
    # block's first row) and the later blocks' rows (factored about its last row): all
    # factors at most 1 for any decay (see two_key_common).
    b_dqp = tl.zeros([BC, BK], dtype=tl.float32)
    b_dkp = tl.zeros([BC, BK], dtype=tl.float32)
    b_dwp = tl.zeros([BC, BK], dtype=tl.float32)
    if i_i > 0:
        m_j = (o_t < i_i * BC) & (t0 + o_t < eos)
        b_cf = tl.load(c + (ti * Hv + i_h) * K + o_k)
        b_ct = load_tile(c, t0, o_t, m_j, i_h, o_k, Hv, K)
        b_wt = load_write_key(w, k, beta, t0, o_t, m_j, i_h, i_hk, o_k, Hk, Hv, K, HAS_BETA)
        b_wt = tl.where(m_j[:, None], b_wt * tl.exp(b_cf[None, :] - b_ct), 0.0)
        b_f = tl.where(m_r[:, None], tl.exp(b_c - b_cf[None, :]), 0.0)
        p_d = (ti * Hv + i_h) * BT + (o_r[:, None] * (Hv * BT) + o_t[None, :])
        m_d = m_r[:, None] & (o_t[None, :] < i_i * BC)
        b_da = tl.load(dascr + p_d, mask=m_d, other=0.0)
        b_dr = tl.load(drscr + p_d, mask=m_d, other=0.0)
        b_dkp += tl.dot(b_da, b_wt, input_precision=DOT_PREC) * b_f
        b_dqp += tl.dot(b_dr, b_wt, input_precision=DOT_PREC) * b_f
    if ti + BC <= last:
        m_l = (o_t >= (i_i + 1) * BC) & (t0 + o_t < eos)
        b_cb = tl.load(c + ((ti + BC - 1) * Hv + i_h) * K + o_k)
        b_fl = tl.where(m_l[:, None],
                        tl.exp(load_tile(c, t0, o_t, m_l, i_h, o_k, Hv, K) - b_cb[None, :]), 0.0)
        b_kl = load_tile(k, t0, o_t, m_l, i_hk, o_k, Hk, K) * b_fl
        b_ql = load_tile(q, t0, o_t, m_l, i_hk, o_k, Hk, K) * b_fl
        # the block's columns of dA, dR over the later rows, as [BC, BT]
        p_d = (t0 * Hv + i_h) * BT + i_i * BC + (o_t[None, :] * (Hv * BT) + o_r[:, None])
        b_dat = tl.load(dascr + p_d, mask=m_l[None, :], other=0.0)
        b_drt = tl.load(drscr + p_d, mask=m_l[None, :], other=0.0)
        b_fc = tl.where(m_r[:, None], tl.exp(b_cb[None, :] - b_c), 0.0)
        b_dwp += (tl.dot(b_dat, b_kl, input_precision=DOT_PREC)
                  + tl.dot(b_drt, b_ql, input_precision=DOT_PREC)) * b_fc
    # The diagonal block: factored about its 8th row (clipped to the last valid one) in
    # one pass where every factor stays within e^WHOLE_BLOCK_SPAN, else one quarter of its
    # columns at a time (about the quarter's 2nd row; see two_key_common).
    b_daii = load_block(dascr, ti, m_r, i_h, i_i * BC, Hv, BT, BC)
    b_drii = load_block(drscr, ti, m_r, i_h, i_i * BC, Hv, BT, BC)
    b_cm = tl.load(c + (tl.minimum(ti + BC // 2 - 1, last) * Hv + i_h) * K + o_k)
    span = tl.max(tl.max(tl.where(m_r[:, None], tl.abs(b_c - b_cm[None, :]), 0.0), 1), 0)
    if span <= WHOLE_BLOCK_SPAN:
        b_fr = tl.where(m_r[:, None], tl.exp(b_c - b_cm[None, :]), 0.0)
        b_fc = tl.where(m_r[:, None], tl.exp(b_cm[None, :] - b_c), 0.0)
        b_dkp, b_dqp, b_dwp = _diag_terms(b_daii, b_drii, b_w, b_k, b_q, b_fr, b_fc,
                                          b_dkp, b_dqp, b_dwp, DOT_PREC)
    else:
        for part in range(4):  # a loop, not unrolled: four copies spilled (sm_90)
            start = part * (BC // 4)
            r = tl.minimum(ti + start + BC // 8 - 1, last)
            b_cr = tl.load(c + (r * Hv + i_h) * K + o_k)
            row_ok = m_r & (o_r >= start)
            col_ok = row_ok & (o_r < start + BC // 4)
            b_fr = tl.where(row_ok[:, None], tl.exp(b_c - b_cr[None, :]), 0.0)
            b_fc = tl.where(col_ok[:, None], tl.exp(b_cr[None, :] - b_c), 0.0)
            b_dkp, b_dqp, b_dwp = _diag_terms(b_daii, b_drii, b_w, b_k, b_q, b_fr, b_fc,
                                              b_dkp, b_dqp, b_dwp, DOT_PREC)

    # State terms: S0 (this chunk's start state) and dS1 (its end-state gradient).
    p_h0 = ((i_c + i_n).to(tl.int64) * Hv + i_h) * K * V
    p_dh = (i_c.to(tl.int64) * Hv + i_h) * K * V
    b_dqs = tl.zeros([BC, BK], dtype=tl.float32)
    b_dks = tl.zeros([BC, BK], dtype=tl.float32)
    b_dws = tl.zeros([BC, BK], dtype=tl.float32)
    for i_v in range(V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        b_x = load_tile(x, ti, o_r, m_r, i_h, o_v, Hv, V)
        b_do = load_tile(do, ti, o_r, m_r, i_h, o_v, Hv, V)
        b_dy = load_tile(dv, ti, o_r, m_r, i_h, o_v, Hv, V)
        if CAST_DV:
            if i_k == 0:
                store_tile(dvo, b_dy, ti, o_r, m_r, i_h, o_v, Hv, V)
        p_s = o_k[:, None] * V + o_v[None, :]
        b_h = tl.load(h + p_h0 + p_s).to(tl.float32)
        b_dh = tl.load(dh + p_dh + p_s).to(tl.float32)
        b_dqs += tl.dot(b_do, tl.trans(b_h), input_precision=DOT_PREC)
        b_dks += tl.dot(b_dy, tl.trans(b_h), input_precision=DOT_PREC)
        b_dws += tl.dot(b_x, tl.trans(b_dh), input_precision=DOT_PREC)
    b_cl = tl.load(c + (last * Hv + i_h) * K + o_k)
    b_dqi = scale * b_dqs * tl.where(m_r[:, None], tl.exp(b_c), 0.0) + b_dqp
    b_dki = b_dkp - b_dks * tl.where(m_r[:, None], tl.exp(b_c), 0.0)
    b_dws = b_dws * tl.where(m_r[:, None], tl.exp(b_cl[None, :] - b_c), 0.0)
    b_dwi = b_dws + b_dwp
    store_tile(dq, b_dqi, ti, o_r, m_r, i_h, o_k, Hv, K)
    store_tile(dc, b_q * b_dqi + b_k * b_dki - b_w * b_dwi, ti, o_r, m_r, i_h, o_k, Hv, K)
    if HAS_BETA:
        p_b = (ti + o_r).to(tl.int64) * Hv + i_h
        b_beta = tl.load(beta + p_b, mask=m_r, other=0.0).to(tl.float32)
        store_tile(dk, b_dki + b_beta[:, None] * b_dwi, ti, o_r, m_r, i_h, o_k, Hv, K)
        tl.store(dbeta + p_b * (K // BK) + i_k, tl.sum(b_dwi * b_k, 1), mask=m_r)
    else:
        store_tile(dk, b_dki, ti, o_r, m_r, i_h, o_k, Hv, K)
        store_tile(dw, b_dwi, ti, o_r, m_r, i_h, o_k, Hv, K)
    tl.store(wds + (i_p.to(tl.int64) * Hv + i_h) * K + o_k, tl.sum(b_w * b_dws, 0))


@triton.jit
def _two_key_bwd_decay_kernel(
    c, h, dh, wds, dc, g, dg,
    spans, floor,
    Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """``dlog_decay`` of one chunk, key slice and value head: the reverse in-chunk
    cumulative sum of ``dc`` plus the terms of ``c_last``, zero where ``g < floor``.

    ``c_last`` gets ``e^{c_last} sum_v S0 dS1`` (state decay) and ``sum_t w_t dw_state_t``
    (write factors), the latter summed from the same products as the rows' ``dc``, so
    that the two cancel to float32 rounding. (The equal ``sum_v S1 dS1`` from the stored
    half-precision ``S1`` does not: ``dlog_decay`` is then off by 42% in bf16 with decays
    at ``log(1e-6)``.)
    """
    NB: tl.constexpr = BT // BC
    i_c, i_k, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # index loads in the kernel body, not a helper: see _launch.py on mutation analysis
    t0 = tl.load(spans + 3 * i_c).to(tl.int64)
    eos = tl.load(spans + 3 * i_c + 1).to(tl.int64)
    if t0 >= eos:  # a surplus chunk
        return
    i_n = tl.load(spans + 3 * i_c + 2)
    last = tl.minimum(t0 + BT, eos) - 1
    o_t = tl.arange(0, BT)
    m_t = t0 + o_t < eos
    o_k = i_k * BK + tl.arange(0, BK)
    p_h0 = ((i_c + i_n).to(tl.int64) * Hv + i_h) * K * V
    p_dh = (i_c.to(tl.int64) * Hv + i_h) * K * V
    b_carry = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        p_s = o_k[:, None] * V + o_v[None, :]
        b_carry += tl.sum(tl.load(h + p_h0 + p_s).to(tl.float32)
                          * tl.load(dh + p_dh + p_s).to(tl.float32), 1)
    b_carry *= tl.exp(tl.load(c + (last * Hv + i_h) * K + o_k))
    o_b = tl.arange(0, NB)
    p_w = ((i_c * NB + o_b).to(tl.int64)[:, None] * Hv + i_h) * K + o_k[None, :]
    b_carry += tl.sum(tl.load(wds + p_w, mask=(t0 + o_b * BC < eos)[:, None], other=0.0), 0)
    b_dg = tl.cumsum(load_tile(dc, t0, o_t, m_t, i_h, o_k, Hv, K), axis=0, reverse=True)
    b_dg += b_carry[None, :]
    b_floored = load_tile(g, t0, o_t, m_t, i_h, o_k, Hv, K) < tl.cast(floor, tl.float32)
    store_tile(dg, tl.where(b_floored, 0.0, b_dg), t0, o_t, m_t, i_h, o_k, Hv, K)


def two_key_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    c: torch.Tensor,
    qd: torch.Tensor,
    kd: torch.Tensor,
    wl: torch.Tensor,
    tmat: torch.Tensor,
    rmat: torch.Tensor,
    h: torch.Tensor,
    x: torch.Tensor,
    spans: torch.Tensor,
    offsets: torch.Tensor,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    *,
    chunk_size: int,
    scale: float,
    state_v_first: bool,
    log_decay_floor: float = LOG_DECAY_BOUND,
    beta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Gradients of :func:`two_key_fwd` from its saved tensors.

    Args:
        q, k, w, v, log_decay, initial_state, cu_seqlens: as for :func:`two_key_fwd`.
        c, qd, kd, wl, tmat, rmat, h, x, spans, offsets: the saved outputs
            of :func:`two_key_fwd` (same call).
        do: ``[B, T, Hv, V]`` gradient of ``o``.
        dht: gradient of the final state (its layout) or None.
        chunk_size, scale, state_v_first, log_decay_floor: as for the forward
            (``dlog_decay`` is zero where ``log_decay < log_decay_floor``).
        beta: ``[B, T, Hv]`` or None: KDA's ``w = beta k`` in place of ``w`` (give one
            of them, as to the forward). The kernels form ``w`` and chain through it:
            ``dk`` includes ``beta dw`` and the third output is ``dbeta = sum_K dw k``
            in place of ``dw``.

    Returns:
        ``(dq, dk, dw, dv, dlog_decay, dh0)`` (``dbeta`` for ``dw`` when ``beta`` is
        given) in the dtypes of ``q, k, w`` (``beta``), ``v, log_decay``; ``dh0`` is
        float32 in the state layout (the gradient of a zero initial state when
        ``initial_state`` is None).

    Raises:
        ValueError: inputs that :func:`two_key_kernel_supports` does not cover,
            ``log_decay_floor`` outside ``[LOG_DECAY_BOUND, 0]``, both or neither of
            ``w`` and ``beta``, a ``beta`` not a float ``[B, T, Hv]`` tensor, or
            ``cu_seqlens`` with ``B != 1``.
    """
    require_two_key_kernels(q, v, chunk_size)
    floor = check_decay_floor(log_decay_floor)
    qf, kf, gf, dof = (tokens_major(t) for t in (q, k, log_decay, do))
    wf, betaf = write_key_args(w, beta, kf, v)
    batch, length, hk, key_dim = q.shape
    hv, value_dim = v.shape[2], v.shape[3]
    dt = compute_dtype(q.dtype)
    prec = dot_precision(q.dtype)
    bounds, _ = sequence_bounds(batch, length, cu_seqlens, q.device)
    num_seqs = offsets.shape[0] - 1
    num_chunks = spans.shape[0] - 1  # its spare last row: see chunk_table
    tokens = batch * length
    dh = q.new_empty((num_chunks, hv, key_dim, value_dim), dtype=dt)
    dv32 = q.new_empty((tokens, hv, value_dim), dtype=torch.float32)
    state_shape = (num_seqs, hv, value_dim, key_dim) if state_v_first else (
        num_seqs, hv, key_dim, value_dim)
    dh0 = q.new_empty(state_shape, dtype=torch.float32)
    s_k, s_v = (1, key_dim) if state_v_first else (value_dim, 1)
    block_v = min(64, value_dim)
    state = state_launch(STATE_LAUNCH, STATE_LAUNCH_NARROW, value_dim, num_seqs * hv, q.device,
                         dtype=dt)
    state_v = min(state["BV"], value_dim)
    wrap_triton(_two_key_bwd_state_kernel)[(triton.cdiv(value_dim, state_v) * num_seqs * hv,)](
        qd, kd, wl, c, tmat, rmat, dof,
        dht.contiguous() if dht is not None else dh0, dh, dv32, dh0,
        bounds, offsets, s_k, s_v, scale,
        Hv=hv, K=key_dim, V=value_dim, BT=BT, BV=state_v,
        HAS_DHT=dht is not None, DOT_PREC=prec, num_warps=state["num_warps"],
        num_stages=state["num_stages"],
    )
    dascr = q.new_empty((tokens, hv, BT), dtype=torch.float32)
    drscr = q.new_empty((tokens, hv, BT), dtype=torch.float32)
    wrap_triton(_two_key_bwd_pair_kernel)[(num_chunks, hv)](
        x, dof, dv32, dascr, drscr,
        spans, scale,
        Hv=hv, V=value_dim, BT=BT, BV=block_v, DOT_PREC=prec,
        num_warps=4, num_stages=3,  # the whole backward 0.99x its time at 2 stages (H200)
    )
    rows_launch = ROWS_LAUNCH_FP32 if dt == torch.float32 else ROWS_LAUNCH
    block_k = min(rows_launch["BK"], key_dim)
    nk = key_dim // block_k
    group = hv // hk
    # Per value head, in the output dtypes; float32 where value heads sharing a key
    # head are summed below.
    dq, dk = (q.new_empty((tokens, hv, key_dim), dtype=t.dtype if group == 1 else torch.float32)
              for t in (q, k))
    dc = q.new_empty((tokens, hv, key_dim), dtype=torch.float32)
    wds = q.new_empty((num_chunks * (BT // BC), hv, key_dim), dtype=torch.float32)
    if beta is None:
        dw, dbeta = w.new_empty((tokens, hv, key_dim)), dc  # dbeta: never written
    else:
        dbeta = q.new_empty((tokens, hv, nk), dtype=torch.float32)
        dw = dk  # never written
    dvo = dv32 if v.dtype == torch.float32 else v.new_empty((tokens, hv, value_dim))
    wrap_triton(_two_key_bwd_rows_kernel)[(num_chunks * (BT // BC), nk, hv)](
        qf, kf, wf, c, h, dh, x, dof, dv32, dascr, drscr, betaf,
        dq, dk, dw, dc, wds, dbeta, dvo,
        spans, scale,
        Hk=hk, Hv=hv, K=key_dim, V=value_dim, BT=BT, BC=BC, BK=block_k,
        BV=min(rows_launch["BV"], value_dim), HAS_BETA=beta is not None,
        CAST_DV=dvo is not dv32, DOT_PREC=prec,
        num_warps=rows_launch["num_warps"], num_stages=rows_launch["num_stages"],
    )
    dg = log_decay.new_empty((tokens, hv, key_dim))
    # 32-key slices of its own (0.35 ms at 8x4096x16 against 0.41 at the rows kernel's
    # 64, H200)
    decay_k = min(32, key_dim)
    wrap_triton(_two_key_bwd_decay_kernel)[(num_chunks, key_dim // decay_k, hv)](
        c, h, dh, wds, dc, gf, dg,
        spans, floor,
        Hv=hv, K=key_dim, V=value_dim, BT=BT, BC=BC, BK=decay_k, BV=block_v,
        num_warps=4, num_stages=1,
    )
    if group > 1:
        dq = dq.view(tokens, hk, group, key_dim).sum(2)
        dk = dk.view(tokens, hk, group, key_dim).sum(2)
    third = dw.view(w.shape) if beta is None else dbeta.sum(-1).view(beta.shape).to(beta.dtype)
    return (
        dq.view(q.shape).to(q.dtype),
        dk.view(k.shape).to(k.dtype),
        third,
        dvo.view(v.shape),
        dg.view(log_decay.shape),
        dh0,
    )
