"""Triton kernels of the Diag-KDN Kalman gain, forward.

Per key channel the covariance step ``p -> (a^2 p + w) / (I a^2 p + 1 + I w)``
(``a^2 = exp(2 log_alpha)``, ``I = info_scale k^2 / r``) is the Mobius map of
the 2x2 matrix ``[[a^2, w], [I a^2, 1 + I w]]``, divided by ``max(1, I)`` as it
is formed (``I`` overflows float32 for a tiny ``r``, ``I w`` for a huge ``w``). Its
entries are all non-negative, so products of such matrices have no cancellation. Three stages
over chunks of ``BT`` tokens:

1. ``_kalman_gain_chunk_map_kernel``: each chunk's product of maps, walking
   its tokens (all chunks in parallel).
2. ``_kalman_gain_chunk_scan_kernel``: the covariance entering each chunk, a
   prefix scan over the chunk products of each sequence (``BC`` at a time),
   and the final precision.
3. ``_kalman_gain_fwd_kernel``: each chunk again from its entering covariance,
   token by token: ``p_hat``, the gain (a sum over ``K`` per token) and ``p``.

One warp walks one chunk of one head with all ``K`` channels, so the sum over
``K`` is a warp reduction; loads are software-pipelined ``NUM_STAGES`` deep.
Products are rescaled to unit entry sum (a Mobius map ignores scale). Chunk
maps are stored ``[NC, H, 4, K]``, entering covariances ``[NC, H, K]``
(float32), one slot per chunk.
Source: :mod:`kdn_compile.reference.kdn` (the math: ``docs/math.rst``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kdn_compile.lowering._launch import fixed_chunk


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
def _token_mask(t, eos, o_k, K):
    """Channels ``o_k < K`` of token ``t`` when ``t < eos`` (a vector mask)."""
    return o_k < tl.where(t < eos, K, 0)


@triton.jit
def _token_inputs(k, log_alpha, omega, r, t, eos, o_k, H, K, info_scale):
    """``(k, a^2, omega, r, info_scale k^2, min(I, 1), min(1, 1 / I))`` of token ``t``; past
    ``eos`` an identity step. ``I = info_scale k^2 / r`` itself is never formed: it overflows
    float32 for a tiny ``r``; the covariance step divided by ``max(1, I)`` is the same map."""
    m = _token_mask(t, eos, o_k, K)
    o = t * H * K + o_k
    b_k = tl.load(k + o, mask=m, other=0.0).to(tl.float32)
    b_a2 = tl.exp(2.0 * tl.load(log_alpha + o, mask=m, other=0.0).to(tl.float32))
    b_w = tl.load(omega + o, mask=m, other=0.0).to(tl.float32)
    # Past eos the key is zero, so r only needs to be finite: read the last token's.
    b_r = tl.load(r + tl.minimum(t, eos - 1) * H).to(tl.float32)
    b_kk = info_scale * b_k * b_k
    large = b_kk > b_r
    return (b_k, b_a2, b_w, b_r, b_kk, tl.where(large, 1.0, b_kk / b_r),
            tl.where(large, b_r / b_kk, 1.0))


@triton.jit
def _kalman_gain_chunk_map_kernel(
    k, log_alpha, omega, r, maps, spans, info_scale, T, H, K,
    BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Product of the covariance maps of one chunk of one head."""
    info_scale = tl.cast(info_scale, tl.float32)  # Inductor passes Python floats as fp64
    i_c, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if IS_VARLEN:  # index loads in the kernel body: see _launch.py
        t0 = tl.load(spans + 3 * i_c).to(tl.int64)
        eos = tl.load(spans + 3 * i_c + 1).to(tl.int64)
    else:
        t0, eos = fixed_chunk(i_c, T, BT)
    if t0 >= eos:
        return
    o_k = tl.arange(0, BK)
    b_00 = tl.full([BK], 1.0, tl.float32)
    b_01 = tl.zeros([BK], tl.float32)
    b_10 = tl.zeros([BK], tl.float32)
    b_11 = tl.full([BK], 1.0, tl.float32)
    for i in tl.range(0, BT, num_stages=NUM_STAGES):
        b_k, b_a2, b_w, b_r, b_kk, b_i, b_inv = _token_inputs(
            k + i_h * K, log_alpha + i_h * K, omega + i_h * K, r + i_h, t0 + i, eos,
            o_k, H, K, info_scale)
        # [[1, 0], [I, 1]] @ [[a^2, w], [0, 1]] @ product, divided by max(1, I)
        c00 = b_a2 * b_00 + b_w * b_10
        c01 = b_a2 * b_01 + b_w * b_11
        c10 = b_i * c00 + b_inv * b_10
        c11 = b_i * c01 + b_inv * b_11
        c00 *= b_inv
        c01 *= b_inv
        s = 1.0 / (c00 + c01 + c10 + c11)
        b_00, b_01, b_10, b_11 = c00 * s, c01 * s, c10 * s, c11 * s
    m_k = o_k < K
    p_m = maps + (i_c * H + i_h) * 4 * K + o_k
    tl.store(p_m, b_00, mask=m_k)
    tl.store(p_m + K, b_01, mask=m_k)
    tl.store(p_m + 2 * K, b_10, mask=m_k)
    tl.store(p_m + 3 * K, b_11, mask=m_k)


@triton.jit
def _kalman_gain_chunk_scan_kernel(
    precision, maps, chunk_cov, final_cov, final_precision, chunk_offsets,
    NT, H, K,
    BC: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """Covariance entering every chunk of one sequence, ``BC`` chunks per scan step."""
    i_n, i_h, i_k = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    if IS_VARLEN:  # index loads in the kernel body: see _launch.py
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
        m = (o_c < n_c)[:, None] & m_k[None, :]
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
def _kalman_gain_fwd_kernel(
    k, log_alpha, omega, r, chunk_cov, gain, spans, info_scale, T, H, K,
    BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Gains ``kappa_t = p_hat_t k_t / (r_t + sum_i p_hat_ti k_ti^2)`` of one chunk and head."""
    info_scale = tl.cast(info_scale, tl.float32)  # Inductor passes Python floats as fp64
    i_c, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if IS_VARLEN:  # index loads in the kernel body: see _launch.py
        t0 = tl.load(spans + 3 * i_c).to(tl.int64)
        eos = tl.load(spans + 3 * i_c + 1).to(tl.int64)
    else:
        t0, eos = fixed_chunk(i_c, T, BT)
    if t0 >= eos:
        return
    o_k = tl.arange(0, BK)
    b_p = tl.load(chunk_cov + (i_c * H + i_h) * K + o_k, mask=o_k < K, other=1.0)
    for i in tl.range(0, BT, num_stages=NUM_STAGES):
        t = t0 + i
        b_k, b_a2, b_w, b_r, b_kk, b_i, b_inv = _token_inputs(
            k + i_h * K, log_alpha + i_h * K, omega + i_h * K, r + i_h, t, eos,
            o_k, H, K, info_scale)
        b_ph = b_a2 * b_p + b_w
        b_d = 1.0 / (b_r + tl.sum(b_ph * b_k * b_k, 0))
        tl.store(gain + t * H * K + i_h * K + o_k, b_ph * b_k * b_d,
                 mask=_token_mask(t, eos, o_k, K))
        b_p = b_ph * b_inv / (b_inv + b_i * b_ph)  # p_hat / (1 + I p_hat)
