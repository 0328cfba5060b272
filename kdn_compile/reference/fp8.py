"""FP8 (E4M3) quantization of recurrent states: fake quantization and the float8 pools.

One dynamic scale per ``[K, block_v]`` tile of a key-first state ``[..., K, V]``, by
:func:`e4m3_scale`: ``amax * (1 / 448)``, or 1 where that is below ``2^-126`` (an all-zero,
subnormal or tiny tile, which then stores zeros); values ``state / scale`` rounded to
``torch.float8_e4m3fn``. :func:`quantize_state_fp8` and :func:`dequantize_state_fp8`
are the two halves (the float8 state pools of the serving path store their output);
:func:`state_fp8_qdq_reference` is their composition with a straight-through gradient.
:func:`kdn_compile.quantization.fp8_row_qdq` takes its per-row scales from
:func:`e4m3_scale` too.
"""

from __future__ import annotations

import torch

from kdn_compile.reference._common import to_work

E4M3_MAX = 448.0
# The smallest scale kept: the smallest normal float32. Below it a scale would lose bits or
# underflow to 0 (and 0 / 0 = NaN); such a tile takes scale 1 instead.
E4M3_MIN_SCALE = 2.0 ** -126

__all__ = ["E4M3_MAX", "E4M3_MIN_SCALE", "e4m3_scale", "quantize_state_fp8",
           "dequantize_state_fp8", "state_fp8_qdq_reference"]


def e4m3_scale(amax: torch.Tensor) -> torch.Tensor:
    """The E4M3 scale of tiles whose largest magnitudes are ``amax``: ``amax * (1 / 448)``
    where that is at least ``2^-126`` (the smallest normal float32, i.e. ``amax >= ~5.3e-36``),
    else 1.

    The product is taken with the reciprocal of 448 in ``amax``'s dtype, as PyTorch's CUDA
    division by a scalar computes it, so the scales are the same on every device and in the
    kernels (``lowering/fp8.py``, ``e4m3_scale``, the same rule in Triton). A tile under the
    threshold (all zero, subnormal or tiny; a NaN ``amax`` too) gets scale 1: its values
    round to E4M3 zeros, so it dequantizes to zeros, off by at most its ``amax``, never NaN.

    Args:
        amax: non-negative floating tensor, any shape (float32 or float64: scales of a
            narrower dtype would underflow).

    Returns:
        The scales, a tensor like ``amax``, each positive and finite for a finite ``amax``.
    """
    scale = amax * (1.0 / E4M3_MAX)
    return torch.where(scale >= E4M3_MIN_SCALE, scale, torch.ones_like(scale))


def _tile_width(state: torch.Tensor, block_v: int) -> int:
    """Columns per scale: ``min(block_v, V)``, at least 1 (one tile where ``block_v >= V``,
    the same scale as a ``block_v``-wide tile with zero padding)."""
    return max(1, min(block_v, state.shape[-1]))


def _per_column(scales: torch.Tensor, value_dim: int, width: int) -> torch.Tensor:
    """``scales [..., n_tiles]`` -> ``[..., V]``, each column its tile's scale.

    An index, not padding the state to whole tiles: Inductor on the CPU (torch 2.13)
    miscompiled the padded form's partial last tile (V = 80 at 64-column tiles).
    """
    return scales.index_select(-1, torch.arange(value_dim, device=scales.device) // width)


def quantize_state_fp8(
    state: torch.Tensor, block_v: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a key-first state ``[..., K, V]`` to E4M3 with one scale per ``[K, block_v]`` tile.

    Returns:
        ``(values, scales)``: ``values`` ``torch.float8_e4m3fn`` of ``state``'s shape,
        ``scales [..., ceil(V / block_v)]`` in ``promote_types(state.dtype, float32)``
        (:func:`e4m3_scale` of the tile's amax: ``amax * (1 / 448)``, or 1 where that is
        below ``2^-126``, amax below ~5.3e-36: such a tile stores zeros). The division and the
        rounding (to nearest, ties to even) happen in that dtype; ``|state / scale| <= 448``.
    """
    with torch.no_grad():
        # Scales in float32 at least: amax / 448 underflows in float16.
        x = to_work(state)
        value_dim, width = x.shape[-1], _tile_width(x, block_v)
        tiles = -(-value_dim // width)
        columns = torch.nn.functional.pad(x.abs().amax(dim=-2), (0, tiles * width - value_dim))
        scales = e4m3_scale(columns.unflatten(-1, (tiles, width)).amax(dim=-1))
        values = x / _per_column(scales, value_dim, width)[..., None, :]
        return values.to(torch.float8_e4m3fn).contiguous(), scales


def dequantize_state_fp8(
    values: torch.Tensor, scales: torch.Tensor, block_v: int = 64,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``values [..., K, V]`` (float8) times the scale of their ``[K, block_v]`` tile, in ``dtype``.

    The inverse of :func:`quantize_state_fp8`: ``scales [..., ceil(V / block_v)]`` as it
    returns them (any floating dtype, cast to ``dtype``); returns ``[..., K, V]`` in
    ``dtype`` (a tile of scale 1 with zero values, a tiny one, comes back as zeros).
    """
    width = _tile_width(values, block_v)
    return (values.to(dtype) * _per_column(scales.to(dtype), values.shape[-1], width)[..., None, :]
            ).contiguous()


def state_fp8_qdq_reference(state: torch.Tensor, block_v: int = 64) -> torch.Tensor:
    """Dynamic E4M3 quantize-dequantize with one scale per ``[K, block_v]`` tile.

    ``state`` is key-first, ``[..., K, V]``. The value axis is cut into tiles of
    ``block_v`` columns (the last one may be partial); each ``[K, block_v]`` tile
    is divided by its scale :func:`e4m3_scale` (``amax * (1 / 448)``), rounded to
    ``torch.float8_e4m3fn`` and multiplied back. A tile whose ``amax * (1 / 448)`` is
    below ``2^-126`` (amax below ~5.3e-36: all zero, subnormal or tiny) takes scale 1 and
    comes back as zeros, off by at most its amax, never NaN. The gradient is
    the identity (straight-through): neither the scales nor the rounding contribute.

    Args:
        state: floating tensor ``[..., K, V]``.
        block_v: value columns per scale, a positive int.

    Returns:
        A tensor like ``state`` (same shape and dtype).

    Raises:
        ValueError: if ``state`` has fewer than 2 dims or ``block_v < 1``.

    Source: the E4M3 format of the OCP 8-bit floating point specification, as
    ``torch.float8_e4m3fn`` implements it; the tiling and the all-zero tile's scale 1 from
    the reference API of the specification.
    """
    if state.dim() < 2:
        raise ValueError(
            f"state_fp8_qdq: state must be [..., K, V], got shape {tuple(state.shape)}"
        )
    if int(block_v) < 1:
        raise ValueError(f"state_fp8_qdq: block_v must be a positive int, got {block_v}")
    if state.numel() == 0:
        return state + 0.0
    with torch.no_grad():
        values, scales = quantize_state_fp8(state, block_v)
        rounded = dequantize_state_fp8(values, scales, block_v, scales.dtype).to(state.dtype)
    return state + (rounded - state).detach()
