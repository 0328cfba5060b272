"""Backward of the two-key, per-key-decay chunked delta rule.

Per chunk, with start state ``S0``, end-state gradient ``dS1`` and the forward's
``X = T (v - (k e^c) S0)``::

    dY  = T^T (scale R^T do + (w e^{c_last - c}) dS1)          (= dv)
    dS0 = e^{c_last} dS1 + scale (q e^c)^T do - (k e^c)^T dY
    dA  = -strict(dY X^T),   dR = scale lower(do X^T)

Two launches:

1. ``_two_key_bwd_state_kernel`` (sequential over chunks, backwards): ``dY`` and
   each chunk's end-state gradient ``dS1``; ``dh0`` at the end.
2. ``_two_key_bwd_intra_kernel`` (one program per chunk, key tile and value
   head): ``dA``, ``dR`` and the state terms, the pair terms through the same
   factored sub-block products as the forward (see :mod:`two_key_common`), then
   ``dlog_decay`` as the reverse in-chunk cumulative sum of
   ``dc = q dq_pair + k dk_pair - w dw_pair + (q e^c) dq_state + (k e^c) dk_state
   - (w e^{c_last - c}) dw_state``, plus the whole-chunk terms of ``c_last``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from kdn_compile.lowering.two_key_common import (
    BC,
    BT,
    chunk_position,
    compute_dtype,
    load_block,
    load_row,
    load_rows,
    store_rows,
)


@triton.jit
def _two_key_bwd_state_kernel(
    q, k, w, c, tmat, rmat, do, dht, dh, dv, dh0,
    cu_seqlens, chunk_first, s_k, s_v, scale,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, HAS_DHT: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // Hv, i_nh % Hv
    i_hk = i_h // (Hv // Hk)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    first = tl.load(chunk_first + i_n).to(tl.int64)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    p_state = i_nh.to(tl.int64) * K * V + o_k[:, None] * s_k + o_v[None, :] * s_v
    if HAS_DHT:
        b_ds = tl.load(dht + p_state).to(tl.float32)
    else:
        b_ds = tl.zeros([K, BV], dtype=tl.float32)
    nt = tl.cdiv(eos - bos, BT)
    for jj in range(nt):
        j = nt - 1 - jj
        t0 = bos + j * BT
        o_t = t0 + tl.arange(0, BT)
        m_t = o_t < eos
        last = tl.minimum(t0 + BT, eos) - 1
        p_h = dh + ((first + j) * Hv + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
        tl.store(p_h, b_ds.to(dh.dtype.element_ty))
        p_x = (o_t[:, None] * Hv + i_h) * V + o_v[None, :]
        b_do = tl.load(do + p_x, mask=m_t[:, None], other=0.0).to(tl.float32)
        b_r = load_rows(rmat, o_t, m_t, i_h, Hv, BT)
        b_t = load_rows(tmat, o_t, m_t, i_h, Hv, BT)
        b_c = load_rows(c, o_t, m_t, i_h, Hv, K)
        b_cl = load_row(c, last, eos, i_h, Hv, K)
        b_wl = tl.where(
            m_t[:, None], load_rows(w, o_t, m_t, i_h, Hv, K) * tl.exp(b_cl[None, :] - b_c), 0.0
        )
        b_dxt = scale * tl.dot(tl.trans(b_r), b_do) + tl.dot(b_wl, b_ds)
        b_dy = tl.dot(tl.trans(b_t), b_dxt)
        tl.store(dv + p_x, b_dy, mask=m_t[:, None])
        b_e = tl.where(m_t[:, None], tl.exp(b_c), 0.0)
        b_qd = load_rows(q, o_t, m_t, i_hk, Hk, K) * b_e
        b_kd = load_rows(k, o_t, m_t, i_hk, Hk, K) * b_e
        b_ds = (
            b_ds * tl.exp(b_cl)[:, None]
            + scale * tl.dot(tl.trans(b_qd), b_do)
            - tl.dot(tl.trans(b_kd), b_dy)
        )
    tl.store(dh0 + p_state, b_ds)


@triton.jit
def _pair_rows(b_d, b_c_row, b_c_col, b_w_col, b_cr, m_row, m_col):
    """``sum_s d[t, s] w_s e^{c_t - c_s}`` for one off-diagonal block pair (factored at ``cr``)."""
    b_wc = tl.where(m_col[:, None], b_w_col * tl.exp(b_cr[None, :] - b_c_col), 0.0)
    b_fr = tl.where(m_row[:, None], tl.exp(b_c_row - b_cr[None, :]), 0.0)
    return tl.dot(b_d, b_wc) * b_fr


@triton.jit
def _two_key_bwd_intra_kernel(
    q, k, w, c, h, dh, x, do, dv, dascr, drscr,
    dq, dk, dw, dg,
    cu_seqlens, chunk_seq, chunk_first, N, scale,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    i_c, i_k, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NK: tl.constexpr = K // BK
    i_hk = i_h // (Hv // Hk)
    i_n = tl.load(chunk_seq + i_c)
    if i_n >= N:
        return
    t0, eos = chunk_position(chunk_first, cu_seqlens, i_n, i_c, BT)
    last = tl.minimum(t0 + BT, eos) - 1
    o_t = t0 + tl.arange(0, BT)
    m_t = o_t < eos
    o_k = i_k * BK + tl.arange(0, BK)
    o_bt = tl.arange(0, BT)

    # Pass over V: dA, dR (whole chunk), and the c_last terms of this key tile.
    b_da = tl.zeros([BT, BT], dtype=tl.float32)
    b_dr = tl.zeros([BT, BT], dtype=tl.float32)
    b_dwl = tl.zeros([BT, BK], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    p_h0 = (i_c.to(tl.int64) * Hv + i_h) * K * V
    for i_v in range(V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        p_x = (o_t[:, None] * Hv + i_h) * V + o_v[None, :]
        b_x = tl.load(x + p_x, mask=m_t[:, None], other=0.0).to(tl.float32)
        b_do = tl.load(do + p_x, mask=m_t[:, None], other=0.0).to(tl.float32)
        b_dy = tl.load(dv + p_x, mask=m_t[:, None], other=0.0)
        p_s = p_h0 + o_k[:, None] * V + o_v[None, :]
        b_h = tl.load(h + p_s).to(tl.float32)
        b_dh = tl.load(dh + p_s).to(tl.float32)
        b_da += tl.dot(b_dy, tl.trans(b_x))
        b_dr += tl.dot(b_do, tl.trans(b_x))
        b_dwl += tl.dot(b_x, tl.trans(b_dh))
        b_hdh += tl.sum(b_h * b_dh, 1)
    b_da = -tl.where(o_bt[:, None] > o_bt[None, :], b_da, 0.0)
    b_dr = scale * tl.where(o_bt[:, None] >= o_bt[None, :], b_dr, 0.0)
    p_scr = ((o_t[:, None] * Hv + i_h) * NK + i_k) * BT + o_bt[None, :]
    tl.store(dascr + p_scr, b_da, mask=m_t[:, None])
    tl.store(drscr + p_scr, b_dr, mask=m_t[:, None])
    b_cl = load_row(c + i_k * BK, last, eos, i_h, Hv * NK, BK)
    b_ct = load_rows(c + i_k * BK, o_t, m_t, i_h * NK + 0, Hv * NK, BK)
    b_wl = tl.where(m_t[:, None], load_rows(w + i_k * BK, o_t, m_t, i_h * NK, Hv * NK, BK)
                    * tl.exp(b_cl[None, :] - b_ct), 0.0)
    # Gradient of c_last through the state decay and the write factors e^{c_last - c}.
    b_carry = tl.exp(b_cl) * b_hdh + tl.sum(b_wl * b_dwl, 0)
    tl.debug_barrier()

    o_c = tl.arange(0, BC)
    H2: tl.constexpr = Hv * NK
    HK2: tl.constexpr = Hk * NK
    for ib in tl.static_range(BT // BC):
        i = BT // BC - 1 - ib
        o_i = t0 + i * BC + o_c
        m_i = o_i < eos
        b_ci = load_rows(c + i_k * BK, o_i, m_i, i_h * NK, H2, BK)
        b_qi = load_rows(q + i_k * BK, o_i, m_i, i_hk * NK, HK2, BK)
        b_ki = load_rows(k + i_k * BK, o_i, m_i, i_hk * NK, HK2, BK)
        b_wi = load_rows(w + i_k * BK, o_i, m_i, i_h * NK, H2, BK)
        b_dqp = tl.zeros([BC, BK], dtype=tl.float32)
        b_dkp = tl.zeros([BC, BK], dtype=tl.float32)
        b_dwp = tl.zeros([BC, BK], dtype=tl.float32)
        # Rows of block i against earlier blocks j < i.
        for j in tl.static_range(i):
            o_j = t0 + j * BC + o_c
            m_j = o_j < eos
            b = tl.minimum(t0 + j * BC + BC - 1, last)
            b_cb = load_row(c + i_k * BK, b, eos, i_h * NK, H2, BK)
            b_cj = load_rows(c + i_k * BK, o_j, m_j, i_h * NK, H2, BK)
            b_wj = load_rows(w + i_k * BK, o_j, m_j, i_h * NK, H2, BK)
            b_daij = load_block(dascr, o_i, m_i, i_h * NK + i_k, j * BC, H2, BT, BC)
            b_drij = load_block(drscr, o_i, m_i, i_h * NK + i_k, j * BC, H2, BT, BC)
            b_dkp += _pair_rows(b_daij, b_ci, b_cj, b_wj, b_cb, m_i, m_j)
            b_dqp += _pair_rows(b_drij, b_ci, b_cj, b_wj, b_cb, m_i, m_j)
        # Columns of block i against later blocks j > i.
        for j in tl.static_range(i + 1, BT // BC):
            o_j = t0 + j * BC + o_c
            m_j = o_j < eos
            b = tl.minimum(t0 + i * BC + BC - 1, last)
            b_cb = load_row(c + i_k * BK, b, eos, i_h * NK, H2, BK)
            b_cj = load_rows(c + i_k * BK, o_j, m_j, i_h * NK, H2, BK)
            b_fr = tl.where(m_j[:, None], tl.exp(b_cj - b_cb[None, :]), 0.0)
            b_kj = load_rows(k + i_k * BK, o_j, m_j, i_hk * NK, HK2, BK) * b_fr
            b_qj = load_rows(q + i_k * BK, o_j, m_j, i_hk * NK, HK2, BK) * b_fr
            b_daji = load_block(dascr, o_j, m_j, i_h * NK + i_k, i * BC, H2, BT, BC)
            b_drji = load_block(drscr, o_j, m_j, i_h * NK + i_k, i * BC, H2, BT, BC)
            b_fc = tl.where(m_i[:, None], tl.exp(b_cb[None, :] - b_ci), 0.0)
            b_dwp += (tl.dot(tl.trans(b_daji), b_kj) + tl.dot(tl.trans(b_drji), b_qj)) * b_fc
        # The diagonal block, one half of columns at a time.
        b_daii = load_block(dascr, o_i, m_i, i_h * NK + i_k, i * BC, H2, BT, BC)
        b_drii = load_block(drscr, o_i, m_i, i_h * NK + i_k, i * BC, H2, BT, BC)
        for half in tl.static_range(2):
            start = t0 + i * BC + half * (BC // 2)
            r = tl.minimum(start + BC // 4 - 1, last)
            b_cr = load_row(c + i_k * BK, r, last + 1, i_h * NK, H2, BK)
            row_ok = m_i & (o_i >= start)
            col_ok = row_ok & (o_i < start + BC // 2)
            b_fr = tl.where(row_ok[:, None], tl.exp(b_ci - b_cr[None, :]), 0.0)
            b_fc = tl.where(col_ok[:, None], tl.exp(b_cr[None, :] - b_ci), 0.0)
            b_wc = b_wi * b_fc
            b_dkp += tl.dot(b_daii, b_wc) * b_fr
            b_dqp += tl.dot(b_drii, b_wc) * b_fr
            b_dwp += (
                tl.dot(tl.trans(b_daii), b_ki * b_fr) + tl.dot(tl.trans(b_drii), b_qi * b_fr)
            ) * b_fc
        # State terms of block i.
        b_dqs = tl.zeros([BC, BK], dtype=tl.float32)
        b_dks = tl.zeros([BC, BK], dtype=tl.float32)
        b_dws = tl.zeros([BC, BK], dtype=tl.float32)
        for i_v in range(V // BV):
            o_v = i_v * BV + tl.arange(0, BV)
            p_x = (o_i[:, None] * Hv + i_h) * V + o_v[None, :]
            b_x = tl.load(x + p_x, mask=m_i[:, None], other=0.0).to(tl.float32)
            b_do = tl.load(do + p_x, mask=m_i[:, None], other=0.0).to(tl.float32)
            b_dy = tl.load(dv + p_x, mask=m_i[:, None], other=0.0)
            p_s = p_h0 + o_k[:, None] * V + o_v[None, :]
            b_h = tl.load(h + p_s).to(tl.float32)
            b_dh = tl.load(dh + p_s).to(tl.float32)
            b_dqs += tl.dot(b_do, tl.trans(b_h))
            b_dks += tl.dot(b_dy, tl.trans(b_h))
            b_dws += tl.dot(b_x, tl.trans(b_dh))
        b_e = tl.where(m_i[:, None], tl.exp(b_ci), 0.0)
        b_el = tl.where(m_i[:, None], tl.exp(b_cl[None, :] - b_ci), 0.0)
        b_dqs = scale * b_dqs * b_e
        b_dks = -b_dks * b_e
        b_dws = b_dws * b_el
        b_dqi = b_dqs + b_dqp
        b_dki = b_dks + b_dkp
        b_dwi = b_dws + b_dwp
        b_dc = b_qi * b_dqi + b_ki * b_dki - b_wi * b_dwi
        b_dgi = tl.cumsum(b_dc, axis=0, reverse=True) + b_carry[None, :]
        b_carry += tl.sum(b_dc, 0)
        store_rows(dq + i_k * BK, b_dqi, o_i, m_i, i_h * NK, H2, BK)
        store_rows(dk + i_k * BK, b_dki, o_i, m_i, i_h * NK, H2, BK)
        store_rows(dw + i_k * BK, b_dwi, o_i, m_i, i_h * NK, H2, BK)
        store_rows(dg + i_k * BK, b_dgi, o_i, m_i, i_h * NK, H2, BK)


def two_key_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    c: torch.Tensor,
    tmat: torch.Tensor,
    rmat: torch.Tensor,
    h: torch.Tensor,
    x: torch.Tensor,
    chunk_seq: torch.Tensor,
    chunk_first: torch.Tensor,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    *,
    chunk_size: int,
    scale: float,
    state_v_first: bool,
) -> tuple[torch.Tensor, ...]:
    """Gradients of :func:`two_key_fwd` from its saved tensors.

    Args:
        q, k, w, v, log_decay, initial_state, cu_seqlens: as for :func:`two_key_fwd`.
        c, tmat, rmat, h, x, chunk_seq, chunk_first: the saved outputs of
            :func:`two_key_fwd` (same call).
        do: ``[B, T, Hv, V]`` gradient of ``o``.
        dht: gradient of the final state (its layout) or None.
        chunk_size, scale, state_v_first: as for the forward.

    Returns:
        ``(dq, dk, dw, dv, dlog_decay, dh0)`` in the dtypes of their inputs;
        ``dh0`` is float32 in the state layout (the gradient of a zero initial
        state when ``initial_state`` is None).
    """
    batch, length, hk, key_dim = q.shape
    hv, value_dim = v.shape[2], v.shape[3]
    dt = compute_dtype(q.dtype)
    num_seqs = chunk_first.shape[0] - 1
    num_chunks = chunk_seq.shape[0]
    if cu_seqlens is None:
        bounds = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * length
    else:
        bounds = cu_seqlens.to(torch.int32)
    tokens = batch * length
    flat = lambda t: t.reshape(tokens, t.shape[-2], t.shape[-1]).contiguous()  # noqa: E731
    qf, kf, wf, dof = flat(q), flat(k), flat(w), flat(do)
    dh = q.new_empty((num_chunks, hv, key_dim, value_dim), dtype=dt)
    dv32 = q.new_empty((tokens, hv, value_dim), dtype=torch.float32)
    state_shape = (num_seqs, hv, value_dim, key_dim) if state_v_first else (
        num_seqs, hv, key_dim, value_dim)
    dh0 = q.new_empty(state_shape, dtype=torch.float32)
    s_k, s_v = (1, key_dim) if state_v_first else (value_dim, 1)
    block_v = min(64, value_dim)
    wrap_triton(_two_key_bwd_state_kernel)[(triton.cdiv(value_dim, block_v), num_seqs * hv)](
        qf, kf, wf, c, tmat, rmat, dof,
        dht.contiguous() if dht is not None else dh0, dh, dv32, dh0,
        bounds, chunk_first, s_k, s_v, scale,
        Hk=hk, Hv=hv, K=key_dim, V=value_dim, BT=BT, BV=block_v,
        HAS_DHT=dht is not None,
        num_warps=4,
    )
    block_k = min(64, key_dim)
    nk = key_dim // block_k
    dascr = q.new_empty((tokens, hv, nk, BT), dtype=torch.float32)
    drscr = q.new_empty((tokens, hv, nk, BT), dtype=torch.float32)
    dq = q.new_empty((tokens, hv, key_dim), dtype=torch.float32)
    dk = q.new_empty((tokens, hv, key_dim), dtype=torch.float32)
    dw = q.new_empty((tokens, hv, key_dim), dtype=torch.float32)
    dg = q.new_empty((tokens, hv, key_dim), dtype=torch.float32)
    wrap_triton(_two_key_bwd_intra_kernel)[(num_chunks, nk, hv)](
        qf, kf, wf, c, h, dh, x, dof, dv32, dascr, drscr,
        dq, dk, dw, dg,
        bounds, chunk_seq, chunk_first, num_seqs, scale,
        Hk=hk, Hv=hv, K=key_dim, V=value_dim, BT=BT, BC=BC, BK=block_k, BV=block_v,
        num_warps=4,
    )
    group = hv // hk
    if group > 1:
        dq = dq.view(tokens, hk, group, key_dim).sum(2)
        dk = dk.view(tokens, hk, group, key_dim).sum(2)
    return (
        dq.view(q.shape).to(q.dtype),
        dk.view(k.shape).to(k.dtype),
        dw.view(w.shape).to(w.dtype),
        dv32.view(v.shape).to(v.dtype),
        dg.view(log_decay.shape).to(log_decay.dtype),
        dh0,
    )
