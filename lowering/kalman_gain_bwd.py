"""Triton kernels of the Diag-KDN Kalman gain, backward.

With ``lam_t = dL/dp_t`` (the adjoint of the covariance after token ``t``),
``rho_t = p_t / p_hat_t = 1 / (1 + I_t p_hat_t)``, ``D_t = r_t + sum_i p_hat_ti k_ti^2``,
``u = dgain``, ``c_t = sum_i u_ti kappa_ti`` and ``e_t = k_t (u_t - c_t k_t) / D_t``
(the gain's pull on ``p_hat_t``), the adjoint runs in reverse as the affine map::

    lam_{t-1} = a^2_t (rho_t^2 lam_t + e_t)          lam_T = -dprecision / p_T^2

and ``mu_t = dL/dp_hat_t = rho_t^2 lam_t + e_t`` gives every gradient::

    domega_t     = mu_t
    dlog_alpha_t = 2 a^2_t p_{t-1} mu_t
    dk_t         = p_hat_t (u_t - 2 c_t k_t) / D_t - 2 info_scale k_t lam_t p_t^2 / r_t
    dr_t         = -c_t / D_t + sum_i lam_ti p_ti^2 I_ti / r_t
    dprecision0  = -lam_0 p_0^2

The kernels form ``rho_t`` from ``min(I_t, 1)`` and ``min(1, 1 / I_t)``, and ``p_t / r_t`` as
``p_hat_t / (r_t + info_scale k_t^2 p_hat_t)``: never ``I_t`` or ``1 / r_t``, which overflow
float32 for a tiny ``r``. A zero ``dprecision`` gives ``lam_T = 0`` (also where ``p_T^2``
underflows); a nonzero one there overflows ``lam_T``.

Three stages mirror the forward: each chunk's composed affine map from a
forward walk that also keeps ``p_{t-1}`` in a ``[B, T, H, K]`` scratch (all
chunks in parallel); a reverse scan over chunks for the adjoint entering every
chunk at its last token; a reverse walk of each chunk for the gradients.
Source: derived from the forward recurrence in ``kdn_compile.reference.kdn``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kdn_compile.lowering._launch import fixed_chunk
from kdn_compile.lowering.kalman_gain_fwd import _token_inputs, _token_mask


@triton.jit
def _affine_combine(a0, a1, b0, b1):
    """Map ``x -> a0 x + a1`` then ``x -> b0 x + b1``."""
    return a0 * b0, a1 * b0 + b1


@triton.jit
def _kalman_gain_bwd_chunk_map_kernel(
    k, log_alpha, omega, r, chunk_cov, dgain, adj_maps, prev_cov, spans,
    info_scale, T, H, K,
    BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Composed adjoint map of one chunk and head; keeps ``p_{t-1}`` in ``prev_cov``."""
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
    b_a = tl.full([BK], 1.0, tl.float32)
    b_b = tl.zeros([BK], tl.float32)
    for i in tl.range(0, BT, num_stages=NUM_STAGES):
        t = t0 + i
        b_k, b_a2, b_w, b_r, b_kk, b_i, b_inv = _token_inputs(
            k + i_h * K, log_alpha + i_h * K, omega + i_h * K, r + i_h, t, eos,
            o_k, H, K, info_scale)
        o = t * H * K + i_h * K + o_k
        m = _token_mask(t, eos, o_k, K)
        b_u = tl.load(dgain + o, mask=m, other=0.0).to(tl.float32)
        tl.store(prev_cov + o, b_p, mask=m)
        b_ph = b_a2 * b_p + b_w
        b_rho = b_inv / (b_inv + b_i * b_ph)
        b_d = 1.0 / (b_r + tl.sum(b_ph * b_k * b_k, 0))
        b_c = tl.sum(b_u * b_ph * b_k, 0) * b_d
        # The maps so far (applied last) after G_t = (a^2 rho^2, a^2 e_t).
        b_b += b_a * b_a2 * b_k * (b_u - b_c * b_k) * b_d
        b_a *= b_a2 * b_rho * b_rho
        b_p = b_ph * b_rho
    m_k = o_k < K
    p_m = adj_maps + (i_c * H + i_h) * 2 * K + o_k
    tl.store(p_m, b_a, mask=m_k)
    tl.store(p_m + K, b_b, mask=m_k)


@triton.jit
def _kalman_gain_bwd_chunk_scan_kernel(
    precision, final_cov, dprecision, adj_maps, chunk_adj, dprecision0, chunk_offsets,
    NT, H, K,
    BC: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_DPRECISION: tl.constexpr,
):
    """Adjoint entering every chunk (at its last token) of one sequence, last chunk first."""
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
    if HAS_DPRECISION:
        b_pt = tl.load(final_cov + o_s, mask=m_k, other=1.0)
        b_dp = tl.load(dprecision + o_s, mask=m_k, other=0.0).to(tl.float32)
        # a zero dprecision (autograd's for an unused precision) adds nothing, also where
        # p_T^2 underflows (0 / 0); a nonzero one there overflows the adjoint (NaN gradients)
        b_lam = tl.where(b_dp == 0.0, 0.0, -b_dp / (b_pt * b_pt))
    else:
        b_lam = tl.zeros([BK], dtype=tl.float32)
    if n_c > 0:
        tl.store(chunk_adj + ((c0 + n_c - 1) * H + i_h) * K + o_k, b_lam, mask=m_k)
    n_b = tl.cdiv(n_c, BC)
    for j in range(0, n_b):
        o_c = (n_b - 1 - j) * BC + tl.arange(0, BC)
        m = (o_c < n_c)[:, None] & m_k[None, :]
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
    k, log_alpha, omega, r, prev_cov, chunk_adj, dgain, dk_in, dlog_alpha_in,
    dk, dlog_alpha, domega, dr, spans, info_scale, T, H, K,
    BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr, NUM_STAGES: tl.constexpr,
    ADD: tl.constexpr,
):
    """Gradients of one chunk and head, walking its tokens in reverse; with ``ADD``,
    ``dk`` and ``dlog_alpha`` also take ``dk_in`` and ``dlog_alpha_in`` (the memory's)."""
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
    o_1 = tl.arange(0, 1)
    b_lam = tl.load(chunk_adj + (i_c * H + i_h) * K + o_k, mask=o_k < K, other=0.0)
    for i in tl.range(0, BT, num_stages=NUM_STAGES):
        t = t0 + BT - 1 - i
        b_k, b_a2, b_w, b_r, b_kk, b_i, b_inv = _token_inputs(
            k + i_h * K, log_alpha + i_h * K, omega + i_h * K, r + i_h, t, eos,
            o_k, H, K, info_scale)
        o = t * H * K + i_h * K + o_k
        m = _token_mask(t, eos, o_k, K)
        b_u = tl.load(dgain + o, mask=m, other=0.0).to(tl.float32)
        b_prev = tl.load(prev_cov + o, mask=m, other=1.0)
        b_ph = b_a2 * b_prev + b_w
        b_rho = b_inv / (b_inv + b_i * b_ph)
        b_d = 1.0 / (b_r + tl.sum(b_ph * b_k * b_k, 0))
        b_c = tl.sum(b_u * b_ph * b_k, 0) * b_d
        # p / r = p_hat / (r + info_scale k^2 p_hat), without 1 / r (it overflows)
        b_pr = b_ph / (b_r + b_kk * b_ph)
        b_lpr = b_lam * (b_ph * b_rho) * b_pr  # lam p^2 / r
        b_mu = b_rho * b_rho * b_lam + b_k * (b_u - b_c * b_k) * b_d
        tl.store(domega + o, b_mu, mask=m)
        b_dla = 2.0 * b_a2 * b_prev * b_mu
        b_dk = b_ph * (b_u - 2.0 * b_c * b_k) * b_d - 2.0 * info_scale * b_k * b_lpr
        if ADD:
            b_dla += tl.load(dlog_alpha_in + o, mask=m, other=0.0).to(tl.float32)
            b_dk += tl.load(dk_in + o, mask=m, other=0.0).to(tl.float32)
        tl.store(dlog_alpha + o, b_dla, mask=m)
        tl.store(dk + o, b_dk, mask=m)
        b_dr = (tl.sum(b_lam * b_kk * b_pr * b_pr, 0) - b_c * b_d) + tl.zeros([1], tl.float32)
        tl.store(dr + t * H + i_h + o_1, b_dr, mask=_token_mask(t, eos, o_1, 1))
        b_lam = b_a2 * b_mu
