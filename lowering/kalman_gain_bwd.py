"""Triton kernels of the Diag-KDN Kalman gain, backward.

With ``lam_t = dL/dp_t`` (the adjoint of the covariance after token ``t``),
``rho_t = p_t / p_hat_t = 1 / (1 + I_t p_hat_t)``, ``D_t = r_t + sum_i p_hat_ti k_ti^2``,
``u = dgain``, ``c_t = sum_i u_ti kappa_ti`` and ``e_t = k_t (u_t - c_t k_t) / D_t``
(the gain's pull on ``p_hat_t``), the adjoint runs in reverse as the affine map::

    lam_{t-1} = a^2_t (rho_t^2 lam_t + e_t)          lam_T = -dprecision / p_T^2

and ``mu_t = dL/dp_hat_t = rho_t^2 lam_t + e_t`` gives every gradient::

    domega_t    = mu_t
    dlog_alpha_t = 2 a^2_t p_{t-1} mu_t
    dk_t        = p_hat_t (u_t - 2 c_t k_t) / D_t - 2 info_scale k_t lam_t p_t^2 / r_t
    dr_t        = -c_t / D_t + sum_i lam_ti p_ti^2 I_ti / r_t
    dprecision0 = -lam_0 p_0^2

Three stages mirror the forward: each chunk's composed affine map (parallel),
a reverse scan over chunks for the adjoint leaving every chunk, and the
per-token gradients of each chunk (parallel). Inside a chunk the adjoints are
an exclusive reverse scan: the scan carries, per segment, the composition of
all its maps and the composition of all but the one applied last.
Source: derived from the forward recurrence in ``kdn_compile.reference.kdn``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kdn_compile.lowering.kalman_gain_fwd import _chunk_bounds, _chunk_covariances


@triton.jit
def _affine_combine(a0, a1, b0, b1):
    """Map ``x -> a0 x + a1`` then ``x -> b0 x + b1``."""
    return a0 * b0, a1 * b0 + b1


@triton.jit
def _affine_rest_combine(a0, a1, ar0, ar1, b0, b1, br0, br1):
    """Segments ``a`` then ``b`` as (all maps, all but the last applied)."""
    return a0 * b0, a1 * b0 + b1, a0 * br0, a1 * br0 + br1


@triton.jit
def _adjoint_maps(k, log_alpha, omega, r, chunk_cov, dgain, i_c, i_h, o_t, m_t, o_k, m_k,
                  info_scale, H, K):
    """Per-token adjoint maps ``(a^2 rho^2, a^2 e)`` and what the gradients need."""
    b_prev, b_a2, b_k, b_w, b_r = _chunk_covariances(
        k + i_h * K, log_alpha + i_h * K, omega + i_h * K, r + i_h, chunk_cov + i_h * K,
        i_c, o_t, m_t, o_k, m_k, info_scale, H, K)
    o = (o_t * H * K)[:, None] + (i_h * K + o_k)[None, :]
    b_u = tl.load(dgain + o, mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
    b_ph = b_a2 * b_prev + b_w
    b_i = info_scale * b_k * b_k / b_r[:, None]
    b_rho = 1.0 / (1.0 + b_i * b_ph)
    b_d = b_r + tl.sum(b_ph * b_k * b_k, 1)
    b_c = tl.sum(b_u * b_ph * b_k, 1) / b_d
    b_e = b_k * (b_u - b_c[:, None] * b_k) / b_d[:, None]
    return b_a2 * b_rho * b_rho, b_a2 * b_e, b_prev, b_a2, b_k, b_r, b_u, b_ph, b_i, b_rho, b_d, b_c, b_e


@triton.jit
def _kalman_gain_bwd_chunk_map_kernel(
    k, log_alpha, omega, r, chunk_cov, dgain, adj_maps, cu_seqlens, chunk_seq, chunk_offsets,
    info_scale, T, NT, H, K,
    BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """Composed adjoint map of one chunk: ``lam`` leaving it from ``lam`` entering at its end."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_c = i_c.to(tl.int64)
    i_n, t0, eos = _chunk_bounds(i_c, cu_seqlens, chunk_seq, chunk_offsets, T, NT, BT, IS_VARLEN)
    if t0 >= eos:
        return
    o_t = t0 + tl.arange(0, BT)
    m_t = o_t < eos
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    out = _adjoint_maps(k, log_alpha, omega, r, chunk_cov, dgain, i_c, i_h, o_t, m_t, o_k, m_k,
                        info_scale, H, K)
    b_a, b_b = tl.associative_scan((out[0], out[1]), 0, _affine_combine, reverse=True)
    first = (tl.arange(0, BT) == 0)[:, None]
    p_m = adj_maps + (i_c * H + i_h) * 2 * K + o_k
    tl.store(p_m, tl.sum(tl.where(first, b_a, 0.0), 0), mask=m_k)
    tl.store(p_m + K, tl.sum(tl.where(first, b_b, 0.0), 0), mask=m_k)


@triton.jit
def _kalman_gain_bwd_chunk_scan_kernel(
    precision, final_cov, dprecision, adj_maps, chunk_adj, dprecision0, cu_seqlens, chunk_offsets,
    T, NT, H, K,
    BC: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_DPRECISION: tl.constexpr,
):
    """Adjoint entering every chunk (at its last token) of one sequence, last chunk first."""
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
    if HAS_DPRECISION:
        b_pt = tl.load(final_cov + o_s, mask=m_k, other=1.0)
        b_lam = -tl.load(dprecision + o_s, mask=m_k, other=0.0).to(tl.float32) / (b_pt * b_pt)
    else:
        b_lam = tl.zeros([BK], dtype=tl.float32)
    if n_c > 0:
        tl.store(chunk_adj + ((c0 + n_c - 1) * H + i_h) * K + o_k, b_lam, mask=m_k)
    n_b = tl.cdiv(n_c, BC)
    for j in range(0, n_b):
        o_c = (n_b - 1 - j) * BC + tl.arange(0, BC)
        m_c = o_c < n_c
        m = m_c[:, None] & m_k[None, :]
        p_m = adj_maps + (((c0 + o_c) * H + i_h) * 2 * K)[:, None] + o_k[None, :]
        b_a = tl.load(p_m, mask=m, other=1.0)
        b_b = tl.load(p_m + K, mask=m, other=0.0)
        b_a, b_b = tl.associative_scan((b_a, b_b), 0, _affine_combine, reverse=True)
        b_out = b_a * b_lam[None, :] + b_b
        # The adjoint leaving chunk c enters chunk c - 1.
        m_prev = (o_c >= 1)[:, None] & m
        tl.store(chunk_adj + (((c0 + o_c - 1) * H + i_h) * K)[:, None] + o_k[None, :],
                 b_out, mask=m_prev)
        b_lam = tl.sum(tl.where((tl.arange(0, BC) == 0)[:, None], b_out, 0.0), 0)
    b_p0 = 1.0 / tl.load(precision + o_s, mask=m_k, other=1.0).to(tl.float32)
    tl.store(dprecision0 + o_s, -b_lam * b_p0 * b_p0, mask=m_k)


@triton.jit
def _kalman_gain_bwd_kernel(
    k, log_alpha, omega, r, chunk_cov, chunk_adj, dgain,
    dk, dlog_alpha, domega, dr, cu_seqlens, chunk_seq, chunk_offsets,
    info_scale, T, NT, H, K,
    BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """Gradients of one chunk and head from the adjoint entering at its last token."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_c = i_c.to(tl.int64)
    i_n, t0, eos = _chunk_bounds(i_c, cu_seqlens, chunk_seq, chunk_offsets, T, NT, BT, IS_VARLEN)
    if t0 >= eos:
        return
    o_t = t0 + tl.arange(0, BT)
    m_t = o_t < eos
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_ga, b_gb, b_prev, b_a2, b_k, b_r, b_u, b_ph, b_i, b_rho, b_d, b_c, b_e = _adjoint_maps(
        k, log_alpha, omega, r, chunk_cov, dgain, i_c, i_h, o_t, m_t, o_k, m_k, info_scale, H, K)
    b_ra = tl.full(b_ga.shape, 1.0, tl.float32)
    b_rb = tl.zeros(b_ga.shape, tl.float32)
    b_ga, b_gb, b_ra, b_rb = tl.associative_scan(
        (b_ga, b_gb, b_ra, b_rb), 0, _affine_rest_combine, reverse=True)
    b_lam_in = tl.load(chunk_adj + (i_c * H + i_h) * K + o_k, mask=m_k, other=0.0)[None, :]
    b_lam = b_ra * b_lam_in + b_rb
    b_mu = b_rho * b_rho * b_lam + b_e
    b_lp = b_lam * (b_ph * b_rho) * (b_ph * b_rho)
    o = (o_t * H * K)[:, None] + (i_h * K + o_k)[None, :]
    m = m_t[:, None] & m_k[None, :]
    tl.store(domega + o, b_mu, mask=m)
    tl.store(dlog_alpha + o, 2.0 * b_a2 * b_prev * b_mu, mask=m)
    b_dk = b_ph * (b_u - 2.0 * b_c[:, None] * b_k) / b_d[:, None] - 2.0 * info_scale * b_k * b_lp / b_r[:, None]
    tl.store(dk + o, b_dk, mask=m)
    b_dr = -b_c / b_d + tl.sum(b_lp * b_i, 1) / b_r
    tl.store(dr + o_t * H + i_h, b_dr, mask=m_t)
