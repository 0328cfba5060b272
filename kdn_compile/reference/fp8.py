"""FP8 (E4M3) quantization of recurrent states: fake quantization and the float8 pools.

One dynamic scale per ``[K, block_v]`` tile of a key-first state ``[..., K, V]``:
``scale = amax / 448`` (1 for an all-zero tile), values ``state / scale`` rounded to
``torch.float8_e4m3fn``. :func:`quantize_state_fp8` and :func:`dequantize_state_fp8`
are the two halves (the float8 state pools of the serving path store their output);
:func:`state_fp8_qdq_reference` is their composition with a straight-through gradient.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0

__all__ = ["E4M3_MAX", "quantize_state_fp8", "dequantize_state_fp8", "state_fp8_qdq_reference"]


def _tiles(state: torch.Tensor, block_v: int) -> torch.Tensor:
    """``[..., K, V]`` -> ``[..., K, n_tiles, block_v]``, the last tile zero-padded."""
    tiles = torch.nn.functional.pad(state, (0, (-state.shape[-1]) % block_v))
    return tiles.unflatten(-1, (tiles.shape[-1] // block_v, block_v))


def quantize_state_fp8(
    state: torch.Tensor, block_v: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a key-first state ``[..., K, V]`` to E4M3 with one scale per ``[K, block_v]`` tile.

    Returns:
        ``(values, scales)``: ``values`` ``torch.float8_e4m3fn`` of ``state``'s shape,
        ``scales [..., ceil(V / block_v)]`` in ``promote_types(state.dtype, float32)``
        (``amax / 448`` of the tile, 1 for an all-zero tile). The division and the
        rounding (to nearest, ties to even) happen in that dtype; ``|state / scale| <= 448``.
    """
    with torch.no_grad():
        tiles = _tiles(state, block_v).to(torch.promote_types(state.dtype, torch.float32))
        # Scales in float32 at least: amax / 448 underflows in float16.
        amax = tiles.abs().amax(dim=(-3, -1))
        scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        values = (tiles / scales[..., None, :, None]).to(torch.float8_e4m3fn)
        return values.flatten(-2)[..., : state.shape[-1]].contiguous(), scales


def dequantize_state_fp8(
    values: torch.Tensor, scales: torch.Tensor, block_v: int = 64,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``values [..., K, V]`` (float8) times the scale of their ``[K, block_v]`` tile, in ``dtype``."""
    tiles = _tiles(values.to(dtype), block_v)
    tiles = tiles * scales.to(dtype)[..., None, :, None]
    return tiles.flatten(-2)[..., : values.shape[-1]].contiguous()


def state_fp8_qdq_reference(state: torch.Tensor, block_v: int = 64) -> torch.Tensor:
    """Dynamic E4M3 quantize-dequantize with one scale per ``[K, block_v]`` tile.

    ``state`` is key-first, ``[..., K, V]``. The value axis is cut into tiles of
    ``block_v`` columns (the last one may be partial); each ``[K, block_v]`` tile
    is divided by ``amax / 448`` (scale 1 for an all-zero tile), rounded to
    ``torch.float8_e4m3fn`` and multiplied back. The gradient is the identity
    (straight-through): neither the scales nor the rounding contribute.

    Args:
        state: floating tensor ``[..., K, V]``.
        block_v: value columns per scale, a positive int.

    Returns:
        A tensor like ``state`` (same shape and dtype).

    Raises:
        ValueError: if ``state`` has fewer than 2 dims or ``block_v < 1``.
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
