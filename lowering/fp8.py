"""FP8 E4M3 state tiles in Triton: the quantize / dequantize helpers and the QDQ kernel.

One dynamic scale per ``[K, block_v]`` tile of a key-first state, by :func:`e4m3_scale`:
``scale = amax * (1 / 448)`` (the float32 reciprocal, as PyTorch's CUDA division by a
scalar computes it), or 1 where that is below ``2^-126`` (an all-zero, subnormal or tiny
tile, which then stores zeros); values ``state / scale`` (a correctly rounded division,
``div_rn``) rounded to nearest-even E4M3, dequantized as ``float32(values) * scale``. This is
:func:`kdn_compile.reference.fp8.quantize_state_fp8` and ``dequantize_state_fp8`` bit for
bit on the same float32 tile, so the same helpers serve every user:

* the float8 state pools of the serving path (``lowering/recurrent.py``);
* the state QDQ of chunked GDN (``lowering/chunk_gdn_fwd.py``), where the chunk states
  saved for the backward are these float8 values and their scales;
* :func:`state_fp8_qdq_fwd`, the standalone kernel of ``kdn::state_fp8_qdq``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

__all__ = [
    "E4M3_MAX", "dequantize_tile", "qdq_tile", "quantize_tile", "soft_cast",
    "state_fp8_qdq_fwd", "state_qdq_kernel_supports",
]

E4M3_MAX = 448.0
E4M3_MIN_SCALE: tl.constexpr = tl.constexpr(2.0 ** -126)  # the smallest normal float32
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TILE = 128 * 64  # elements of a scale tile held in registers at once (float32, 4 warps)
_SUB = 64  # rows and columns of the register tiles a larger scale tile is walked in


def soft_cast() -> bool:
    """Whether kernels round to E4M3 in software first (:func:`round_to_e4m3`): in Triton's
    interpreter, which rounds some float8 casts wrongly (1.955 to 1.0, triton 3.9)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def round_to_e4m3(y):
    """``y`` (float32, ``|y| <= 448``) rounded to the nearest E4M3 value, ties to even, as
    float32: ``y`` in units of its E4M3 spacing ``2^(max(e, -6) - 3)``, rounded to an
    integer by the ``1.5 * 2^23`` addition, so that the cast to float8 that follows is
    exact. The sign is copied from ``y`` (``-0.0`` stays ``-0.0``)."""
    magnitude = tl.abs(y)
    bits = magnitude.to(tl.int32, bitcast=True)
    exponent = tl.maximum((bits >> 23) - 127, -6)
    spacing = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    units = magnitude / spacing  # exact: a power of two
    units = (units + 12582912.0) - 12582912.0
    rounded = units * spacing
    return tl.where(y.to(tl.int32, bitcast=True) < 0, -rounded, rounded)


@triton.jit
def e4m3_scale(amax):
    """The scale of a tile whose largest magnitude is ``amax`` (float32): ``amax * (1 /
    448)`` where that is at least ``2^-126`` (the smallest normal float32), else 1 (an
    all-zero, subnormal or tiny tile: its values round to zeros). The rule of
    :func:`kdn_compile.reference.fp8.e4m3_scale`, bit for bit; every kernel's scale."""
    scale = amax * (1.0 / 448.0)
    return tl.where(scale >= E4M3_MIN_SCALE, scale, 1.0)


@triton.jit
def e4m3_values(b_x, s, SOFT_CAST: tl.constexpr):
    """``b_x / s`` (float32, correctly rounded) rounded to E4M3, ties to even. The GPU's
    conversion rounds so; ``SOFT_CAST`` (the interpreter) rounds first in software."""
    scaled = tl.math.div_rn(b_x, s + tl.zeros_like(b_x))
    if SOFT_CAST:
        scaled = round_to_e4m3(scaled)
    return scaled.to(tl.float8e4nv)


@triton.jit
def quantize_tile(b_x, SOFT_CAST: tl.constexpr):
    """``(values, scale)`` of a float32 2-D tile holding one whole scale tile (lanes
    outside it zero): float8 E4M3 values and the float32 scale."""
    s = e4m3_scale(tl.max(tl.max(tl.abs(b_x), axis=1), axis=0))
    return e4m3_values(b_x, s, SOFT_CAST), s


@triton.jit
def dequantize_tile(values, s):
    """Float8 ``values`` times their tile's scale ``s``, in float32."""
    return values.to(tl.float32) * s


@triton.jit
def qdq_tile(b_x, SOFT_CAST: tl.constexpr):
    """``(dequantized, values, scale)``: the E4M3 fake quantization of a float32 tile (as
    :func:`quantize_tile`), with the float8 values and scale that hold it. Zeros come out
    ``+0.0``, as the reference's straight-through sum ``x + (qdq(x) - x)`` gives them."""
    values, s = quantize_tile(b_x, SOFT_CAST)
    return dequantize_tile(values, s) + 0.0, values, s


@triton.jit
def _state_fp8_qdq_kernel(
    x, y, values, scales, K, V, NS,
    BLOCK_V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, WALK: tl.constexpr,
    SPLIT: tl.constexpr, SOFT_CAST: tl.constexpr,
):
    """Program ``(matrix, tile)``: the ``[K, BLOCK_V]`` scale tile ``tile`` of one ``[K, V]``
    matrix, in register tiles ``[BK, BV]``: one, or (``WALK``) an amax pass and a quantize
    pass over several. ``SPLIT``: float8 ``values`` and ``scales``; else ``y`` (QDQ)."""
    i_m, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1)
    base = i_m * K * V
    c0 = i_v * BLOCK_V
    c1 = tl.minimum(c0 + BLOCK_V, V)
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    if not WALK:
        m = (o_k < K)[:, None] & (c0 + o_v < c1)[None, :]
        p = base + o_k[:, None] * V + c0 + o_v[None, :]
        b_x = tl.load(x + p, mask=m, other=0.0).to(tl.float32)
        b_y, b_q, s = qdq_tile(b_x, SOFT_CAST)
        if SPLIT:
            tl.store(values + p, b_q, mask=m)
        else:
            tl.store(y + p, b_y.to(y.dtype.element_ty), mask=m)
    else:
        amax = 0.0
        for k0 in range(0, K, BK):
            for v0 in range(c0, c1, BV):
                m = (k0 + o_k < K)[:, None] & (v0 + o_v < c1)[None, :]
                p = base + (k0 + o_k)[:, None] * V + v0 + o_v[None, :]
                b_x = tl.load(x + p, mask=m, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.max(tl.max(tl.abs(b_x), axis=1), axis=0))
        s = e4m3_scale(amax)
        for k0 in range(0, K, BK):
            for v0 in range(c0, c1, BV):
                m = (k0 + o_k < K)[:, None] & (v0 + o_v < c1)[None, :]
                p = base + (k0 + o_k)[:, None] * V + v0 + o_v[None, :]
                b_q = e4m3_values(tl.load(x + p, mask=m, other=0.0).to(tl.float32), s, SOFT_CAST)
                if SPLIT:
                    tl.store(values + p, b_q, mask=m)
                else:
                    b_y = dequantize_tile(b_q, s) + 0.0  # as qdq_tile
                    tl.store(y + p, b_y.to(y.dtype.element_ty), mask=m)
    if SPLIT:
        tl.store(scales + i_m * NS + i_v, s)


def state_qdq_kernel_supports(state: torch.Tensor) -> bool:
    """Whether :func:`state_fp8_qdq_fwd` covers ``state`` (dtype only): float16, bfloat16
    or float32. float64 states quantize with float64 scales: the reference."""
    return state.dtype in _DTYPES


def state_fp8_qdq_fwd(state: torch.Tensor, block_v: int, *, split: bool = False):
    """E4M3 fake quantization of a key-first ``state [..., K, V]``, one scale per
    ``[K, block_v]`` tile (the last one may be partial).

    Returns a tensor like ``state`` (QDQ), or with ``split`` the ``(values, scales)`` of
    :func:`kdn_compile.reference.fp8.quantize_state_fp8`: float8 ``values`` of
    ``state``'s shape and float32 ``scales [..., ceil(V / block_v)]``. Bit for bit the
    reference's on float16 / bfloat16 / float32 states. Sizes from shapes only.
    """
    *lead, k_dim, v_dim = state.shape
    x = state.contiguous()
    tiles = triton.cdiv(v_dim, block_v)
    matrices = x.numel() // max(k_dim * v_dim, 1)
    bk, bv = triton.next_power_of_2(k_dim), triton.next_power_of_2(min(block_v, v_dim))
    walk = bk * bv > _TILE
    if walk:
        bk, bv = min(bk, _SUB), min(bv, _SUB)
    if split:
        y = None
        values = torch.empty(state.shape, dtype=torch.float8_e4m3fn, device=state.device)
        scales = torch.empty((*lead, tiles), dtype=torch.float32, device=state.device)
    else:
        y, values, scales = torch.empty_like(x), None, None
    if matrices > 0 and tiles > 0:
        wrap_triton(_state_fp8_qdq_kernel)[(matrices, tiles)](
            x, y, values, scales, k_dim, v_dim, tiles,
            BLOCK_V=block_v, BK=bk, BV=bv, WALK=walk, SPLIT=split, SOFT_CAST=soft_cast(),
            num_warps=4,
        )
    return (values, scales) if split else y
