"""Chunked Gated DeltaNet cut at its WY operands, in Triton: the kernels of ``w_quantizer``.

``chunk_gdn(..., w_quantizer=f)`` runs as two ops with the user's ``f`` traced between
them (notation of :mod:`.chunk_gdn_fwd`; per chunk ``G`` the in-chunk cumulative gate,
float64, of the gates floored as there; ``Ai = (I + A)^-1``):

1. the operands, :func:`gdn_wy_operands_fwd`: the prepare kernel (``G``, ``Ai``), then
   ``_chunk_gdn_wy_fwd_kernel`` (one program per chunk and value head):
   ``W = Ai (beta e^G k) [B, T, Hv, K]`` and ``U = Ai (beta v) [B, T, Hv, V]`` in float32
   (the references' working dtype, which ``f`` sees). Backward
   (:func:`gdn_wy_operands_bwd`, ``_chunk_gdn_wy_bwd_kernel``): with ``dX = Ai^T dW`` (and
   ``Ai^T dU``), ``dA = -(dXk W^T + dXv U^T)`` below the diagonal, then the gradients of
   ``A = beta_i (k_i . k_j) e^{G_i - G_j}`` and of ``beta e^G k``, ``beta v``.
2. the recurrence over chunks from ``W`` (as ``f`` returned it) and ``U``,
   :func:`gdn_wy_recurrence_fwd`: the prepare kernel (``G``, ``M``), then the forward
   recurrence kernel of :mod:`.chunk_gdn_fwd` with ``delta = U - W S`` (its ``WY`` flag),
   FP8 state QDQ included. Backward (:func:`gdn_wy_recurrence_bwd`): the state pass of
   :mod:`.chunk_gdn_bwd` (``WY`` flag: ``dU = ddelta``, ``dS`` takes ``-W^T ddelta``),
   then ``_chunk_gdn_wy_grad_kernel`` (one program per chunk, value head and role): ``dq``
   and ``dg`` (role 0), ``dk`` (1), ``dW = -ddelta S^T`` (2).

Math: :func:`kdn_compile.reference.gdn_wy_operands_reference` and
:func:`kdn_compile.reference.gdn_wy_recurrence_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from kdn_compile.reference._common import work_dtype

from ._launch import dot_precision, fixed_chunk, uncovered_inputs
from .chunk_gdn_bwd import (
    _decay, _start_state, chunk_warps, floored_gate_grad, gdn_state_grads, key_grads, sum_groups,
)
from .chunk_gdn_fwd import (
    CHUNK, _recurrence, _scale, gdn_kernel_covers, gdn_layout, gdn_prepare,
    gdn_recompute_states, qdq_tile_width, require_gdn_kernels,
)

__all__ = [
    "gdn_wy_kernel_supports", "gdn_wy_operands_bwd", "gdn_wy_operands_fwd",
    "gdn_wy_recurrence_bwd", "gdn_wy_recurrence_fwd",
]

_OPERAND_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def gdn_wy_kernel_supports(q, k, w, u, g, initial_state, cu_seqlens, chunk_size, *,
                           state_qdq=False, state_qdq_block_v=64) -> bool:
    """Whether the recurrence kernels from the WY operands cover these inputs (shapes and
    dtypes only): as :func:`~.chunk_gdn_fwd.gdn_kernel_supports` with ``V = U.shape[-1]``,
    and ``w``, ``u`` float16, bfloat16 or float32. (The operands' kernels cover what
    ``gdn_kernel_supports`` covers.)"""
    if w.dtype not in _OPERAND_DTYPES or u.dtype not in _OPERAND_DTYPES:
        return False
    return gdn_kernel_covers(q, k, u.shape[-1], (g, initial_state), chunk_size,
                             state_qdq=state_qdq, state_qdq_block_v=state_qdq_block_v)


def _require(q, k, w, u, g, initial_state, cu_seqlens, chunk_size, **qdq) -> None:
    if not gdn_wy_kernel_supports(q, k, w, u, g, initial_state, cu_seqlens, chunk_size, **qdq):
        raise uncovered_inputs("Triton GDN (WY)", "gdn_wy_kernel_supports", chunk_size, q, u)


@triton.jit
def _keys_and_gates(k, gc, rows, m_r, last, i_h, H: tl.constexpr, HK: tl.constexpr,
                    K: tl.constexpr):
    """Keys ``[BT, K]`` of value head ``i_h`` (zero past the end) and the in-chunk cumulative
    gates (the last one repeated there). Only values come out: a helper's result that
    reaches a store address would count its pointers as written (``_launch.py``)."""
    b_k = tl.load(k + (rows[:, None] * HK + i_h // (H // HK)) * K + tl.arange(0, K)[None, :],
                  mask=m_r, other=0.0)
    return b_k, tl.load(gc + tl.minimum(rows, last) * H + i_h)


@triton.jit
def _chunk_w(k, gc, beta, ai, rows, m_r, last, i_h, H: tl.constexpr, HK: tl.constexpr,
             K: tl.constexpr, BT: tl.constexpr, DOT_PREC: tl.constexpr):
    """A chunk's ``(k, G, beta, Ai, W = Ai (beta e^G k))`` for value head ``i_h``, ``W`` in
    float32 (values only, as :func:`_keys_and_gates`)."""
    b_k, b_gc = _keys_and_gates(k, gc, rows, m_r, last, i_h, H, HK, K)
    b_ai = tl.load(ai + (rows[:, None] * H + i_h) * BT + tl.arange(0, BT)[None, :], mask=m_r,
                   other=0.0)
    b_beta = tl.load(beta + rows * H + i_h, mask=tl.reshape(m_r, [BT]), other=0.0)
    b_beta = b_beta.to(tl.float32)
    b_xk = ((b_beta * tl.exp(b_gc.to(tl.float32)))[:, None] * b_k).to(b_k.dtype)
    return b_k, b_gc, b_beta, b_ai, tl.dot(b_ai, b_xk, input_precision=DOT_PREC)


@triton.jit
def _chunk_gdn_wy_fwd_kernel(
    k, v, gc, beta, ai, w, u, spans, T,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Program ``(chunk, head)``: ``W = Ai (beta e^G k)`` and ``U = Ai (beta v)``."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    if IS_VARLEN:  # index loads in the kernel body: see _launch.py
        t0 = tl.load(spans + 3 * i_c).to(tl.int64)
        eos = tl.load(spans + 3 * i_c + 1).to(tl.int64)
    else:
        t0, eos = fixed_chunk(i_c, T, BT)
    if t0 >= eos:
        return
    dt = k.dtype.element_ty
    rows = t0 + tl.arange(0, BT)
    m_r = (rows < eos)[:, None]
    _, _, b_beta, b_ai, b_w = _chunk_w(k, gc, beta, ai, rows, m_r, tl.minimum(t0 + BT, eos) - 1,
                                       i_h, H, HK, K, BT, DOT_PREC)
    tl.store(w + (rows[:, None] * H + i_h) * K + tl.arange(0, K)[None, :],
             b_w.to(w.dtype.element_ty), mask=m_r)
    for i_v in range(0, V // BV):
        o_tv = (rows[:, None] * H + i_h) * V + i_v * BV + tl.arange(0, BV)[None, :]
        b_v = tl.load(v + o_tv, mask=m_r, other=0.0).to(tl.float32)
        b_u = tl.dot(b_ai, (b_beta[:, None] * b_v).to(dt), input_precision=DOT_PREC)
        tl.store(u + o_tv, b_u.to(u.dtype.element_ty), mask=m_r)


@triton.jit
def _chunk_gdn_wy_bwd_kernel(
    k, v, gc, beta, ai, dw, du, dk, dv, dg, dbeta, spans, T,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Program ``(chunk, head)``: ``dk`` (per value head), ``dv``, ``dg``, ``dbeta`` from
    ``dW`` and ``dU`` (``W``, ``U`` recomputed)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    if IS_VARLEN:  # index loads in the kernel body: see _launch.py
        t0 = tl.load(spans + 3 * i_c).to(tl.int64)
        eos = tl.load(spans + 3 * i_c + 1).to(tl.int64)
    else:
        t0, eos = fixed_chunk(i_c, T, BT)
    if t0 >= eos:
        return
    dt = k.dtype.element_ty
    o_t, o_k = tl.arange(0, BT), tl.arange(0, K)
    rows = t0 + o_t
    m_r = (rows < eos)[:, None]
    b_k, b_gc, b_beta, b_ai, b_w = _chunk_w(k, gc, beta, ai, rows, m_r,
                                            tl.minimum(t0 + BT, eos) - 1, i_h, H, HK, K, BT,
                                            DOT_PREC)
    b_eg = tl.exp(b_gc.to(tl.float32))
    b_ek = b_eg[:, None] * b_k.to(tl.float32)  # e^G k
    o_tk = (rows[:, None] * H + i_h) * K + o_k[None, :]
    b_dx = tl.dot(tl.trans(b_ai), tl.load(dw + o_tk, mask=m_r, other=0.0).to(dt),
                  input_precision=DOT_PREC)  # d(beta e^G k)
    acc_da = tl.dot(b_dx.to(dt), tl.trans(b_w.to(dt)), input_precision=DOT_PREC)
    b_dxe = tl.sum(b_dx * b_ek, 1)
    acc_db = b_dxe  # through beta e^G k, then beta v
    acc_dg = b_beta * b_dxe  # through e^G
    acc_dk = (b_beta * b_eg)[:, None] * b_dx
    for i_v in range(0, V // BV):
        o_tv = (rows[:, None] * H + i_h) * V + i_v * BV + tl.arange(0, BV)[None, :]
        b_v = tl.load(v + o_tv, mask=m_r, other=0.0).to(tl.float32)
        b_u = tl.dot(b_ai, (b_beta[:, None] * b_v).to(dt), input_precision=DOT_PREC)
        b_dxv = tl.dot(tl.trans(b_ai), tl.load(du + o_tv, mask=m_r, other=0.0).to(dt),
                       input_precision=DOT_PREC)  # d(beta v)
        tl.store(dv + o_tv, (b_beta[:, None] * b_dxv).to(dv.dtype.element_ty), mask=m_r)
        acc_db += tl.sum(b_dxv * b_v, 1)
        acc_da = tl.dot(b_dxv.to(dt), tl.trans(b_u.to(dt)), acc_da, input_precision=DOT_PREC)
    # through the solve: dA = -dX (Ai X)^T (j < i), A = beta_i (k_i . k_j) exp(G_i - G_j)
    b_kk = tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PREC)
    b_p = -acc_da * _decay(b_gc, o_t[:, None] > o_t[None, :])
    b_pb = b_beta[:, None] * b_p
    b_daa = b_pb * b_kk  # dA * A
    b_dg = tl.cumsum(acc_dg + tl.sum(b_daa, 1) - tl.sum(b_daa, 0), 0, reverse=True)
    tl.store(dg + rows * H + i_h, b_dg, mask=rows < eos)
    tl.store(dbeta + rows * H + i_h, (acc_db + tl.sum(b_p * b_kk, 1)).to(dbeta.dtype.element_ty),
             mask=rows < eos)
    b_pbc = b_pb.to(dt)
    acc_dk = tl.dot(b_pbc, b_k, acc_dk, input_precision=DOT_PREC)
    acc_dk = tl.dot(tl.trans(b_pbc), b_k, acc_dk, input_precision=DOT_PREC)
    tl.store(dk + o_tk, acc_dk.to(dk.dtype.element_ty), mask=m_r)


@triton.jit
def _chunk_gdn_wy_grad_kernel(
    q, k, w, u, gc, aqk, hs, hs_scales, dhs, do, dq, dk, dw, dg, spans, scale, T,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
    QBV: tl.constexpr,
):
    """Program ``(chunk, head, role)`` of the recurrence from ``W``, ``U``, the chunk start
    states ``S`` and end-state gradients ``dS'``: role 0 writes ``dq`` and ``dg``, role 1
    ``dk``, role 2 ``dW``; each redoes ``delta = U - W S`` (or ``ddelta``) per value tile."""
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    i_c, i_h, i_r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if IS_VARLEN:  # index loads in the kernel body: see _launch.py
        t0 = tl.load(spans + 3 * i_c).to(tl.int64)
        eos = tl.load(spans + 3 * i_c + 1).to(tl.int64)
    else:
        t0, eos = fixed_chunk(i_c, T, BT)
    if t0 >= eos:
        return
    i_hk = i_h // (H // HK)
    dt = k.dtype.element_ty
    o_t, o_k = tl.arange(0, BT), tl.arange(0, K)
    rows = t0 + o_t
    m_r = (rows < eos)[:, None]
    last = tl.minimum(t0 + BT, eos) - 1
    b_k, b_gc = _keys_and_gates(k, gc, rows, m_r, last, i_h, H, HK, K)
    b_gl = tl.load(gc + last * H + i_h)
    b_eg = tl.exp(b_gc.to(tl.float32))
    b_el = tl.exp((b_gl - b_gc).to(tl.float32))
    p_s = hs + (i_c.to(tl.int64) * H + i_h) * K * V
    p_ds = dhs + (i_c.to(tl.int64) * H + i_h) * K * V
    p_sc = hs_scales  # float8 start states: their scales
    if QBV:
        p_sc = hs_scales + (i_c.to(tl.int64) * H + i_h) * (V // QBV)
    o_tk = (rows[:, None] * H + i_h) * K + o_k[None, :]
    o_s = o_k[:, None] * V + tl.arange(0, BV)[None, :]
    if i_r < 2:  # dq, dG (role 0) or dk (role 1): both through M, from delta
        b_w = tl.load(w + o_tk, mask=m_r, other=0.0).to(dt)
        acc_dm = tl.zeros([BT, BT], dtype=tl.float32)  # do delta^T
        acc_x = tl.zeros([BT, K], dtype=tl.float32)  # role 0: do S^T; role 1: dk
        acc_dg = tl.zeros([BT], dtype=tl.float32)  # per-row terms of dG
        acc_dl = tl.zeros([BT], dtype=tl.float32)  # dG_last, broadcast
        for i_v in range(0, V // BV):
            b_s = _start_state(p_s, p_sc, o_s + i_v * BV, i_v, BV, QBV).to(dt)
            b_ds = tl.load(p_ds + o_s + i_v * BV)
            o_tv = (rows[:, None] * H + i_h) * V + i_v * BV + tl.arange(0, BV)[None, :]
            b_u = tl.load(u + o_tv, mask=m_r, other=0.0).to(tl.float32)
            b_do = tl.load(do + o_tv, mask=m_r, other=0.0).to(dt)
            b_d = b_u - tl.dot(b_w, b_s, input_precision=DOT_PREC)
            acc_dm = tl.dot(b_do, tl.trans(b_d.to(dt)), acc_dm, input_precision=DOT_PREC)
            if i_r == 0:
                acc_x = tl.dot(b_do, tl.trans(b_s), acc_x, input_precision=DOT_PREC)
                b_dkds = b_d * (b_el[:, None] * tl.dot(b_k, b_ds, input_precision=DOT_PREC))
                acc_dg -= tl.sum(b_dkds, 1)
                acc_dl += tl.sum(b_dkds) + tl.exp(b_gl.to(tl.float32)) * tl.sum(
                    b_ds.to(tl.float32) * b_s.to(tl.float32))
            else:
                acc_x = tl.dot((b_el[:, None] * b_d).to(dt), tl.trans(b_ds), acc_x,
                               input_precision=DOT_PREC)
        b_q = tl.load(q + (rows[:, None] * HK + i_hk) * K + o_k[None, :], mask=m_r, other=0.0)
        b_dmd = (scale * acc_dm * _decay(b_gc, o_t[:, None] >= o_t[None, :])).to(dt)
        if i_r == 0:
            b_m = tl.load(aqk + (rows[:, None] * H + i_h) * BT + o_t[None, :], mask=m_r,
                          other=0.0)
            b_dmm = scale * acc_dm * b_m.to(tl.float32)  # dM * M
            b_dgc = tl.sum(b_dmm, 1) - tl.sum(b_dmm, 0) + acc_dg
            b_dgc += scale * b_eg * tl.sum(b_q.to(tl.float32) * acc_x, 1)
            acc_x = tl.dot(b_dmd, b_k, scale * b_eg[:, None] * acc_x, input_precision=DOT_PREC)
            tl.store(dq + o_tk, acc_x.to(dq.dtype.element_ty), mask=m_r)
            tl.store(dg + rows * H + i_h, tl.cumsum(b_dgc, 0, reverse=True) + acc_dl,
                     mask=rows < eos)
        else:
            acc_x = tl.dot(tl.trans(b_dmd), b_q, acc_x, input_precision=DOT_PREC)
            tl.store(dk + o_tk, acc_x.to(dk.dtype.element_ty), mask=m_r)
    else:  # dW = -ddelta S^T, ddelta = scale M^T do + e^{G_last - G} (k dS')
        b_m = tl.load(aqk + (rows[:, None] * H + i_h) * BT + o_t[None, :], mask=m_r, other=0.0)
        acc_dw = tl.zeros([BT, K], dtype=tl.float32)
        for i_v in range(0, V // BV):
            b_s = _start_state(p_s, p_sc, o_s + i_v * BV, i_v, BV, QBV).to(dt)
            b_ds = tl.load(p_ds + o_s + i_v * BV)
            o_tv = (rows[:, None] * H + i_h) * V + i_v * BV + tl.arange(0, BV)[None, :]
            b_do = tl.load(do + o_tv, mask=m_r, other=0.0).to(dt)
            b_dd = scale * tl.dot(tl.trans(b_m), b_do, input_precision=DOT_PREC)
            b_dd += b_el[:, None] * tl.dot(b_k, b_ds, input_precision=DOT_PREC)
            acc_dw = tl.dot(b_dd.to(dt), tl.trans(b_s), acc_dw, input_precision=DOT_PREC)
        tl.store(dw + o_tk, (-acc_dw).to(dw.dtype.element_ty), mask=m_r)


# -- the operands -----------------------------------------------------------------------------


def gdn_wy_operands_fwd(k, v, g, beta, cu_seqlens, *, chunk_size):
    """``(W, U, gc, ai)``: the WY operands ``W [B, T, Hv, K]`` and ``U [B, T, Hv, V]`` in
    ``promote_types(k.dtype, float32)``, then what :func:`gdn_wy_operands_bwd` takes as
    ``prepared`` (the in-chunk cumulative gates and ``(I + A)^-1``, as
    :func:`~.chunk_gdn_fwd.chunk_gdn_fwd`). Inputs as there (no ``q``).

    Raises:
        ValueError: inputs that :func:`gdn_wy_kernel_supports` does not cover.
    """
    require_gdn_kernels(k, k, v, g, beta, None, cu_seqlens, chunk_size)
    k, v, g, beta = (t.contiguous() for t in (k, v, g, beta))
    layout = gdn_layout(k, v, cu_seqlens)
    batch, length, n, hk, hv, dk, dv, bound, _, spans = layout
    gc, ai, _ = gdn_prepare(None, k, g, beta, cu_seqlens, layout, with_m=False)
    dtype = work_dtype(k.dtype)
    w = torch.empty((batch, length, hv, dk), dtype=dtype, device=k.device)
    u = torch.empty((batch, length, hv, dv), dtype=dtype, device=k.device)
    wrap_triton(_chunk_gdn_wy_fwd_kernel)[(bound, hv)](
        k, v, gc, beta, ai, w, u, spans, length,
        H=hv, HK=hk, K=dk, V=dv, BT=CHUNK, BV=min(dv, 64), IS_VARLEN=cu_seqlens is not None,
        DOT_PREC=dot_precision(k.dtype), num_warps=chunk_warps(dk, dv, k.dtype),
    )
    return w, u, gc, ai


def operands_bwd_config(k_dim: int, v_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """``(BV, num_stages, num_warps)`` of ``_chunk_gdn_wy_bwd_kernel``.

    Two pipeline stages over the value tiles: with one stage (as :func:`grad_config`,
    BV 16, 4 warps) Triton 3.6's sm_90 code for bf16
    at K = V = 128 reads shared memory out of bounds in the value loop (compute-sanitizer on
    the H200: an illegal memory access). Warps: :func:`~.chunk_gdn_bwd.chunk_warps`.
    """
    return min(v_dim, 32), 2, chunk_warps(k_dim, v_dim, dtype)


def grad_config(k_dim: int, v_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """``(BV, num_stages, num_warps)`` of ``_chunk_gdn_wy_grad_kernel``: BV 16, one stage
    (sm_90 cubin of Triton 3.9, bf16, K = V = 128: 255 registers, 48 B of stack a thread);
    warps: :func:`~.chunk_gdn_bwd.chunk_warps`."""
    return 16, 1, chunk_warps(k_dim, v_dim, dtype)


def gdn_wy_operands_bwd(k, v, g, beta, cu_seqlens, dw, du, *, chunk_size, prepared=None):
    """Gradients of :func:`gdn_wy_operands_fwd` for ``dw`` (like ``W``) and ``du`` (like
    ``U``): ``(dk, dv, dg, dbeta)`` in the dtypes of ``k, v, g, beta``. ``prepared``: its
    ``(gc, ai)``, or None to run the prepare kernel again."""
    require_gdn_kernels(k, k, v, g, beta, None, cu_seqlens, chunk_size)
    k, v, g, beta, dw, du = (t.contiguous() for t in (k, v, g, beta, dw, du))
    layout = gdn_layout(k, v, cu_seqlens)
    batch, length, n, hk, hv, dk_, dv_, bound, _, spans = layout
    if prepared is None:
        prepared = gdn_prepare(None, k, g, beta, cu_seqlens, layout, with_m=False)[:2]
    gc, ai = prepared
    dk, _ = key_grads(k, hv)
    dv = torch.empty_like(v)
    dg = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    dbeta = torch.empty_like(beta)
    tile, stages, warps = operands_bwd_config(dk_, dv_, k.dtype)
    wrap_triton(_chunk_gdn_wy_bwd_kernel)[(bound, hv)](
        k, v, gc, beta, ai, dw, du, dk, dv, dg, dbeta, spans, length,
        H=hv, HK=hk, K=dk_, V=dv_, BT=CHUNK, BV=tile, IS_VARLEN=cu_seqlens is not None,
        DOT_PREC=dot_precision(k.dtype), num_warps=warps, num_stages=stages,
    )
    return sum_groups(dk, k), dv, floored_gate_grad(dg, g), dbeta


# -- the recurrence -----------------------------------------------------------------------------


def gdn_wy_recurrence_fwd(q, k, w, u, g, initial_state, cu_seqlens, *, chunk_size, scale,
                          state_v_first, state_qdq=False, state_qdq_block_v=64):
    """The chunk recurrence from the WY operands ``W [B, T, Hv, K]``, ``U [B, T, Hv, V]``
    (float16, bfloat16 or float32; the dots take them in ``k``'s dtype).

    Returns ``(o, final_state, gc, aqk, hs, hs_scales)``: ``o [B, T, Hv, V]`` in ``q``'s
    dtype, the final state as :func:`~.chunk_gdn_fwd.chunk_gdn_fwd`, then what
    :func:`gdn_wy_recurrence_bwd` takes as ``prepared`` (the gates, ``M`` and, with
    ``state_qdq``, the float8 chunk start states; None without).

    Raises:
        ValueError: inputs that :func:`gdn_wy_kernel_supports` does not cover.
    """
    _require(q, k, w, u, g, initial_state, cu_seqlens, chunk_size, state_qdq=state_qdq,
             state_qdq_block_v=state_qdq_block_v)
    q, k, w, u, g = (t.contiguous() for t in (q, k, w, u, g))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    layout = gdn_layout(q, u, cu_seqlens)
    gc, _, aqk = gdn_prepare(q, k, g, None, cu_seqlens, layout, with_ai=False)
    o, ht, hs, hs_scales = _recurrence(
        q, k, u, gc, None, None, aqk, initial_state, cu_seqlens, layout,
        scale=_scale(scale, q), state_v_first=state_v_first, recompute=False,
        qdq_block_v=state_qdq_block_v if state_qdq else 0, w=w, keep_states=True,
    )
    return o, ht, gc, aqk, hs, hs_scales


def gdn_wy_recurrence_bwd(q, k, w, u, g, initial_state, cu_seqlens, do, dht, *, chunk_size,
                          scale, state_v_first, state_qdq=False, state_qdq_block_v=64,
                          prepared=None):
    """Gradients of :func:`gdn_wy_recurrence_fwd` for ``do`` and ``dht`` (None: zero):
    ``(dq, dk, dw, du, dg, dh0)`` in the dtypes of ``q, k, w, u, g, initial_state``
    (``dh0`` None without an initial state). ``prepared``: its ``(gc, aqk, hs,
    hs_scales)`` or None (then the prepare kernel runs again); the chunk start states are
    recomputed unless given. QDQ passes gradients unchanged (straight-through)."""
    _require(q, k, w, u, g, initial_state, cu_seqlens, chunk_size, state_qdq=state_qdq,
             state_qdq_block_v=state_qdq_block_v)
    q, k, w, u, g, do = (t.contiguous() for t in (q, k, w, u, g, do))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    if dht is not None:
        dht = dht.contiguous()
    layout = gdn_layout(q, u, cu_seqlens)
    batch, length, n, hk, hv, dk_, dv_, bound, _, spans = layout
    scale = _scale(scale, q)
    if prepared is None:
        gc, _, aqk = gdn_prepare(q, k, g, None, cu_seqlens, layout, with_ai=False)
        prepared = (gc, aqk, None, None)
    gc, aqk, hs, hs_scales = prepared
    if hs is None:
        hs, hs_scales, _ = gdn_recompute_states(
            k, u, gc, None, None, initial_state, cu_seqlens, layout,
            state_v_first=state_v_first, qdq_block_v=state_qdq_block_v if state_qdq else 0,
            w=w)
    du, _, dhs, dh0 = gdn_state_grads(q, k, gc, None, None, aqk, u, do, dht, initial_state,
                                   cu_seqlens, layout, scale=scale,
                                   state_v_first=state_v_first, hs_shape=hs.shape, w=w)
    dq, dk = key_grads(q, hv)
    dw = torch.empty_like(w)
    dg = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    tile, stages, warps = grad_config(dk_, dv_, k.dtype)
    wrap_triton(_chunk_gdn_wy_grad_kernel)[(bound, hv, 3)](
        q, k, w, u, gc, aqk, hs, hs_scales, dhs, do, dq, dk, dw, dg, spans, scale, length,
        H=hv, HK=hk, K=dk_, V=dv_, BT=CHUNK, BV=tile, IS_VARLEN=cu_seqlens is not None,
        DOT_PREC=dot_precision(k.dtype),
        QBV=qdq_tile_width(dk_, dv_, state_qdq_block_v, k.dtype) if state_qdq else 0,
        num_warps=warps, num_stages=stages,
    )
    if dh0 is not None and dh0.dtype != initial_state.dtype:
        dh0 = dh0.to(initial_state.dtype)
    return sum_groups(dq, q), sum_groups(dk, k), dw, du, floored_gate_grad(dg, g), dh0
