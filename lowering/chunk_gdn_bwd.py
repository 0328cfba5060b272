"""Backward of chunked Gated DeltaNet in Triton: three launches.

Notation of :mod:`.chunk_gdn_fwd`; per chunk with start state ``S``, end-state
gradient ``dS'``, ``x = beta (v - (e^G k) S)``, ``delta = Ai x``,
``M = (q k^T) * exp(G_i - G_j)`` (``j <= i``):

1. the forward recurrence again, keeping each chunk's start state ``S`` and ``delta``
   (with FP8 state QDQ the same kernel and tiles as the forward's, so the same float8
   states bit for bit: the gradient passes every QDQ unchanged, so only ``S`` differs);
2. ``_chunk_gdn_bwd_state_kernel``, chunks in reverse with ``dS`` in registers:
   ``ddelta = scale M^T do + (e^{G_last - G} k) dS'``, ``dx = Ai^T ddelta`` (kept),
   ``dv = beta dx`` (final) and
   ``dS = e^{G_last} dS' + scale (e^G q)^T do - (e^G k)^T dv``; it keeps each
   chunk's ``dS'`` and writes ``dh0``. It needs no ``S``. (With ``WY``, for the
   ``w_quantizer`` path: ``dU = ddelta`` and ``dS`` takes ``-W^T ddelta``. Carrying
   ``dS`` that way on the plain path too, from a launch that forms ``W``, took 1.167 +
   0.125 ms against 1.034 at 8 x 4096 x 16 bf16, H100.)
3. ``_chunk_gdn_bwd_grad_kernel``, one program per key tile of ``BK`` columns, chunk and
   value head (key tiles of one chunk adjacent, so the second reads the chunk's
   ``[BT, V]`` operands from L2), from ``S``, ``dS'``, ``do``, ``delta`` and ``dx``. Over
   the value tiles it sums ``do S^T``, ``delta dS'^T``, ``dx S^T`` (``[BT, BK]``) and
   ``do delta^T``, ``dx delta^T`` (``[BT, BT]``), then writes its columns of
   ``dq = scale (e^G do S^T + (dM * D) k)`` and
   ``dk = e^{G_last - G} delta dS'^T - beta e^G dx S^T + (dM * D)^T q + P k + P^T k``
   (``dM = scale do delta^T``, ``D = exp(G_i - G_j)``; the solve enters through
   ``dA = -(dx delta^T)`` below the diagonal, ``P = beta dA * D``). Each gate-gradient
   and ``dbeta`` term is a sum over keys or needs no key (``dM * M``, ``dx . v``: key
   tile 0 adds those), so each key tile writes its part of both (the gate gradient
   with respect to ``G``, then a reverse cumulative sum in the chunk), summed afterwards.

Grouped value heads write per-value-head ``dq``/``dk`` in float32, summed over
each group afterwards. ``G`` is the forward's float64 cumulative gate (floored gates:
see :mod:`.chunk_gdn_fwd`); ``dg`` is zero where ``g`` is below the floor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from kdn_compile.reference.delta_rule import GDN_GATE_FLOOR

from ._launch import dot_precision, fixed_chunk, fixed_sequence, state_tile
from .chunk_gdn_fwd import (
    CHUNK, _scale, gdn_layout, gdn_prepare, gdn_recompute_states, qdq_tile_width,
    recurrence_config, require_gdn_kernels,
)
from .fp8 import dequantize_tile

__all__ = [
    "chunk_gdn_bwd", "chunk_warps", "floored_gate_grad", "gdn_state_grads", "grad_config",
    "key_grads", "sum_groups",
]


@triton.jit
def _decay(b_gc, m):
    """``exp(G_i - G_j)`` where ``m``, else 0 (no overflow above the diagonal); ``G`` float64,
    the difference rounded to float32."""
    return tl.exp(tl.where(m, (b_gc[:, None] - b_gc[None, :]).to(tl.float32), float("-inf")))


@triton.jit
def _chunk_gdn_bwd_state_kernel(
    q, k, gc, beta, ai, aqk, w, do, dv, dx, dht, dh0, dhs, cu_seqlens, offsets, scale, T,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr,
    STATE_V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
    WY: tl.constexpr,
):
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    # a head's value tiles on adjacent programs, so that they run in the same wave and
    # share their reads of q, k, Ai and M through L2
    i_nh, i_v = tl.program_id(0) // (V // BV), tl.program_id(0) % (V // BV)
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HK)
    if IS_VARLEN:  # index loads in the kernel body: see _launch.py
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        c0 = tl.load(offsets + i_n).to(tl.int64)
    else:
        bos, eos, c0 = fixed_sequence(i_n, T, BT)
    dt = k.dtype.element_ty
    b_dh = tl.zeros([K, BV], dtype=tl.float32)
    if HAS_DHT:
        b_dh += tl.load(dht + i_nh.to(tl.int64) * K * V
                        + state_tile(i_v, K, V, BV, STATE_V_FIRST)).to(tl.float32)
    q += (bos * HK + i_hk) * K
    k += (bos * HK + i_hk) * K
    do += (bos * H + i_h) * V
    dv += (bos * H + i_h) * V
    gc += bos * H + i_h
    if WY:
        w += (bos * H + i_h) * K
    else:
        beta += bos * H + i_h
        ai += (bos * H + i_h) * BT
        dx += (bos * H + i_h) * V
    aqk += (bos * H + i_h) * BT
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    length = eos - bos
    nt = tl.cdiv(length, BT)
    for j in range(0, nt):
        i_t = nt - 1 - j
        p_dhs = dhs + ((c0 + i_t) * H + i_h) * K * V
        tl.store(p_dhs + o_k[:, None] * V + o_v[None, :], b_dh.to(dhs.dtype.element_ty))
        rows = i_t * BT + o_t
        m_r = (rows < length)[:, None]
        last = tl.minimum(i_t * BT + BT, length) - 1
        b_k = tl.load(k + rows[:, None] * (HK * K) + o_k[None, :], mask=m_r, other=0.0)
        b_do = tl.load(do + rows[:, None] * (H * V) + o_v[None, :], mask=m_r, other=0.0)
        b_m = tl.load(aqk + rows[:, None] * (H * BT) + o_t[None, :], mask=m_r, other=0.0)
        b_gc = tl.load(gc + tl.minimum(rows, last) * H)  # float64
        b_gl = tl.load(gc + last * H)
        b_eg = tl.exp(b_gc.to(tl.float32))[:, None]
        # ddelta = scale M^T do + e^{G_last - G} (k dS')
        b_dd = scale * tl.dot(tl.trans(b_m), b_do.to(dt), input_precision=DOT_PREC)
        b_el = tl.exp((b_gl - b_gc).to(tl.float32))[:, None]
        b_dd += b_el * tl.dot(b_k, b_dh.to(dt), input_precision=DOT_PREC)
        if WY:  # delta = U - W S: dU = ddelta (in dv), and -W^T ddelta into dS
            tl.store(dv + rows[:, None] * (H * V) + o_v[None, :], b_dd.to(dv.dtype.element_ty),
                     mask=m_r)
            b_w = tl.load(w + rows[:, None] * (H * K) + o_k[None, :], mask=m_r, other=0.0)
            b_wd = tl.dot(tl.trans(b_w.to(dt)), b_dd.to(dt), input_precision=DOT_PREC)
        else:  # dv = beta Ai^T ddelta, and -k^T (e^G dv) into dS
            b_ai = tl.load(ai + rows[:, None] * (H * BT) + o_t[None, :], mask=m_r, other=0.0)
            b_beta = tl.load(beta + rows * H, mask=rows < length, other=0.0).to(tl.float32)
            b_dx = tl.dot(tl.trans(b_ai), b_dd.to(dt), input_precision=DOT_PREC)
            b_dv = (b_beta[:, None] * b_dx).to(dt)
            tl.store(dv + rows[:, None] * (H * V) + o_v[None, :], b_dv.to(dv.dtype.element_ty),
                     mask=m_r)
            tl.store(dx + rows[:, None] * (H * V) + o_v[None, :], b_dx.to(dx.dtype.element_ty),
                     mask=m_r)
            b_wd = tl.dot(tl.trans(b_k), (b_eg * b_dv).to(dt), input_precision=DOT_PREC)
        # dS = e^{G_last} dS' + scale q^T (e^G do) - W^T ddelta
        b_q = tl.load(q + rows[:, None] * (HK * K) + o_k[None, :], mask=m_r, other=0.0)
        b_dh = b_dh * tl.exp(b_gl.to(tl.float32))
        b_dh += tl.dot(tl.trans(b_q), (scale * b_eg * b_do).to(dt), input_precision=DOT_PREC)
        b_dh -= b_wd
    if HAS_H0:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + state_tile(i_v, K, V, BV, STATE_V_FIRST), b_dh)


@triton.jit
def _start_state(p_s, p_sc, o_s, i_v, BV: tl.constexpr, QBV: tl.constexpr):
    """Value tile ``i_v`` of a chunk's start state: as stored, or (``QBV``, state QDQ) float8
    with one scale per ``QBV`` columns, dequantized to the float32 tile the forward held."""
    b_s = tl.load(p_s + o_s)
    if QBV:
        b_s = dequantize_tile(b_s, tl.load(p_sc + (i_v * BV) // QBV))
    return b_s


@triton.jit
def _chunk_gdn_bwd_grad_kernel(
    q, k, v, gc, beta, aqk, hs, hs_scales, dhs, do, delta, dx, dq, dk, dg, dbeta, spans,
    scale, T,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr, QBV: tl.constexpr,
):
    """Program ``(key tile, chunk, head)``: the ``BK`` key columns of ``dq`` and ``dk``, and
    this key tile's part of ``dg`` and ``dbeta`` (entry ``i_k`` of their last axis), from
    ``S``, ``dS'``, ``do``, ``delta`` and ``dx``. Key tile 0 adds the key-free terms."""
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    i_k, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if IS_VARLEN:  # index loads in the kernel body: see _launch.py
        t0 = tl.load(spans + 3 * i_c).to(tl.int64)
        eos = tl.load(spans + 3 * i_c + 1).to(tl.int64)
    else:
        t0, eos = fixed_chunk(i_c, T, BT)
    if t0 >= eos:
        return
    i_hk = i_h // (H // HK)
    dt = k.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    rows = t0 + o_t
    m_r = (rows < eos)[:, None]
    last = tl.minimum(t0 + BT, eos) - 1
    m_first = (rows < tl.where(i_k == 0, eos, t0))[:, None]  # rows, in key tile 0 only

    b_gc = tl.load(gc + tl.minimum(rows, last) * H + i_h)  # float64
    b_gl = tl.load(gc + last * H + i_h)
    b_beta = tl.load(beta + rows * H + i_h, mask=rows < eos, other=0.0).to(tl.float32)
    b_eg = tl.exp(b_gc.to(tl.float32))
    b_el = tl.exp((b_gl - b_gc).to(tl.float32))
    o_s = o_k[:, None] * V + tl.arange(0, BV)[None, :]
    p_s = hs + (i_c.to(tl.int64) * H + i_h) * K * V
    p_ds = dhs + (i_c.to(tl.int64) * H + i_h) * K * V
    p_sc = hs_scales  # float8 start states: their scales
    if QBV:
        p_sc = hs_scales + (i_c.to(tl.int64) * H + i_h) * (V // QBV)
    o_tv = (rows[:, None] * H + i_h) * V + tl.arange(0, BV)[None, :]
    acc_dq = tl.zeros([BT, BK], dtype=tl.float32)  # do S^T
    acc_q = tl.zeros([BT, BK], dtype=tl.float32)  # delta dS'^T
    acc_p = tl.zeros([BT, BK], dtype=tl.float32)  # dx S^T
    acc_dm = tl.zeros([BT, BT], dtype=tl.float32)  # do delta^T
    acc_da = tl.zeros([BT, BT], dtype=tl.float32)  # dx delta^T
    acc_xv = tl.zeros([BT], dtype=tl.float32)  # rows of dx . v (key tile 0)
    acc_ss = tl.zeros([BK], dtype=tl.float32)  # dS' . S over this key tile
    for i_v in range(0, V // BV):
        b_s = _start_state(p_s, p_sc, o_s + i_v * BV, i_v, BV, QBV).to(dt)
        b_ds = tl.load(p_ds + o_s + i_v * BV)
        b_do = tl.load(do + o_tv + i_v * BV, mask=m_r, other=0.0).to(dt)
        b_d = tl.load(delta + o_tv + i_v * BV, mask=m_r, other=0.0)
        b_dx = tl.load(dx + o_tv + i_v * BV, mask=m_r, other=0.0)
        acc_dq = tl.dot(b_do, tl.trans(b_s), acc_dq, input_precision=DOT_PREC)
        acc_q = tl.dot(b_d, tl.trans(b_ds), acc_q, input_precision=DOT_PREC)
        acc_p = tl.dot(b_dx, tl.trans(b_s), acc_p, input_precision=DOT_PREC)
        acc_dm = tl.dot(b_do, tl.trans(b_d), acc_dm, input_precision=DOT_PREC)
        acc_da = tl.dot(b_dx, tl.trans(b_d), acc_da, input_precision=DOT_PREC)
        acc_ss += tl.sum(b_ds.to(tl.float32) * b_s.to(tl.float32), 1)
        b_v = tl.load(v + o_tv + i_v * BV, mask=m_first, other=0.0)
        acc_xv += tl.sum(b_dx.to(tl.float32) * b_v.to(tl.float32), 1)
    o_tk = (rows[:, None] * H + i_h) * K + o_k[None, :]
    b_k = tl.load(k + (rows[:, None] * HK + i_hk) * K + o_k[None, :], mask=m_r, other=0.0)
    b_q = tl.load(q + (rows[:, None] * HK + i_hk) * K + o_k[None, :], mask=m_r, other=0.0)
    # through o = scale (e^G q S + M delta): dM = scale do delta^T (j <= i)
    b_dgc = scale * b_eg * tl.sum(b_q.to(tl.float32) * acc_dq, 1)
    b_dmd = (scale * acc_dm * _decay(b_gc, o_t[:, None] >= o_t[None, :])).to(dt)
    acc_dq = tl.dot(b_dmd, b_k, scale * b_eg[:, None] * acc_dq, input_precision=DOT_PREC)
    tl.store(dq + o_tk, acc_dq.to(dq.dtype.element_ty), mask=m_r)
    b_m = tl.load(aqk + (rows[:, None] * H + i_h) * BT + o_t[None, :], mask=m_first, other=0.0)
    b_dmm = scale * acc_dm * b_m.to(tl.float32)  # dM * M (key tile 0)
    b_dgc += tl.sum(b_dmm, 1) - tl.sum(b_dmm, 0)
    # through x = beta (v - e^G k S) and S' = e^{G_last} S + (e^{G_last - G} k)^T delta
    b_kq = b_el * tl.sum(b_k.to(tl.float32) * acc_q, 1)
    b_kp = b_eg * tl.sum(b_k.to(tl.float32) * acc_p, 1)
    b_dgc -= b_kq + b_beta * b_kp
    b_dl = tl.sum(b_kq) + tl.exp(b_gl.to(tl.float32)) * tl.sum(acc_ss)  # dG_last
    acc_dk = b_el[:, None] * acc_q - (b_beta * b_eg)[:, None] * acc_p
    acc_dk = tl.dot(tl.trans(b_dmd), b_q, acc_dk, input_precision=DOT_PREC)
    # through the solve: dA = -dx delta^T (j < i), A = beta_i (k_i . k_j) exp(G_i - G_j)
    b_kk = tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PREC)  # this key tile's part
    b_p = -acc_da * _decay(b_gc, o_t[:, None] > o_t[None, :])
    b_pb = b_beta[:, None] * b_p
    b_daa = b_pb * b_kk  # dA * A
    b_dgc += tl.sum(b_daa, 1) - tl.sum(b_daa, 0)
    b_pbc = b_pb.to(dt)
    acc_dk = tl.dot(b_pbc, b_k, acc_dk, input_precision=DOT_PREC)
    acc_dk = tl.dot(tl.trans(b_pbc), b_k, acc_dk, input_precision=DOT_PREC)
    tl.store(dk + o_tk, acc_dk.to(dk.dtype.element_ty), mask=m_r)
    o_part = (rows * H + i_h) * (K // BK) + i_k  # [B, T, H, key tiles]
    tl.store(dg + o_part, tl.cumsum(b_dgc, 0, reverse=True) + b_dl, mask=rows < eos)
    tl.store(dbeta + o_part, acc_xv - b_kp + tl.sum(b_p * b_kk, 1), mask=rows < eos)


def grad_config(k_dim: int, v_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """``(BK, BV, num_stages, num_warps)`` of ``_chunk_gdn_bwd_grad_kernel``: 64-key tiles
    (the whole key at K = V = 128 in half precision), at least two value steps of at most
    64, two stages, 8 warps (:func:`chunk_warps`' 2 where it says 2).

    At K = V = 128, bf16, 8x4096x16 on an H100 the whole backward takes 2.421 ms with one
    128-key tile against 2.747 with two of 64 (1x32768x16: 3.552 against 3.865), though
    the sm_90 cubin of Triton 3.9 then keeps 24 B a thread in local memory (56 B packed)
    where 64-key tiles keep none (223 registers). Elsewhere 64-key tiles: no local memory
    at K = V = 64 (BV 32: 223 registers) and K = V = 256 (218), against 416 B on 4 warps,
    384 B in one value step of 64 at K = V = 64. With 2 warps (half inputs, K = V = 32)
    it spills about 1.8 KB a thread.
    """
    warps = chunk_warps(k_dim, v_dim, dtype)
    tile = max(16, min(64, v_dim // 2))
    key_tile = 128 if dtype != torch.float32 and k_dim == v_dim == 128 else min(k_dim, 64)
    return key_tile, tile, 2, 8 if warps == 4 else warps


def chunk_warps(k_dim: int, v_dim: int, dtype: torch.dtype) -> int:
    """Warps of a per-chunk GDN kernel: 4, or 2 with half inputs and a head size below 64.

    There Triton 3.6 miscompiles 4 or 8 warps on Hopper (wrong ``dk`` at K = 16, 32 and
    at V = 16, illegal accesses at K, V <= 32, in the grad kernel and both WY operand
    kernels), as for FLA's similar WY backward kernel; 2 warps compute them right.
    """
    return 2 if dtype != torch.float32 and min(k_dim, v_dim) < 64 else 4


def chunk_gdn_bwd(q, k, v, g, beta, initial_state, cu_seqlens, do, dht, *,
                  chunk_size, scale, state_v_first, state_qdq=False, state_qdq_block_v=64,
                  prepared=None):
    """Gradients of :func:`chunk_gdn_fwd` for ``do`` (like ``o``) and ``dht`` (like the final state).

    Inputs as :func:`chunk_gdn_fwd`; ``prepared`` is its ``(gc, ai, aqk)`` or None (then
    the prepare kernel runs again); the
    chunk start states are recomputed with ``delta`` (under ``state_qdq``, the forward's
    float8 states bit for bit). With ``state_qdq`` the gradient passes each QDQ unchanged
    (straight-through), so only the start states differ. ``dht`` may be None (zero). Returns
    ``(dq, dk, dv, dg, dbeta, dh0)`` in the dtypes of
    ``q, k, v, g, beta, initial_state``; ``dh0`` is None without an initial state.
    Raises ValueError for inputs that
    :func:`~.chunk_gdn_fwd.gdn_kernel_supports` does not cover.
    """
    require_gdn_kernels(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size,
                        state_qdq=state_qdq, state_qdq_block_v=state_qdq_block_v)
    q, k, v, g, beta, do = (t.contiguous() for t in (q, k, v, g, beta, do))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    if dht is not None:
        dht = dht.contiguous()
    layout = gdn_layout(q, v, cu_seqlens)
    batch, length, n, hk, hv, dk_, dv_, bound, offsets, spans = layout
    scale = _scale(scale, q)
    qdq_width = qdq_tile_width(dk_, dv_, state_qdq_block_v, k.dtype) if state_qdq else 0

    if prepared is None:
        prepared = gdn_prepare(q, k, g, beta, cu_seqlens, layout)
    gc, ai, aqk = prepared
    # With state QDQ this recomputes the forward's float8 states bit for bit (the same
    # kernel and tiles) alongside delta.
    hs, hs_scales, delta = gdn_recompute_states(
        k, v, gc, beta, ai, initial_state, cu_seqlens, layout,
        state_v_first=state_v_first, qdq_block_v=state_qdq_block_v if state_qdq else 0,
        deltas=True)
    dv, dx, dhs, dh0 = gdn_state_grads(
        q, k, gc, beta, ai, aqk, v, do, dht, initial_state, cu_seqlens, layout, scale=scale,
        state_v_first=state_v_first, hs_shape=hs.shape)
    dq, dk = key_grads(q, hv)
    key_tile, tile, stages, warps = grad_config(dk_, dv_, k.dtype)
    if qdq_width:
        tile = min(tile, qdq_width)  # one scale per value tile
    parts = dk_ // key_tile
    dg = torch.empty(tuple(g.shape) + (parts,), dtype=torch.float32, device=g.device)
    dbeta = torch.empty(tuple(beta.shape) + (parts,), dtype=torch.float32, device=beta.device)
    wrap_triton(_chunk_gdn_bwd_grad_kernel)[(parts, bound, hv)](
        q, k, v, gc, beta, aqk, hs, hs_scales, dhs, do, delta, dx, dq, dk, dg, dbeta,
        spans, scale, length,
        H=hv, HK=hk, K=dk_, V=dv_, BT=CHUNK, BK=key_tile, BV=tile,
        IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision(k.dtype), QBV=qdq_width,
        num_warps=warps, num_stages=stages,
    )
    dg, dbeta = floored_gate_grad(dg.sum(-1), g), dbeta.sum(-1).to(beta.dtype)
    dq, dk = sum_groups(dq, q), sum_groups(dk, k)
    if dh0 is not None and dh0.dtype != initial_state.dtype:
        dh0 = dh0.to(initial_state.dtype)
    return dq, dk, dv, dg, dbeta, dh0


def gdn_state_grads(q, k, gc, beta, ai, aqk, v, do, dht, initial_state, cu_seqlens, layout, *,
                    scale, state_v_first, hs_shape, w=None):
    """Launch the state-gradient pass: ``(dv, dx, dhs, dh0)``, ``dv`` like ``v``, ``dx =
    Ai^T ddelta`` like ``v`` in ``k``'s dtype (None with ``w``), each chunk's end-state
    gradient ``dhs`` (``hs_shape``, ``k``'s dtype) and ``dh0`` (float32, None without an
    initial state). ``w``: the WY operands given (``v`` is ``U``, ``dv`` its gradient;
    ``beta`` and ``ai`` unused)."""
    batch, length, n, hk, hv, dk_, dv_, bound, offsets, _ = layout
    tile, stages, warps = recurrence_config(dk_, dv_, k.dtype, n * hv, v.device,
                                            "state" if w is None else None)
    dhs = k.new_empty(hs_shape)
    dv = torch.empty_like(v)
    dx = None if w is not None else torch.empty(v.shape, dtype=k.dtype, device=v.device)
    dh0 = None
    if initial_state is not None:
        dh0 = torch.empty(initial_state.shape, dtype=torch.float32, device=v.device)
    wrap_triton(_chunk_gdn_bwd_state_kernel)[(n * hv * (dv_ // tile),)](
        q, k, gc, beta, ai, aqk, w, do, dv, dx, dht, dh0, dhs, cu_seqlens, offsets, scale,
        length, H=hv, HK=hk, K=dk_, V=dv_, BT=CHUNK, BV=tile,
        HAS_DHT=dht is not None, HAS_H0=initial_state is not None,
        STATE_V_FIRST=state_v_first, IS_VARLEN=cu_seqlens is not None,
        DOT_PREC=dot_precision(k.dtype), WY=w is not None, num_warps=warps, num_stages=stages,
    )
    return dv, dx, dhs, dh0


def floored_gate_grad(dg, g):
    """``dg`` (float32, through the floored gates) in ``g``'s dtype, zero where ``g`` is
    below ``GDN_GATE_FLOOR``: the floor's gradient."""
    return torch.where(g < GDN_GATE_FLOOR, 0.0, dg).to(g.dtype)


def key_grads(q, value_heads):
    """Uninitialised per-value-head ``dq``, ``dk`` ``[B, T, Hv, K]``: in ``q``'s dtype, or
    float32 for grouped heads (summed over each group by :func:`sum_groups`)."""
    dtype = q.dtype if q.shape[2] == value_heads else torch.float32
    shape = q.shape[:2] + (value_heads, q.shape[3])
    return q.new_empty(shape, dtype=dtype), q.new_empty(shape, dtype=dtype)


def sum_groups(grad, like):
    """A per-value-head gradient ``[B, T, Hv, K]`` summed into ``like``'s key heads, in
    ``like``'s dtype."""
    b, t, hk, dk = like.shape
    if grad.shape[2] == hk:
        return grad
    return grad.view(b, t, hk, grad.shape[2] // hk, dk).sum(3).to(like.dtype)
