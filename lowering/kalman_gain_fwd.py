"""Triton kernels of the Diag-KDN Kalman gain, forward.

Per key channel the covariance step ``p -> (a^2 p + w) / (I a^2 p + 1 + I w)``
(``a^2 = exp(2 log_alpha)``, ``I = info_scale k^2 / r``) is the Mobius map of
the 2x2 matrix ``[[a^2, w], [I a^2, 1 + I w]]``, whose entries are all
non-negative, so products of such matrices have no cancellation. The scan runs
in three stages over chunks of ``BT`` tokens:

1. ``_kalman_gain_chunk_map_kernel``: each chunk's product of maps (parallel).
2. ``_kalman_gain_chunk_scan_kernel``: the covariance entering each chunk,
   a scan over chunk products per sequence, plus the final covariance.
3. ``_kalman_gain_fwd_kernel``: each chunk again, now from its entering
   covariance: the covariances ``p_{t-1}`` by an in-chunk prefix scan of the
   maps of the previous tokens (loaded one row shifted), then
   ``p_hat = a^2 p_{t-1} + w`` and the gains (parallel).

Products are rescaled by the sum of their entries (a Mobius map ignores scale)
so long products stay finite. Maps are stored ``[NC, H, 4, K]`` (float32), one
slot per chunk; covariances entering chunks ``[NC, H, K]``.
Source: the Diag-KDN specification (``shared/spec``), ``kdn_compile.reference.kdn``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _mobius_combine(a00, a01, a10, a11, b00, b01, b10, b11):
    """Map ``a`` then map ``b``: the matrix ``b @ a``, rescaled to unit entry sum."""
    c00 = b00 * a00 + b01 * a10
    c01 = b00 * a01 + b01 * a11
    c10 = b10 * a00 + b11 * a10
    c11 = b10 * a01 + b11 * a11
    s = 1.0 / (c00 + c01 + c10 + c11)
    return c00 * s, c01 * s, c10 * s, c11 * s


@triton.jit
def _chunk_bounds(i_c, cu_seqlens, chunk_seq, chunk_offsets, T, NT,
                  BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """``(sequence, first token of the chunk, end of the sequence)`` of chunk slot ``i_c``.

    Fixed length: ``NT`` chunks per sequence of ``T`` tokens. Varlen: the slot's
    sequence comes from ``chunk_seq`` (``N`` for unused slots, whose ``bos`` is
    returned past ``eos`` so the caller does nothing).
    """
    if IS_VARLEN:
        i_n = tl.load(chunk_seq + i_c).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        i_t = i_c - tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        i_n = i_c // NT
        bos = i_n * T
        eos = bos + T
        i_t = i_c % NT
    return i_n, bos + i_t * BT, eos


@triton.jit
def _load_maps(k, log_alpha, omega, r, o_t, m_t, o_k, m_k, info_scale, H, K):
    """Step maps of tokens ``o_t`` (``[BT, BK]``); masked rows are the identity."""
    m = m_t[:, None] & m_k[None, :]
    o = (o_t * H * K)[:, None] + o_k[None, :]
    b_k = tl.load(k + o, mask=m, other=0.0).to(tl.float32)
    b_a2 = tl.exp(2.0 * tl.load(log_alpha + o, mask=m, other=0.0).to(tl.float32))
    b_w = tl.load(omega + o, mask=m, other=0.0).to(tl.float32)
    b_r = tl.load(r + o_t * H, mask=m_t, other=1.0).to(tl.float32)
    b_i = info_scale * b_k * b_k / b_r[:, None]
    return b_a2, b_w, b_i * b_a2, 1.0 + b_i * b_w


@triton.jit
def _kalman_gain_chunk_map_kernel(
    k, log_alpha, omega, r, maps, cu_seqlens, chunk_seq, chunk_offsets,
    info_scale, T, NT, H, K,
    BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """Product of the covariance maps of one chunk, for ``BK`` channels of one head."""
    i_c, i_h, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_c = i_c.to(tl.int64)
    i_n, t0, eos = _chunk_bounds(i_c, cu_seqlens, chunk_seq, chunk_offsets, T, NT, BT, IS_VARLEN)
    if t0 >= eos:
        return
    o_t = t0 + tl.arange(0, BT)
    m_t = o_t < eos
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    b_00, b_01, b_10, b_11 = _load_maps(
        k + i_h * K, log_alpha + i_h * K, omega + i_h * K, r + i_h,
        o_t, m_t, o_k, m_k, info_scale, H, K)
    b_00, b_01, b_10, b_11 = tl.associative_scan((b_00, b_01, b_10, b_11), 0, _mobius_combine)
    last = (tl.arange(0, BT) == BT - 1)[:, None]
    p_m = maps + (i_c * H + i_h) * 4 * K + o_k
    tl.store(p_m, tl.sum(tl.where(last, b_00, 0.0), 0), mask=m_k)
    tl.store(p_m + K, tl.sum(tl.where(last, b_01, 0.0), 0), mask=m_k)
    tl.store(p_m + 2 * K, tl.sum(tl.where(last, b_10, 0.0), 0), mask=m_k)
    tl.store(p_m + 3 * K, tl.sum(tl.where(last, b_11, 0.0), 0), mask=m_k)


@triton.jit
def _kalman_gain_chunk_scan_kernel(
    precision, maps, chunk_cov, final_cov, final_precision, cu_seqlens, chunk_offsets,
    T, NT, H, K,
    BC: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """Covariance entering every chunk of one sequence, ``BC`` chunks per scan step."""
    i_n, i_h, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n = i_n.to(tl.int64)
    if IS_VARLEN:
        c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
        n_c = tl.load(chunk_offsets + i_n + 1).to(tl.int64) - c0
    else:
        c0 = i_n * NT
        n_c = (i_n + 1) * NT - c0
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    o_s = (i_n * H + i_h) * K + o_k
    b_p = 1.0 / tl.load(precision + o_s, mask=m_k, other=1.0).to(tl.float32)
    if n_c > 0:
        tl.store(chunk_cov + (c0 * H + i_h) * K + o_k, b_p, mask=m_k)
    for i_b in range(0, tl.cdiv(n_c, BC)):
        o_c = i_b * BC + tl.arange(0, BC)
        m_c = o_c < n_c
        m = m_c[:, None] & m_k[None, :]
        p_m = maps + (((c0 + o_c) * H + i_h) * 4 * K)[:, None] + o_k[None, :]
        b_00 = tl.load(p_m, mask=m, other=1.0)
        b_01 = tl.load(p_m + K, mask=m, other=0.0)
        b_10 = tl.load(p_m + 2 * K, mask=m, other=0.0)
        b_11 = tl.load(p_m + 3 * K, mask=m, other=1.0)
        b_00, b_01, b_10, b_11 = tl.associative_scan((b_00, b_01, b_10, b_11), 0, _mobius_combine)
        b_out = (b_00 * b_p[None, :] + b_01) / (b_10 * b_p[None, :] + b_11)
        # The covariance leaving chunk c enters chunk c + 1.
        m_next = (o_c + 1 < n_c)[:, None] & m_k[None, :]
        tl.store(chunk_cov + (((c0 + o_c + 1) * H + i_h) * K)[:, None] + o_k[None, :],
                 b_out, mask=m_next)
        b_p = tl.sum(tl.where((tl.arange(0, BC) == BC - 1)[:, None], b_out, 0.0), 0)
    tl.store(final_cov + o_s, b_p, mask=m_k)
    tl.store(final_precision + o_s, 1.0 / b_p, mask=m_k)


@triton.jit
def _chunk_covariances(k, log_alpha, omega, r, chunk_cov, i_c, o_t, m_t, o_k, m_k,
                       info_scale, H, K):
    """``(p_{t-1}, a^2_t, k_t, w_t, r_t)`` of the chunk's tokens from its entering covariance."""
    o_0 = tl.arange(0, o_t.shape[0])
    b_00, b_01, b_10, b_11 = _load_maps(
        k, log_alpha, omega, r, o_t - 1, m_t & (o_0 > 0), o_k, m_k, info_scale, H, K)
    b_00, b_01, b_10, b_11 = tl.associative_scan((b_00, b_01, b_10, b_11), 0, _mobius_combine)
    b_p0 = tl.load(chunk_cov + i_c * H * K + o_k, mask=m_k, other=1.0)[None, :]
    b_prev = (b_00 * b_p0 + b_01) / (b_10 * b_p0 + b_11)
    m = m_t[:, None] & m_k[None, :]
    o = (o_t * H * K)[:, None] + o_k[None, :]
    b_k = tl.load(k + o, mask=m, other=0.0).to(tl.float32)
    b_a2 = tl.exp(2.0 * tl.load(log_alpha + o, mask=m, other=0.0).to(tl.float32))
    b_w = tl.load(omega + o, mask=m, other=0.0).to(tl.float32)
    b_r = tl.load(r + o_t * H, mask=m_t, other=1.0).to(tl.float32)
    return b_prev, b_a2, b_k, b_w, b_r


@triton.jit
def _kalman_gain_fwd_kernel(
    k, log_alpha, omega, r, chunk_cov, gain, cu_seqlens, chunk_seq, chunk_offsets,
    info_scale, T, NT, H, K,
    BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """Gains ``kappa_t = p_hat_t k_t / (r_t + sum_i p_hat_ti k_ti^2)`` of one chunk and head."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_c = i_c.to(tl.int64)
    i_n, t0, eos = _chunk_bounds(i_c, cu_seqlens, chunk_seq, chunk_offsets, T, NT, BT, IS_VARLEN)
    if t0 >= eos:
        return
    o_t = t0 + tl.arange(0, BT)
    m_t = o_t < eos
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_prev, b_a2, b_k, b_w, b_r = _chunk_covariances(
        k + i_h * K, log_alpha + i_h * K, omega + i_h * K, r + i_h, chunk_cov + i_h * K,
        i_c, o_t, m_t, o_k, m_k, info_scale, H, K)
    b_ph = b_a2 * b_prev + b_w
    b_d = b_r + tl.sum(b_ph * b_k * b_k, 1)
    o = (o_t * H * K)[:, None] + (i_h * K + o_k)[None, :]
    tl.store(gain + o, b_ph * b_k / b_d[:, None], mask=m_t[:, None] & m_k[None, :])
