"""Token-loop variants of the per-chunk Kalman gain kernels (one warp per chunk and head).

Same stages as ``kalman_gain_fwd`` / ``kalman_gain_bwd`` but each chunk is
walked token by token with all ``K`` channels in one warp, instead of an
in-chunk prefix scan. The backward's forward sweep keeps ``p_{t-1}`` in a
scratch ``[B, T, H, K]`` that the reverse sweep reads back.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kdn_compile.lowering.kalman_gain_fwd import _chunk_bounds


@triton.jit
def _token_mask(t, eos, o_k, K):
    """Channels ``o_k < K`` of token ``t`` when ``t < eos`` (a vector mask)."""
    return o_k < tl.where(t < eos, K, 0)


@triton.jit
def _token_inputs(k, log_alpha, omega, r, t, eos, o_k, m_k, H, K):
    """``(k, a^2, omega, r)`` of token ``t`` (zeros / identity past ``eos``)."""
    m = _token_mask(t, eos, o_k, K)
    o = t * H * K + o_k
    b_k = tl.load(k + o, mask=m, other=0.0).to(tl.float32)
    b_a2 = tl.exp(2.0 * tl.load(log_alpha + o, mask=m, other=0.0).to(tl.float32))
    b_w = tl.load(omega + o, mask=m, other=0.0).to(tl.float32)
    # Past eos the key is zero, so r only needs to be finite: read the last token's.
    b_r = tl.load(r + tl.minimum(t, eos - 1) * H).to(tl.float32)
    return b_k, b_a2, b_w, b_r


@triton.jit
def _kalman_gain_token_map_kernel(
    k, log_alpha, omega, r, maps, cu_seqlens, chunk_seq, chunk_offsets,
    info_scale, T, NT, H, K,
    BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """Product of the covariance maps of one chunk, walking its tokens."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_c = i_c.to(tl.int64)
    i_n, t0, eos = _chunk_bounds(i_c, cu_seqlens, chunk_seq, chunk_offsets, T, NT, BT, IS_VARLEN)
    if t0 >= eos:
        return
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_00 = tl.full([BK], 1.0, tl.float32)
    b_01 = tl.zeros([BK], tl.float32)
    b_10 = tl.zeros([BK], tl.float32)
    b_11 = tl.full([BK], 1.0, tl.float32)
    for i in range(0, BT):
        b_k, b_a2, b_w, b_r = _token_inputs(k + i_h * K, log_alpha + i_h * K, omega + i_h * K,
                                            r + i_h, t0 + i, eos, o_k, m_k, H, K)
        b_i = info_scale * b_k * b_k / b_r
        # [[a2, w], [I a2, 1 + I w]] @ current
        c00 = b_a2 * b_00 + b_w * b_10
        c01 = b_a2 * b_01 + b_w * b_11
        c10 = b_i * c00 + b_10
        c11 = b_i * c01 + b_11
        s = 1.0 / (c00 + c01 + c10 + c11)
        b_00, b_01, b_10, b_11 = c00 * s, c01 * s, c10 * s, c11 * s
    p_m = maps + (i_c * H + i_h) * 4 * K + o_k
    tl.store(p_m, b_00, mask=m_k)
    tl.store(p_m + K, b_01, mask=m_k)
    tl.store(p_m + 2 * K, b_10, mask=m_k)
    tl.store(p_m + 3 * K, b_11, mask=m_k)


@triton.jit
def _kalman_gain_token_fwd_kernel(
    k, log_alpha, omega, r, chunk_cov, gain, cu_seqlens, chunk_seq, chunk_offsets,
    info_scale, T, NT, H, K,
    BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """Gains of one chunk and head, walking its tokens from the entering covariance."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_c = i_c.to(tl.int64)
    i_n, t0, eos = _chunk_bounds(i_c, cu_seqlens, chunk_seq, chunk_offsets, T, NT, BT, IS_VARLEN)
    if t0 >= eos:
        return
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_p = tl.load(chunk_cov + (i_c * H + i_h) * K + o_k, mask=m_k, other=1.0)
    for i in range(0, BT):
        t = t0 + i
        b_k, b_a2, b_w, b_r = _token_inputs(k + i_h * K, log_alpha + i_h * K, omega + i_h * K,
                                            r + i_h, t, eos, o_k, m_k, H, K)
        b_ph = b_a2 * b_p + b_w
        b_d = b_r + tl.sum(b_ph * b_k * b_k, 0)
        tl.store(gain + t * H * K + i_h * K + o_k, b_ph * b_k / b_d, mask=_token_mask(t, eos, o_k, K))
        b_p = b_ph / (1.0 + info_scale * b_k * b_k / b_r * b_ph)


@triton.jit
def _kalman_gain_token_bwd_map_kernel(
    k, log_alpha, omega, r, chunk_cov, dgain, adj_maps, prev_cov,
    cu_seqlens, chunk_seq, chunk_offsets,
    info_scale, T, NT, H, K,
    BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """Composed adjoint map of one chunk (forward sweep); keeps ``p_{t-1}`` in ``prev_cov``."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_c = i_c.to(tl.int64)
    i_n, t0, eos = _chunk_bounds(i_c, cu_seqlens, chunk_seq, chunk_offsets, T, NT, BT, IS_VARLEN)
    if t0 >= eos:
        return
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_p = tl.load(chunk_cov + (i_c * H + i_h) * K + o_k, mask=m_k, other=1.0)
    b_a = tl.full([BK], 1.0, tl.float32)
    b_b = tl.zeros([BK], tl.float32)
    for i in range(0, BT):
        t = t0 + i
        b_k, b_a2, b_w, b_r = _token_inputs(k + i_h * K, log_alpha + i_h * K, omega + i_h * K,
                                            r + i_h, t, eos, o_k, m_k, H, K)
        o = t * H * K + i_h * K + o_k
        m = _token_mask(t, eos, o_k, K)
        b_u = tl.load(dgain + o, mask=m, other=0.0).to(tl.float32)
        tl.store(prev_cov + o, b_p, mask=m)
        b_ph = b_a2 * b_p + b_w
        b_rho = 1.0 / (1.0 + info_scale * b_k * b_k / b_r * b_ph)
        b_d = b_r + tl.sum(b_ph * b_k * b_k, 0)
        b_c = tl.sum(b_u * b_ph * b_k, 0) / b_d
        b_e = b_k * (b_u - b_c * b_k) / b_d
        # current (applied last) after G_t = (a2 rho^2, a2 e)
        b_b = b_a * b_a2 * b_e + b_b
        b_a = b_a * b_a2 * b_rho * b_rho
        b_p = b_ph * b_rho
    p_m = adj_maps + (i_c * H + i_h) * 2 * K + o_k
    tl.store(p_m, b_a, mask=m_k)
    tl.store(p_m + K, b_b, mask=m_k)


@triton.jit
def _kalman_gain_token_bwd_kernel(
    k, log_alpha, omega, r, prev_cov, chunk_adj, dgain,
    dk, dlog_alpha, domega, dr, cu_seqlens, chunk_seq, chunk_offsets,
    info_scale, T, NT, H, K,
    BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """Gradients of one chunk and head, walking its tokens in reverse."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_c = i_c.to(tl.int64)
    i_n, t0, eos = _chunk_bounds(i_c, cu_seqlens, chunk_seq, chunk_offsets, T, NT, BT, IS_VARLEN)
    if t0 >= eos:
        return
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_lam = tl.load(chunk_adj + (i_c * H + i_h) * K + o_k, mask=m_k, other=0.0)
    for i in range(0, BT):
        t = t0 + BT - 1 - i
        b_k, b_a2, b_w, b_r = _token_inputs(k + i_h * K, log_alpha + i_h * K, omega + i_h * K,
                                            r + i_h, t, eos, o_k, m_k, H, K)
        o = t * H * K + i_h * K + o_k
        m = _token_mask(t, eos, o_k, K)
        b_u = tl.load(dgain + o, mask=m, other=0.0).to(tl.float32)
        b_prev = tl.load(prev_cov + o, mask=m, other=1.0)
        b_ph = b_a2 * b_prev + b_w
        b_i = info_scale * b_k * b_k / b_r
        b_rho = 1.0 / (1.0 + b_i * b_ph)
        b_d = b_r + tl.sum(b_ph * b_k * b_k, 0)
        b_c = tl.sum(b_u * b_ph * b_k, 0) / b_d
        b_lp = b_lam * (b_ph * b_rho) * (b_ph * b_rho)
        b_mu = b_rho * b_rho * b_lam + b_k * (b_u - b_c * b_k) / b_d
        tl.store(domega + o, b_mu, mask=m)
        tl.store(dlog_alpha + o, 2.0 * b_a2 * b_prev * b_mu, mask=m)
        b_dk = b_ph * (b_u - 2.0 * b_c * b_k) / b_d - 2.0 * info_scale * b_k * b_lp / b_r
        tl.store(dk + o, b_dk, mask=m)
        b_dr = -b_c / b_d + tl.sum(b_lp * b_i, 0) / b_r
        o_1 = tl.arange(0, 1)
        tl.store(dr + t * H + i_h + o_1, b_dr + tl.zeros([1], tl.float32), mask=_token_mask(t, eos, o_1, 1))
        b_lam = b_a2 * b_mu
