"""Launchers of the Diag-KDN Kalman gain kernels (forward and backward).

Per batch ``b``, head ``h``, token ``t`` and key channel ``i``::

    p_hat_t = exp(2 log_alpha_t) p_{t-1} + omega_t          (unfloored alpha)
    kappa_t = p_hat_t k_t / (r_t + sum_i p_hat_ti k_ti^2)     (the gain)
    1 / p_t = 1 / p_hat_t + info_scale k_t^2 / r_t

from ``p_0 = 1 / precision``. The kernels (``kalman_gain_fwd.py``,
``kalman_gain_bwd.py``) walk chunks of ``CHUNK`` tokens in parallel (one warp
per chunk and head) and chain the chunks with a short scan over chunk products. Launchers are fake-tensor
safe: shapes only, no host reads; the packed-sequence bookkeeping (each chunk's token
span, each sequence's first chunk) is built from ``cu_seqlens`` with device ops.
Source: the Diag-KDN specification; oracle ``kdn_compile.reference.kalman_gain``.
"""

from __future__ import annotations

import os

import torch
import triton
from torch.library import wrap_triton

from kdn_compile.lowering._launch import chunk_offsets, chunk_spans, num_chunks_bound
from kdn_compile.lowering.kalman_gain_bwd import (
    _kalman_gain_bwd_chunk_map_kernel,
    _kalman_gain_bwd_chunk_scan_kernel,
    _kalman_gain_bwd_kernel,
)
from kdn_compile.lowering.kalman_gain_fwd import (
    _kalman_gain_chunk_map_kernel,
    _kalman_gain_chunk_scan_kernel,
    _kalman_gain_fwd_kernel,
)

__all__ = ["kalman_gain_fwd", "kalman_gain_bwd", "kalman_gain_kernel_supports",
           "precision_at_checkpoints"]

# Tokens per chunk, walked by one warp with all K channels: chunk 32 is the fastest
# (H200, K = 128, 8x4096x16: fwd 0.58 ms, fwd+bwd 1.3 ms; chunks 16 or 64, or two warps,
# 0.66 / 2.1 ms at best; in-chunk prefix scans in place of the walk 5.1-5.5 ms fwd+bwd).
CHUNK = 32
CHUNK_WARPS = 1
# Depth of the software pipeline of the per-token loads in the chunk walks; 1 measured
# within the noise of 3 on that run.
NUM_STAGES = 3
# Chunks per step of the scan over chunks and channels per program of that scan,
# on CUDA and under the CPU interpreter (which scans element by element).
CHUNK_BLOCK = {"cuda": 64, "cpu": 8}
CHANNEL_BLOCK = {"cuda": 16, "cpu": 16}
MAX_KEY_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def kalman_gain_kernel_supports(k, log_alpha, omega, r, precision, cu_seqlens=None) -> bool:
    """True when the Triton kernels handle these inputs (shapes, dtypes, device).

    ``k, log_alpha, omega`` ``[B, T, H, K]`` float16/bfloat16/float32 with
    ``K <= 256``, ``r [B, T, H]``, ``precision [N, H, K]``, all on CUDA (or on the
    CPU under ``TRITON_INTERPRET=1``); float64 goes to the reference.
    """
    tensors = (k, log_alpha, omega, r, precision)
    if any(t.dtype not in _DTYPES for t in tensors):
        return False
    device = k.device.type
    if device != "cuda" and not (device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    if any(t.device != k.device for t in tensors):
        return False
    if k.dim() != 4 or k.shape[-1] > MAX_KEY_DIM:
        return False
    if cu_seqlens is not None and (cu_seqlens.device != k.device or k.shape[0] != 1):
        return False
    return True


def _chunks(k, cu_seqlens):
    """``(N, NT, NC, spans, chunk_offsets)``: sequences, chunks per sequence, slots.

    Fixed length: ``NT`` chunks per sequence, ``NC = B * NT``. Varlen: ``NC`` is
    the bound of :func:`~._launch.num_chunks_bound`; ``chunk_offsets [N + 1]`` is each
    sequence's first slot and ``spans [NC, 3]`` each slot's first token, its sequence's
    end and its sequence (:func:`~._launch.chunk_spans`, device ops; a surplus slot
    starts at or past its end).
    """
    batch, length = k.shape[0], k.shape[1]
    if cu_seqlens is None:
        nt = triton.cdiv(length, CHUNK)
        return batch, nt, batch * nt, None, None
    n = cu_seqlens.shape[0] - 1
    offsets = chunk_offsets(cu_seqlens, CHUNK)
    nc = num_chunks_bound(batch, length, n, CHUNK, True)
    return n, 0, nc, chunk_spans(cu_seqlens, offsets, nc, CHUNK), offsets


def _walk_args(length, heads, key_dim, varlen, info_scale):
    """Keyword arguments of the per-chunk walks (map, gain and gradient kernels)."""
    return dict(
        info_scale=info_scale, T=length, H=heads, K=key_dim, BT=CHUNK,
        BK=triton.next_power_of_2(key_dim), IS_VARLEN=varlen, NUM_STAGES=NUM_STAGES,
        num_warps=CHUNK_WARPS,
    )


def _scan_grid(k, n, heads, key_dim):
    return (n, heads, triton.cdiv(key_dim, CHANNEL_BLOCK[k.device.type]))


def _scan_args(k, nt, heads, key_dim, varlen):
    """Keyword arguments of the scans over chunks."""
    device = k.device.type
    return dict(NT=nt, H=heads, K=key_dim, BC=CHUNK_BLOCK[device], BK=CHANNEL_BLOCK[device],
                IS_VARLEN=varlen, num_warps=4)


def kalman_gain_fwd(k, log_alpha, omega, r, precision, cu_seqlens=None, *, info_scale: float,
                    gain_dtype: torch.dtype = torch.float32):
    """Gains and final precision of the Diag-KDN covariance recursion.

    Args:
        k, log_alpha, omega: ``[B, T, H, K]`` (k normalized, log_alpha natural log).
        r: ``[B, T, H]`` observation noise (> 0).
        precision: ``[N, H, K]`` initial precision ``1 / p_0`` (> 0).
        cu_seqlens: ``[N + 1]`` int32/int64 sequence starts (``B == 1``) or None (``N = B``).
        info_scale: weight of the information term of the precision update.
        gain_dtype: dtype the gains are stored in (computed in float32; a half dtype
            halves the traffic of the kernels that read them).

    Returns:
        ``(gain [B, T, H, K] in gain_dtype, final_precision [N, H, K] float32,
        chunk_covariance [NC * H * K] (flat), final_covariance [N, H, K])``; the
        last two are saved for :func:`kalman_gain_bwd`.
    """
    k, log_alpha, omega, r = (t.contiguous() for t in (k, log_alpha, omega, r))
    precision = precision.contiguous()
    batch, length, heads, key_dim = k.shape
    n, nt, nc, spans, chunk_offsets = _chunks(k, cu_seqlens)
    varlen = cu_seqlens is not None
    f32 = dict(device=k.device, dtype=torch.float32)
    # per-chunk buffers flat: a dimension of one chunk makes torch.export guard on T
    maps = torch.empty(nc * heads * 4 * key_dim, **f32)  # [NC, H, 4, K]
    chunk_cov = torch.empty(nc * heads * key_dim, **f32)  # [NC, H, K]
    final_cov = torch.empty(n, heads, key_dim, **f32)
    final_precision = torch.empty(n, heads, key_dim, **f32)
    gain = torch.empty(batch, length, heads, key_dim, device=k.device, dtype=gain_dtype)
    walk = _walk_args(length, heads, key_dim, varlen, info_scale)
    inputs = (k, log_alpha, omega, r)
    wrap_triton(_kalman_gain_chunk_map_kernel)[(nc, heads)](*inputs, maps, spans, **walk)
    wrap_triton(_kalman_gain_chunk_scan_kernel)[_scan_grid(k, n, heads, key_dim)](
        precision, maps, chunk_cov, final_cov, final_precision, chunk_offsets,
        **_scan_args(k, nt, heads, key_dim, varlen),
    )
    wrap_triton(_kalman_gain_fwd_kernel)[(nc, heads)](*inputs, chunk_cov, gain, spans, **walk)
    return gain, final_precision, chunk_cov, final_cov


def precision_at_checkpoints(chunk_cov, final_precision, k, cu_seqlens, every: int,
                             count: int) -> torch.Tensor:
    """``[N, count, H, K]`` float32: each sequence's precision after its first ``(c + 1) *
    every`` tokens (``every`` a multiple of the scan's chunk), from :func:`kalman_gain_fwd`'s
    ``chunk_cov`` (the covariance entering each chunk) and ``final_precision`` (a sequence
    that ends there); zero past a sequence's end. Device ops only, no host sync."""
    batch, length, heads, key_dim = k.shape
    n = final_precision.shape[0]
    cov = chunk_cov.view(-1, heads, key_dim)
    if cu_seqlens is None:
        starts = torch.arange(n, device=k.device) * triton.cdiv(length, CHUNK)
        lengths = torch.full((n,), length, device=k.device)
    else:
        starts = chunk_offsets(cu_seqlens, CHUNK)[:-1].to(torch.int64)
        lengths = cu_seqlens[1:].to(torch.int64) - cu_seqlens[:-1].to(torch.int64)
    ends = (torch.arange(count, device=k.device) + 1) * every  # [C]
    inside = ends[None, :] < lengths[:, None]  # [N, C]: entering a later chunk
    at_end = ends[None, :] == lengths[:, None]
    slot = (starts[:, None] + ends[None, :] // CHUNK).clamp(0, max(cov.shape[0] - 1, 0))
    entering = 1.0 / cov[slot] if cov.shape[0] else final_precision.new_zeros(
        (n, count, heads, key_dim))
    found = torch.where(inside[..., None, None], entering, 0.0)
    return torch.where(at_end[..., None, None], final_precision[:, None], found)


def kalman_gain_bwd(
    k, log_alpha, omega, r, precision, cu_seqlens, chunk_covariance, final_covariance,
    dgain, dprecision, *, info_scale: float, dk_add=None, dlog_alpha_add=None,
):
    """Gradients of :func:`kalman_gain_fwd` given ``dgain`` and ``dprecision``.

    Args: the forward's inputs, its saved ``chunk_covariance`` and
    ``final_covariance``, ``dgain [B, T, H, K]`` and ``dprecision [N, H, K]``
    (gradient of the final precision, or None for zero); ``dk_add``,
    ``dlog_alpha_add``: ``[B, T, H, K]`` gradients from elsewhere (the memory's) that
    the kernel adds before it stores ``dk`` and ``dlog_alpha`` (both or neither).

    Returns:
        ``(dk, dlog_alpha, domega, dr, dprecision0)`` in the dtypes of
        ``k, log_alpha, omega, r, precision``.

    Raises:
        ValueError: one of ``dk_add``, ``dlog_alpha_add`` without the other, or
            either not of ``k``'s shape.
    """
    add = dk_add is not None
    if add != (dlog_alpha_add is not None):
        raise ValueError("dk_add and dlog_alpha_add: give both or neither, got "
                         f"{type(dk_add).__name__} and {type(dlog_alpha_add).__name__}")
    for name, t in (("dk_add", dk_add), ("dlog_alpha_add", dlog_alpha_add)):
        if t is not None and t.shape != k.shape:
            raise ValueError(f"{name}: expected shape {tuple(k.shape)} (k's), "
                             f"got {tuple(t.shape)}")
    k, log_alpha, omega, r = (t.contiguous() for t in (k, log_alpha, omega, r))
    precision, dgain = precision.contiguous(), dgain.contiguous()
    if dprecision is not None:
        dprecision = dprecision.contiguous()
    batch, length, heads, key_dim = k.shape
    n, nt, nc, spans, chunk_offsets = _chunks(k, cu_seqlens)
    varlen = cu_seqlens is not None
    f32 = dict(device=k.device, dtype=torch.float32)
    adj_maps = torch.empty(nc * heads * 2 * key_dim, **f32)  # [NC, H, 2, K], flat as above
    chunk_adj = torch.empty(nc * heads * key_dim, **f32)  # [NC, H, K]
    prev_cov = torch.empty(k.shape, **f32)
    dk, dlog_alpha, domega = (torch.empty_like(t) for t in (k, log_alpha, omega))
    dr, dprecision0 = torch.empty_like(r), torch.empty_like(precision)
    walk = _walk_args(length, heads, key_dim, varlen, info_scale)
    inputs = (k, log_alpha, omega, r)
    wrap_triton(_kalman_gain_bwd_chunk_map_kernel)[(nc, heads)](
        *inputs, chunk_covariance, dgain, adj_maps, prev_cov, spans, **walk)
    wrap_triton(_kalman_gain_bwd_chunk_scan_kernel)[_scan_grid(k, n, heads, key_dim)](
        precision, final_covariance, dprecision, adj_maps, chunk_adj, dprecision0, chunk_offsets,
        **_scan_args(k, nt, heads, key_dim, varlen), HAS_DPRECISION=dprecision is not None,
    )
    if add:
        dk_add, dlog_alpha_add = dk_add.contiguous(), dlog_alpha_add.contiguous()
    else:
        dk_add = dlog_alpha_add = dgain  # never read
    wrap_triton(_kalman_gain_bwd_kernel)[(nc, heads)](
        *inputs, prev_cov, chunk_adj, dgain, dk_add, dlog_alpha_add,
        dk, dlog_alpha, domega, dr, spans, **walk, ADD=add)
    return dk, dlog_alpha, domega, dr, dprecision0
