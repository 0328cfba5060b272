"""Forward of the two-key, per-key-decay chunked delta rule (KDA, Diag-KDN memory).

Three launches (see :mod:`two_key_common` for the decay factoring and its bound):

1. ``_two_key_fwd_intra_kernel`` (one program per chunk and value head): the
   in-chunk cumulative log decay ``c``; the strictly lower ``A[t, s] = sum_i
   k_ti e^{c_ti - c_si} w_si`` and the lower ``R`` (``q`` in place of ``k``,
   diagonal included); ``T = (I + A)^-1`` (16 x 16 forward substitutions, then
   block products); ``Wk = T (k e^c)`` and ``U = T v``.
2. ``_two_key_fwd_state_kernel`` (one program per sequence, value head and value
   tile, sequential over chunks): ``X = U - Wk S``,
   ``S <- e^{c_last} S + (w e^{c_last - c})^T X``; saves each chunk's start state.
3. ``_two_key_fwd_output_kernel`` (one program per chunk): ``o = scale((q e^c) S + R X)``.

Math source: the WY form of :func:`kdn_compile.reference.two_key_chunk_recurrence`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from kdn_compile.lowering._launch import dot_precision
from kdn_compile.lowering._tiles import inv_unit_lower
from kdn_compile.lowering.two_key_common import (
    BC,
    BT,
    chunk_map,
    compute_dtype,
    load_block,
    load_row,
    load_rows,
    num_chunks_bound,
    require_two_key_kernels,
    sequence_bounds,
    store_block,
    store_rows,
)


@triton.jit
def _unit_lower_inverse(a_ptr, row0, m_r, i_h, col0, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """``(I + L)^-1`` of the strictly lower ``[BC, BC]`` diagonal block at token ``row0``."""
    return inv_unit_lower(load_block(a_ptr, row0, m_r, i_h, col0, H, BT, BC).to(tl.float32))


@triton.jit
def _diag_pair(b_ci, b_ki, b_qi, b_wi, o_i, m_i, last, c, i_h, half, t_blk,
               Hv: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, DOT_PREC: tl.constexpr):
    """``(A, R)`` of a diagonal block restricted to the columns ``s`` of one half:
    ``sum_i x_ti e^{c_ti - c_si} w_si`` for ``x = k`` and ``x = q``.

    The factors are taken about the half's 4th token (clipped to the last valid one).
    """
    start = t_blk + half * (BC // 2)
    r = tl.minimum(start + BC // 4 - 1, last)
    b_cr = load_row(c, r, last + 1, i_h, Hv, K)
    row_ok = m_i & (o_i >= start)
    col_ok = row_ok & (o_i < start + BC // 2)
    b_fr = tl.where(row_ok[:, None], tl.exp(b_ci - b_cr[None, :]), 0.0)
    b_wc = tl.trans(tl.where(col_ok[:, None], b_wi * tl.exp(b_cr[None, :] - b_ci), 0.0))
    return (tl.dot(b_ki * b_fr, b_wc, input_precision=DOT_PREC),
            tl.dot(b_qi * b_fr, b_wc, input_precision=DOT_PREC))


@triton.jit
def _two_key_fwd_intra_kernel(
    q, k, w, v, g, c, qd, kd, wl, ascr, tmat, rmat, wk, u,
    cu_seqlens, chunk_seq, chunk_first, N,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (Hv // Hk)
    i_n = tl.load(chunk_seq + i_c)
    if i_n >= N:
        return
    # index loads in the kernel body, not a helper: see _launch.py on mutation analysis
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    t0 = bos + (i_c - tl.load(chunk_first + i_n)).to(tl.int64) * BT
    last = tl.minimum(t0 + BT, eos) - 1

    # In-chunk cumulative log decay c and the decayed keys q e^c, k e^c,
    # w e^{c_last - c}, stored for the later stages and read back below.
    o_c = tl.arange(0, BC)
    b_cl = tl.zeros([K], dtype=tl.float32)
    for i in tl.static_range(BT // BC):
        o_i = t0 + i * BC + o_c
        m_i = o_i < eos
        b_ci = tl.cumsum(load_rows(g, t0 + i * BC, o_c, m_i, i_h, Hv, K), axis=0) + b_cl[None, :]
        b_cl = tl.sum(tl.where(o_c[:, None] == BC - 1, b_ci, 0.0), 0)
        b_e = tl.where(m_i[:, None], tl.exp(b_ci), 0.0)
        store_rows(c, b_ci, t0 + i * BC, o_c, m_i, i_h, Hv, K)
        store_rows(qd, load_rows(q, t0 + i * BC, o_c, m_i, i_hk, Hk, K) * b_e, t0 + i * BC, o_c, m_i, i_h, Hv, K)
        store_rows(kd, load_rows(k, t0 + i * BC, o_c, m_i, i_hk, Hk, K) * b_e, t0 + i * BC, o_c, m_i, i_h, Hv, K)
    tl.debug_barrier()
    for i in tl.static_range(BT // BC):
        o_i = t0 + i * BC + o_c
        m_i = o_i < eos
        b_el = tl.where(m_i[:, None], tl.exp(b_cl[None, :] - load_rows(c, t0 + i * BC, o_c, m_i, i_h, Hv, K)), 0.0)
        store_rows(wl, load_rows(w, t0 + i * BC, o_c, m_i, i_h, Hv, K) * b_el, t0 + i * BC, o_c, m_i, i_h, Hv, K)

    # A (strictly lower, float32 scratch) and R (lower), block by block.
    for i in tl.static_range(BT // BC):
        o_i = t0 + i * BC + o_c
        m_i = o_i < eos
        b_ci = load_rows(c, t0 + i * BC, o_c, m_i, i_h, Hv, K)
        b_ki = load_rows(k, t0 + i * BC, o_c, m_i, i_hk, Hk, K)
        b_qi = load_rows(q, t0 + i * BC, o_c, m_i, i_hk, Hk, K)
        for j in tl.static_range(BT // BC):
            o_j = t0 + j * BC + o_c
            if j < i:
                m_j = o_j < eos
                b = tl.minimum(t0 + j * BC + BC - 1, last)
                b_cb = load_row(c, b, eos, i_h, Hv, K)
                b_wj = load_rows(w, t0 + j * BC, o_c, m_j, i_h, Hv, K)
                b_cj = load_rows(c, t0 + j * BC, o_c, m_j, i_h, Hv, K)
                b_wc = tl.where(m_j[:, None], b_wj * tl.exp(b_cb[None, :] - b_cj), 0.0)
                b_fr = tl.where(m_i[:, None], tl.exp(b_ci - b_cb[None, :]), 0.0)
                b_a = tl.dot(b_ki * b_fr, tl.trans(b_wc), input_precision=DOT_PREC)
                b_r = tl.dot(b_qi * b_fr, tl.trans(b_wc), input_precision=DOT_PREC)
            elif j == i:
                b_wi = load_rows(w, t0 + i * BC, o_c, m_i, i_h, Hv, K)
                b_a, b_r = _diag_pair(b_ci, b_ki, b_qi, b_wi, o_i, m_i, last, c, i_h, 0,
                                      t0 + i * BC, Hv, K, BC, DOT_PREC)
                b_a1, b_r1 = _diag_pair(b_ci, b_ki, b_qi, b_wi, o_i, m_i, last, c, i_h, 1,
                                        t0 + i * BC, Hv, K, BC, DOT_PREC)
                b_a += b_a1
                b_r += b_r1
                b_a = tl.where(o_i[:, None] > o_j[None, :], b_a, 0.0)
                b_r = tl.where(o_i[:, None] >= o_j[None, :], b_r, 0.0)
            else:
                b_a = tl.zeros([BC, BC], dtype=tl.float32)
                b_r = tl.zeros([BC, BC], dtype=tl.float32)
            store_block(ascr, b_a, t0 + i * BC, m_i, i_h, j * BC, Hv, BT, BC)
            store_block(rmat, b_r, t0 + i * BC, m_i, i_h, j * BC, Hv, BT, BC)
    tl.debug_barrier()

    # T = (I + A)^-1: diagonal blocks by substitution, the rest by block products.
    o_0 = t0 + o_c
    o_1 = o_0 + BC
    o_2 = o_1 + BC
    o_3 = o_2 + BC
    m_0, m_1, m_2, m_3 = o_0 < eos, o_1 < eos, o_2 < eos, o_3 < eos
    t00 = _unit_lower_inverse(ascr, t0 + 0 * BC, m_0, i_h, 0, Hv, BT, BC)
    t11 = _unit_lower_inverse(ascr, t0 + 1 * BC, m_1, i_h, BC, Hv, BT, BC)
    t22 = _unit_lower_inverse(ascr, t0 + 2 * BC, m_2, i_h, 2 * BC, Hv, BT, BC)
    t33 = _unit_lower_inverse(ascr, t0 + 3 * BC, m_3, i_h, 3 * BC, Hv, BT, BC)
    a10 = load_block(ascr, t0 + 1 * BC, m_1, i_h, 0, Hv, BT, BC)
    a20 = load_block(ascr, t0 + 2 * BC, m_2, i_h, 0, Hv, BT, BC)
    a21 = load_block(ascr, t0 + 2 * BC, m_2, i_h, BC, Hv, BT, BC)
    a30 = load_block(ascr, t0 + 3 * BC, m_3, i_h, 0, Hv, BT, BC)
    a31 = load_block(ascr, t0 + 3 * BC, m_3, i_h, BC, Hv, BT, BC)
    a32 = load_block(ascr, t0 + 3 * BC, m_3, i_h, 2 * BC, Hv, BT, BC)
    t10 = -tl.dot(t11, tl.dot(a10, t00, input_precision="ieee"), input_precision="ieee")
    t21 = -tl.dot(t22, tl.dot(a21, t11, input_precision="ieee"), input_precision="ieee")
    t20 = -tl.dot(
        t22,
        tl.dot(a20, t00, input_precision="ieee") + tl.dot(a21, t10, input_precision="ieee"),
        input_precision="ieee",
    )
    t32 = -tl.dot(t33, tl.dot(a32, t22, input_precision="ieee"), input_precision="ieee")
    t31 = -tl.dot(
        t33,
        tl.dot(a31, t11, input_precision="ieee") + tl.dot(a32, t21, input_precision="ieee"),
        input_precision="ieee",
    )
    t30 = -tl.dot(
        t33,
        tl.dot(a30, t00, input_precision="ieee")
        + tl.dot(a31, t10, input_precision="ieee")
        + tl.dot(a32, t20, input_precision="ieee"),
        input_precision="ieee",
    )
    b_zero = tl.zeros([BC, BC], dtype=tl.float32)
    store_block(tmat, t00, t0 + 0 * BC, m_0, i_h, 0, Hv, BT, BC)
    store_block(tmat, b_zero, t0 + 0 * BC, m_0, i_h, BC, Hv, BT, BC)
    store_block(tmat, t10, t0 + 1 * BC, m_1, i_h, 0, Hv, BT, BC)
    store_block(tmat, t11, t0 + 1 * BC, m_1, i_h, BC, Hv, BT, BC)
    store_block(tmat, t20, t0 + 2 * BC, m_2, i_h, 0, Hv, BT, BC)
    store_block(tmat, t21, t0 + 2 * BC, m_2, i_h, BC, Hv, BT, BC)
    store_block(tmat, t22, t0 + 2 * BC, m_2, i_h, 2 * BC, Hv, BT, BC)
    store_block(tmat, t30, t0 + 3 * BC, m_3, i_h, 0, Hv, BT, BC)
    store_block(tmat, t31, t0 + 3 * BC, m_3, i_h, BC, Hv, BT, BC)
    store_block(tmat, t32, t0 + 3 * BC, m_3, i_h, 2 * BC, Hv, BT, BC)
    store_block(tmat, t33, t0 + 3 * BC, m_3, i_h, 3 * BC, Hv, BT, BC)
    for j in tl.static_range(2, BT // BC):
        store_block(tmat, b_zero, t0 + 0 * BC, m_0, i_h, j * BC, Hv, BT, BC)
    for j in tl.static_range(2, BT // BC):
        store_block(tmat, b_zero, t0 + 1 * BC, m_1, i_h, j * BC, Hv, BT, BC)
    store_block(tmat, b_zero, t0 + 2 * BC, m_2, i_h, 3 * BC, Hv, BT, BC)

    # Wk = T (k e^c), U = T v, block rows.
    _block_row_product(wk, kd, t00, t00, t00, t00, eos, t0, i_h, 1, Hv, K, BC, DOT_PREC)
    _block_row_product(wk, kd, t10, t11, t11, t11, eos, t0, i_h, 2, Hv, K, BC, DOT_PREC)
    _block_row_product(wk, kd, t20, t21, t22, t22, eos, t0, i_h, 3, Hv, K, BC, DOT_PREC)
    _block_row_product(wk, kd, t30, t31, t32, t33, eos, t0, i_h, 4, Hv, K, BC, DOT_PREC)
    _block_row_product(u, v, t00, t00, t00, t00, eos, t0, i_h, 1, Hv, V, BC, DOT_PREC)
    _block_row_product(u, v, t10, t11, t11, t11, eos, t0, i_h, 2, Hv, V, BC, DOT_PREC)
    _block_row_product(u, v, t20, t21, t22, t22, eos, t0, i_h, 3, Hv, V, BC, DOT_PREC)
    _block_row_product(u, v, t30, t31, t32, t33, eos, t0, i_h, 4, Hv, V, BC, DOT_PREC)


@triton.jit
def _block_row_product(out, src, t_0, t_1, t_2, t_3, eos, t0, i_h, NB: tl.constexpr,
                       Hv: tl.constexpr, D: tl.constexpr, BC: tl.constexpr, DOT_PREC: tl.constexpr):
    """Store at block row ``NB - 1`` of the chunk: ``sum_{j < NB} t_j @ src_j``.

    ``src_j`` is the j-th 16-row block of the chunk starting at token ``t0``.
    """
    o_c = tl.arange(0, BC)
    b_acc = tl.dot(t_0, load_rows(src, t0, o_c, t0 + o_c < eos, i_h, Hv, D),
                   input_precision=DOT_PREC)
    if NB > 1:
        b_acc += tl.dot(t_1, load_rows(src, t0 + BC, o_c, t0 + BC + o_c < eos, i_h, Hv, D),
                        input_precision=DOT_PREC)
    if NB > 2:
        b_acc += tl.dot(t_2, load_rows(src, t0 + 2 * BC, o_c, t0 + 2 * BC + o_c < eos, i_h, Hv, D),
                        input_precision=DOT_PREC)
    if NB > 3:
        b_acc += tl.dot(t_3, load_rows(src, t0 + 3 * BC, o_c, t0 + 3 * BC + o_c < eos, i_h, Hv, D),
                        input_precision=DOT_PREC)
    t_row = t0 + (NB - 1) * BC
    store_rows(out, b_acc, t_row, o_c, t_row + o_c < eos, i_h, Hv, D)


@triton.jit
def _two_key_fwd_state_kernel(
    wk, u, wl, c, h, x, h0, ht,
    cu_seqlens, chunk_first, s_k, s_v,
    Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # One flat grid axis (value tiles fastest): sequences x heads can exceed 65535, the
    # limit of CUDA's second grid axis.
    i_v, i_nh = tl.program_id(0) % (V // BV), tl.program_id(0) // (V // BV)
    i_n, i_h = i_nh // Hv, i_nh % Hv
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    # State slots: each sequence owns one per chunk start plus one for its end.
    slot = tl.load(chunk_first + i_n).to(tl.int64) + i_n
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
        tl.store(h + ((slot + j) * Hv + i_h) * K * V + p_slot, b_s.to(h.dtype.element_ty))
        b_wk = tl.load(wk + (t0 * Hv + i_h) * K + p_kt, mask=m_t[:, None], other=0.0)
        b_x = tl.load(u + (t0 * Hv + i_h) * V + p_vt, mask=m_t[:, None], other=0.0).to(tl.float32)
        b_x -= tl.dot(b_wk, b_s.to(b_wk.dtype), input_precision=DOT_PREC)
        tl.store(x + (t0 * Hv + i_h) * V + p_vt, b_x.to(x.dtype.element_ty), mask=m_t[:, None])
        b_wl = tl.load(wl + (t0 * Hv + i_h) * K + p_kt, mask=m_t[:, None], other=0.0)
        b_el = tl.exp(load_row(c, last, eos, i_h, Hv, K))
        b_s = b_s * b_el[:, None] + tl.dot(tl.trans(b_wl), b_x.to(b_wl.dtype),
                                           input_precision=DOT_PREC)
    p_end = ((slot + tl.cdiv(eos - bos, BT)) * Hv + i_h) * K * V
    tl.store(h + p_end + p_slot, b_s.to(h.dtype.element_ty))
    tl.store(ht + i_nh.to(tl.int64) * K * V + p_state, b_s)


@triton.jit
def _two_key_fwd_output_kernel(
    qd, h, rmat, x, o,
    cu_seqlens, chunk_seq, chunk_first, N, scale,
    Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr,
):
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    i_c, i_v, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n = tl.load(chunk_seq + i_c)
    if i_n >= N:
        return
    # index loads in the kernel body, not a helper: see _launch.py on mutation analysis
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    t0 = bos + (i_c - tl.load(chunk_first + i_n)).to(tl.int64) * BT
    o_bt = tl.arange(0, BT)
    m_t = (t0 + o_bt) < eos
    o_v = i_v * BV + tl.arange(0, BV)
    p_h = h + ((i_c + i_n).to(tl.int64) * Hv + i_h) * K * V
    p_x = (t0 * Hv + i_h) * V + (o_bt[:, None] * (Hv * V) + o_v[None, :])
    b_x = tl.load(x + p_x, mask=m_t[:, None], other=0.0)
    b_r = load_rows(rmat, t0, o_bt, m_t, i_h, Hv, BT).to(b_x.dtype)
    b_o = tl.dot(b_r, b_x, input_precision=DOT_PREC)
    for i_k in range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_h = tl.load(p_h + o_k[:, None] * V + o_v[None, :])
        p_qd = qd + (t0 * Hv + i_h) * K + (o_bt[:, None] * (Hv * K) + o_k[None, :])
        b_qd = tl.load(p_qd, mask=m_t[:, None], other=0.0)
        b_o += tl.dot(b_qd, b_h, input_precision=DOT_PREC)
    tl.store(o + p_x, (scale * b_o).to(o.dtype.element_ty), mask=m_t[:, None])


def _tokens_major(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-2], t.shape[-1]).contiguous()


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
) -> tuple[torch.Tensor, ...]:
    """Chunked two-key delta rule with per-key decay on the GPU (or the Triton interpreter).

    Args:
        q, k: ``[B, T, Hk, K]`` read and erase keys; value head ``h`` reads key
            head ``h // (Hv // Hk)`` (the repeat is never materialized).
        w: ``[B, T, Hv, K]`` write keys (``beta k`` for KDA, the Kalman gain for Diag-KDN).
        v: ``[B, T, Hv, V]`` values.
        log_decay: ``[B, T, Hv, K]`` natural-log decays, each ``>= -20`` (see
            :mod:`two_key_common`); any float dtype.
        initial_state: ``[N, Hv, K, V]`` (``[N, Hv, V, K]`` with ``state_v_first``) or None.
        cu_seqlens: ``[N + 1]`` int32/int64 packed boundaries on the device (``B == 1``) or None.
        chunk_size: must be 64 (see :func:`two_key_kernel_supports`).
        scale: output scale.
        state_v_first: layout of ``initial_state`` and the final state.

    Returns:
        ``(o, final_state, c, qd, kd, wl, tmat, rmat, h, x, chunk_seq, chunk_first)``:
        ``o`` like ``v``; ``final_state`` float32 in the state layout; the rest are
        saved for :func:`two_key_bwd`: float32 cumulative decay ``c``; ``q e^c``,
        ``k e^c``, ``w e^{c_last - c}`` per value head; the inverse ``T`` and the
        readout ``R`` per chunk row; the states at every chunk boundary
        ``h`` (one slot per chunk start plus one per sequence end); the innovations
        ``x``; the chunk map.

    Raises:
        ValueError: inputs that :func:`two_key_kernel_supports` does not cover.

    Source of the math: :func:`kdn_compile.reference.two_key_chunk_recurrence`.
    """
    require_two_key_kernels(q, v, chunk_size)
    batch, length, hk, key_dim = q.shape
    hv, value_dim = v.shape[2], v.shape[3]
    dt = compute_dtype(q.dtype)
    prec = dot_precision(q.dtype)
    bounds, num_seqs = sequence_bounds(batch, length, cu_seqlens, q.device)
    num_chunks = num_chunks_bound(batch, length, num_seqs, cu_seqlens is not None)
    chunk_seq, chunk_first = chunk_map(bounds, num_chunks)
    qf, kf, wf, vf, gf = (_tokens_major(t) for t in (q, k, w, v, log_decay))
    tokens = batch * length
    c = q.new_empty((tokens, hv, key_dim), dtype=torch.float32)
    qd, kd, wl = (q.new_empty((tokens, hv, key_dim), dtype=dt) for _ in range(3))
    ascr = q.new_empty((tokens, hv, BT), dtype=torch.float32)
    tmat = q.new_empty((tokens, hv, BT), dtype=dt)
    rmat = q.new_empty((tokens, hv, BT), dtype=dt)
    wk = q.new_empty((tokens, hv, key_dim), dtype=dt)
    u = q.new_empty((tokens, hv, value_dim), dtype=dt)
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

    wrap_triton(_two_key_fwd_intra_kernel)[(num_chunks, hv)](
        qf, kf, wf, vf, gf, c, qd, kd, wl, ascr, tmat, rmat, wk, u,
        bounds, chunk_seq, chunk_first, num_seqs,
        Hk=hk, Hv=hv, K=key_dim, V=value_dim, BT=BT, BC=BC, DOT_PREC=prec,
        # 8 warps: 232 registers and no spill (ptxas, sm_90, bf16, K=V=128) where 4
        # warps spilled; with 4 warps and a 16-step substitution per diagonal block
        # this kernel took 4.5 of 5.3 ms of the forward at 8x4096x16 on the H200.
        num_warps=8, num_stages=2,
    )
    block_v = min(64, value_dim)
    # 32-wide value tiles: twice the programs of 64 for the sequential pass and
    # no spills (ptxas, sm_90: 140 registers at BV=32, 236 at BV=64).
    state_v = min(32, value_dim)
    wrap_triton(_two_key_fwd_state_kernel)[(triton.cdiv(value_dim, state_v) * num_seqs * hv,)](
        wk, u, wl, c, h, x, h0, final_state,
        bounds, chunk_first, s_k, s_v,
        Hv=hv, K=key_dim, V=value_dim, BT=BT, BV=state_v,
        HAS_H0=initial_state is not None, DOT_PREC=prec,
        num_warps=4, num_stages=2 if dt != torch.float32 else 1,
    )
    wrap_triton(_two_key_fwd_output_kernel)[(num_chunks, triton.cdiv(value_dim, block_v), hv)](
        qd, h, rmat, x, o,
        bounds, chunk_seq, chunk_first, num_seqs, scale,
        Hv=hv, K=key_dim, V=value_dim, BT=BT, BK=min(64, key_dim), BV=block_v,
        DOT_PREC=prec, num_warps=4, num_stages=2,
    )
    return (o, final_state, c, qd, kd, wl, tmat, rmat, h, x, chunk_seq, chunk_first)
