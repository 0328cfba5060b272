"""Exact references for the gated delta rule: GDN (scalar decay) and KDA (per-key decay).

Per value head, with state ``S`` of shape ``[K, V]`` and ``D_t = diag(exp(g_t))``
(a scalar ``exp(g_t)`` for GDN)::

    S_t = (I - beta_t k_t k_t^T) D_t S_{t-1} + beta_t k_t v_t^T
    o_t = scale * S_t^T q_t

The chunked forms regroup the same recurrence into chunks of ``chunk_size``
tokens (WY representation with one unit-lower-triangular solve per chunk) and
agree with the token loop to rounding. Everything here is differentiable,
accumulates in ``promote_types(dtype, float32)`` and reads ``cu_seqlens`` on
the CPU: these are oracles, not the fast path.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from kdn_compile._checks import check_delta_inputs, num_sequences
from kdn_compile.reference._common import (
    causal_mask,
    decay_between,
    heads_first,
    segments,
    state_key_first,
    to_work,
    work_dtype,
)
from kdn_compile.reference.fp8 import state_fp8_qdq_reference

__all__ = [
    "GDN_GATE_FLOOR",
    "chunk_gdn_reference",
    "chunk_kda_reference",
    "recurrent_delta_rule_reference",
    "gdn_wy_operands_reference",
    "gdn_wy_recurrence_reference",
    "two_key_chunk_recurrence",
]


def _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first):
    """Head-major working copies, the default scale and a key-first initial state."""
    hv = v.shape[2]
    dtype = work_dtype(q.dtype)
    n = num_sequences(q.shape[0], cu_seqlens)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if initial_state is None:
        state = q.new_zeros((n, hv, k.shape[-1], v.shape[-1]), dtype=dtype)
    else:
        state = state_key_first(initial_state, state_v_first).to(dtype)
    gate = g if g.dim() == 4 else g[..., None]
    tensors = (
        heads_first(q.to(dtype), hv),
        heads_first(k.to(dtype), hv),
        heads_first(v.to(dtype), hv),
        heads_first(gate.to(dtype), hv),
        heads_first(beta.to(dtype)[..., None], hv)[..., 0],
    )
    return tensors, state, scale


def _finish(outputs, states, v, state_v_first):
    o = torch.cat(outputs, dim=2).transpose(1, 2).to(v.dtype)
    state = torch.cat(states, dim=0)
    return o, (state.transpose(-1, -2) if state_v_first else state)


def _run(core, tensors, state, cu_seqlens, **kwargs):
    """Apply ``core`` to each independent run; ``tensors`` are ``[B, H, T, ...]``."""
    outputs, states = [], []
    batch, length = tensors[0].shape[0], tensors[0].shape[2]
    for rows, times in segments(cu_seqlens, batch, length):
        o, s = core(*(t[:, :, times] for t in tensors), state[rows], **kwargs)
        outputs.append(o)
        states.append(s)
    return outputs, states


def token_loop(q, k, v, gate, beta, state, *, scale, every_state=None):
    """The token recurrence on head-major ``[B, H, T, ...]`` tensors (``gate`` ``[B, H, T, K
    or 1]``) from ``state [B, H, K, V]``: ``(o [B, H, T, V], final state)``. A list passed
    as ``every_state`` receives the state after each token."""
    outputs = []
    for t in range(q.shape[2]):
        state = state * gate[:, :, t].exp()[..., None]
        key = k[:, :, t]
        innovation = v[:, :, t] - torch.einsum("bhk,bhkv->bhv", key, state)
        state = state + (beta[:, :, t, None] * key)[..., None] * innovation[..., None, :]
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))
        if every_state is not None:
            every_state.append(state)
    if not outputs:
        return q.new_zeros(q.shape[:-1] + (v.shape[-1],)), state
    return torch.stack(outputs, dim=2), state


def recurrent_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDN (scalar decay) or KDA (per-key decay) exact token recurrence.

    Args:
        q, k: ``[B, T, Hk, K]`` queries and keys, already normalized.
        v: ``[B, T, Hv, V]`` values; ``Hv`` is a multiple of ``Hk`` and value
            head ``h`` reads key head ``h // (Hv // Hk)``.
        g: natural-log decays, ``[B, T, Hv]`` (GDN) or ``[B, T, Hv, K]`` (KDA).
        beta: ``[B, T, Hv]`` write strengths.
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[N, Hv, K, V]`` (``[N, Hv, V, K]`` with
            ``state_v_first``); zeros when omitted.
        cu_seqlens: ``[N + 1]`` integer boundaries of packed sequences (``B == 1``).
        state_v_first: states are stored value-major.

    Returns:
        ``(o, final_state)``: ``o`` like ``v`` in ``v``'s dtype, the final state
        ``[N, Hv, K, V]`` (or value-major) in ``promote_types(dtype, float32)``.

    Raises:
        ValueError, TypeError: on inconsistent shapes, dtypes or devices.
    """
    check_delta_inputs(
        q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
        state_v_first=state_v_first, gate="any",
    )
    tensors, state, scale = _prepare(
        q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first
    )
    outputs, states = _run(token_loop, tensors, state, cu_seqlens, scale=scale)
    return _finish(outputs, states, v, state_v_first)


# ----------------------------------------------------------------------------
# GDN in WY form: W = T (beta k e^G), U = T (beta v), T = (I + A)^-1.

# The chunked GDN forms (these references and the Triton kernels) and the chunked two-key
# reference (KDA, Diag-KDN) floor each gate here. Every decay through a floored gate is below
# e^-128, zero in float32 (exp underflows below -104), so float32 results do not change; the
# floor bounds the in-chunk cumulative sums that decays are differenced from (|sum| <= 64 * 128
# for 64-token chunks): in float64 they keep ~1e-12.
GDN_GATE_FLOOR = -128.0


def _pad_to_chunks(tensor: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Zero-pad dim 2 to a multiple of ``chunk_size``: zero tokens are identity steps."""
    pad = (-tensor.shape[2]) % chunk_size
    if pad == 0:
        return tensor
    shape = list(tensor.shape)
    shape[2] = pad
    return torch.cat((tensor, tensor.new_zeros(shape)), dim=2)


def _chunked(tensor: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``[B, H, T, ...]`` -> ``[B, H, T // C, C, ...]`` after zero padding."""
    padded = _pad_to_chunks(tensor, chunk_size)
    return padded.unflatten(2, (padded.shape[2] // chunk_size, chunk_size))


def _effective_chunk(chunk_size: int, length: int) -> int:
    """A chunk longer than the sequence computes the same as one of its length."""
    return max(1, min(chunk_size, length))


def _gdn_cumulative(gate: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """In-chunk cumulative log decays ``[B, H, T // C, C]`` of ``gate [B, H, T, 1]``, floored
    at :data:`GDN_GATE_FLOOR` (zero gradient below it), in float64: decays are differences of
    these sums, and a float32 sum past a large gate keeps too few digits for them."""
    return _chunked(gate[..., 0].clamp_min(GDN_GATE_FLOOR).double(), chunk_size).cumsum(-1)


def _gdn_wy_core(k, v, gate, beta, *, chunk_size):
    length = k.shape[2]
    chunk_size = _effective_chunk(chunk_size, length)
    kc, vc = _chunked(k, chunk_size), _chunked(v, chunk_size)
    bc = _chunked(beta, chunk_size)
    cumulative = _gdn_cumulative(gate, chunk_size)
    strict = causal_mask(chunk_size, k.device, strict=True)
    interaction = bc[..., None] * (kc @ kc.transpose(-1, -2)) * decay_between(
        cumulative, strict
    ).to(k.dtype)
    eye = torch.eye(chunk_size, dtype=k.dtype, device=k.device)
    solve = lambda rhs: torch.linalg.solve_triangular(  # noqa: E731
        eye + interaction, rhs, upper=False, unitriangular=True
    )
    w = solve(bc[..., None] * kc * cumulative.exp().to(k.dtype)[..., None])
    u = solve(bc[..., None] * vc)
    return w.flatten(2, 3)[:, :, :length], u.flatten(2, 3)[:, :, :length]


def gdn_wy_operands_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The WY operands of chunked GDN, ``W [B, T, Hv, K]`` and ``U [B, T, Hv, V]``.

    Per chunk, with ``G`` the in-chunk cumulative sum of ``g`` and
    ``A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j)`` for ``j < i``:
    ``W = (I + A)^-1 (beta k exp(G))`` and ``U = (I + A)^-1 (beta v)``.
    They depend on keys, gates and betas only, never on the state. Outputs are in
    ``promote_types(k.dtype, float32)``.
    """
    hv = v.shape[2]
    dtype = work_dtype(k.dtype)
    kh = heads_first(k.to(dtype), hv)
    tensors = (
        kh,
        heads_first(v.to(dtype), hv),
        heads_first(g.to(dtype)[..., None], hv),
        heads_first(beta.to(dtype)[..., None], hv)[..., 0],
    )
    ws, us = [], []
    for _, times in segments(cu_seqlens, kh.shape[0], kh.shape[2]):
        w, u = _gdn_wy_core(*(t[:, :, times] for t in tensors), chunk_size=chunk_size)
        ws.append(w)
        us.append(u)
    return (
        torch.cat(ws, dim=2).transpose(1, 2),
        torch.cat(us, dim=2).transpose(1, 2),
    )


def _gdn_apply_core(q, k, w, u, gate, state, *, scale, chunk_size, qdq_block_v):
    length = q.shape[2]
    chunk_size = _effective_chunk(chunk_size, length)
    qc, kc = _chunked(q, chunk_size), _chunked(k, chunk_size)
    wc, uc = _chunked(w, chunk_size), _chunked(u, chunk_size)
    cumulative = _gdn_cumulative(gate, chunk_size)
    causal = causal_mask(chunk_size, q.device, strict=False)
    quantize = (
        (lambda s: state_fp8_qdq_reference(s, qdq_block_v))
        if qdq_block_v
        else (lambda s: s)
    )
    state = quantize(state)
    decay = lambda x: x.exp().to(q.dtype)  # noqa: E731  (of float64 exponents)
    outputs = []
    for c in range(qc.shape[2]):
        cum = cumulative[:, :, c]
        delta = uc[:, :, c] - wc[:, :, c] @ state
        attention = (qc[:, :, c] @ kc[:, :, c].transpose(-1, -2)) * decay_between(
            cum, causal
        ).to(q.dtype)
        outputs.append(
            scale * ((qc[:, :, c] * decay(cum)[..., None]) @ state + attention @ delta)
        )
        to_end = decay(cum[..., -1:] - cum)[..., None] * kc[:, :, c]
        state = state * decay(cum[..., -1])[..., None, None] + to_end.transpose(-1, -2) @ delta
        state = quantize(state)
    if not outputs:
        return q.new_zeros(q.shape[:-1] + (u.shape[-1],)), state
    return torch.cat(outputs, dim=2)[:, :, :length], state


def gdn_wy_recurrence_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    *,
    chunk_size: int = 64,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
    state_qdq: bool = False,
    state_qdq_block_v: int = 64,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run chunked GDN from its WY operands (see :func:`gdn_wy_operands_reference`).

    Per chunk with start state ``S``: ``delta = U - W S``,
    ``o = scale (q e^G) S + scale ((q k^T) * exp(G_i - G_j))_{j <= i} delta`` and
    ``S <- e^{G_last} S + (k e^{G_last - G})^T delta``. With ``state_qdq`` the
    initial state and each chunk's final state (after that chunk's readout) pass
    through :func:`state_fp8_qdq_reference`. ``o`` takes ``out_dtype`` (default
    ``q.dtype``).
    """
    hv = u.shape[2]
    dtype = work_dtype(q.dtype)
    n = num_sequences(q.shape[0], cu_seqlens)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if initial_state is None:
        state = q.new_zeros((n, hv, k.shape[-1], u.shape[-1]), dtype=dtype)
    else:
        state = state_key_first(initial_state, state_v_first).to(dtype)
    tensors = (
        heads_first(q.to(dtype), hv),
        heads_first(k.to(dtype), hv),
        heads_first(w.to(dtype), hv),
        heads_first(u.to(dtype), hv),
        heads_first(g.to(dtype)[..., None], hv),
    )
    outputs, states = _run(
        _gdn_apply_core, tensors, state, cu_seqlens, scale=scale,
        chunk_size=chunk_size, qdq_block_v=state_qdq_block_v if state_qdq else 0,
    )
    o = torch.cat(outputs, dim=2).transpose(1, 2).to(out_dtype or q.dtype)
    state = torch.cat(states, dim=0)
    return o, (state.transpose(-1, -2) if state_v_first else state)


def chunk_gdn_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = 64,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
    state_qdq: bool = False,
    state_qdq_block_v: int = 64,
    w_quantizer: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact chunked Gated DeltaNet in WY form, with optional state / W fake quantization.

    Computes the recurrence of :func:`recurrent_delta_rule_reference` with a
    scalar gate ``g [B, T, Hv]`` (natural-log decay per token and value head),
    chunk by chunk: one unit-lower-triangular solve per chunk gives the WY
    operands ``W [B, T, Hv, K]`` and ``U [B, T, Hv, V]``
    (:func:`gdn_wy_operands_reference`), then a sequential pass over chunks
    (:func:`gdn_wy_recurrence_reference`).

    Args:
        q, k: ``[B, T, Hk, K]``; v: ``[B, T, Hv, V]``; g, beta: ``[B, T, Hv]``.
        chunk_size: tokens per chunk (positive int).
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[N, Hv, K, V]`` (value-major with ``state_v_first``).
        cu_seqlens: ``[N + 1]`` packed-sequence boundaries, ``B == 1``.
        state_v_first: states are ``[N, Hv, V, K]``.
        state_qdq: fake-quantize the state to FP8 E4M3 (initial state and each
            chunk's final state, after the chunk's readout); tiles of
            ``[K, state_qdq_block_v]`` share a scale.
        w_quantizer: called once on the whole materialized ``W`` (in the working
            dtype); its autograd is its own.

    Returns:
        ``(o, final_state)`` as in :func:`recurrent_delta_rule_reference`.

    Raises:
        ValueError, TypeError: on inconsistent shapes, dtypes or devices.
    """
    check_delta_inputs(
        q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
        state_v_first=state_v_first, gate="scalar", chunk_size=chunk_size,
    )
    w, u = gdn_wy_operands_reference(
        k, v, g, beta, chunk_size=chunk_size, cu_seqlens=cu_seqlens
    )
    if w_quantizer is not None:
        w = w_quantizer(w)
    return gdn_wy_recurrence_reference(
        q, k, w, u, g, chunk_size=chunk_size, scale=scale,
        initial_state=initial_state, cu_seqlens=cu_seqlens,
        state_v_first=state_v_first, state_qdq=state_qdq,
        state_qdq_block_v=state_qdq_block_v, out_dtype=v.dtype,
    )


# ----------------------------------------------------------------------------
# Per-key decay with two keys: S_t = (I - w_t k_t^T) D_t S_{t-1} + w_t v_t^T.


def two_key_chunk_recurrence(q, k, w, v, log_decay, state, *, scale, chunk_size):
    """Chunked two-key delta rule with per-key decay, head-major ``[B, H, T, ...]``.

    ``k`` erases, ``w`` writes, ``log_decay [B, H, T, K]`` decays each key channel,
    ``state [B, H, K, V]``. Per chunk with cumulative log decay ``c`` and start
    state ``S``: the innovations ``X`` solve the unit-lower-triangular system
    ``(I + A) X = V - (e^c k) S`` with ``A[t, s] = sum_i k_ti e^{c_ti - c_si} w_si``
    (``s < t``); ``o = scale ((q e^c) S + R X)`` with ``R`` the same weights read
    by ``q`` (``s <= t``); ``S <- e^{c_last} S + (w e^{c_last - c})^T X``.
    Shared by KDA (``w = beta k``) and Diag-KDN (``w`` = Kalman gain).

    ``c`` is summed and differenced in float64 from ``log_decay`` floored at
    :data:`GDN_GATE_FLOOR` (zero gradient below it): one huge finite gate would otherwise
    swamp the later decays of its chunk in the working dtype. The decays go back to the
    working dtype after ``exp``.
    """
    outputs = []
    chunk_size = int(chunk_size)  # an integral float (64.0) passes the argument checks
    dtype = q.dtype
    for start in range(0, q.shape[2], chunk_size):
        chunk = slice(start, start + chunk_size)
        qc, kc, wc, vc = (t[:, :, chunk] for t in (q, k, w, v))
        cumulative = log_decay[:, :, chunk].clamp_min(GDN_GATE_FLOOR).double().cumsum(2)
        size = qc.shape[2]
        causal = causal_mask(size, q.device, strict=False)
        difference = cumulative[:, :, :, None, :] - cumulative[:, :, None, :, :]
        weights = torch.where(causal[..., None], difference, -math.inf).exp().to(dtype)
        weights = weights * wc[:, :, None, :, :]
        interaction = torch.einsum("bhtk,bhtsk->bhts", kc, weights)
        readout = torch.einsum("bhtk,bhtsk->bhts", qc, weights)
        decay = cumulative.exp().to(dtype)
        innovation = torch.linalg.solve_triangular(
            interaction, vc - (decay * kc) @ state, upper=False, unitriangular=True
        )
        outputs.append(scale * ((qc * decay) @ state + readout @ innovation))
        to_end = (cumulative[:, :, -1:] - cumulative).exp().to(dtype) * wc
        state = state * decay[:, :, -1, :, None] + to_end.transpose(-1, -2) @ innovation
    if not outputs:
        return q.new_zeros(q.shape[:-1] + (v.shape[-1],)), state
    return torch.cat(outputs, dim=2), state


def _kda_core(q, k, v, gate, beta, state, *, scale, chunk_size):
    return two_key_chunk_recurrence(
        q, k, beta[..., None] * k, v, gate, state, scale=scale, chunk_size=chunk_size
    )


def chunk_kda_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = 64,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact chunked Kimi Delta Attention (per-key decay ``g [B, T, Hv, K]``).

    The chunked form of :func:`recurrent_delta_rule_reference` with a per-key
    gate, through :func:`two_key_chunk_recurrence` with write key ``beta k``.
    Arguments, returns and errors as :func:`chunk_gdn_reference` (no quantization).
    """
    check_delta_inputs(
        q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
        state_v_first=state_v_first, gate="per_key", chunk_size=chunk_size,
    )
    tensors, state, scale = _prepare(
        q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first
    )
    outputs, states = _run(
        _kda_core, tensors, state, cu_seqlens, scale=scale, chunk_size=chunk_size
    )
    return _finish(outputs, states, v, state_v_first)
