"""FP8 (E4M3) fake quantization of recurrent states."""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


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
    value_dim = state.shape[-1]
    pad = (-value_dim) % block_v
    with torch.no_grad():
        tiles = torch.nn.functional.pad(state, (0, pad))
        tiles = tiles.unflatten(-1, (tiles.shape[-1] // block_v, block_v))
        # Scales in float32 at least: amax / 448 underflows in float16.
        tiles = tiles.to(torch.promote_types(state.dtype, torch.float32))
        amax = tiles.abs().amax(dim=(-3, -1), keepdim=True)
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        rounded = ((tiles / scale).to(torch.float8_e4m3fn).to(tiles.dtype) * scale).to(state.dtype)
        rounded = rounded.flatten(-2)[..., :value_dim]
    return state + (rounded - state).detach()
