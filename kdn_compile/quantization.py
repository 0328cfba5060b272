"""Fake quantizers for quantization-aware training with :func:`kdn_compile.chunk_gdn`.

``chunk_gdn(..., w_quantizer=f)`` calls ``f`` once on the whole WY operand ``W [B, T, Hv,
K]`` (float32) and uses what it returns; ``f`` is ordinary PyTorch with its own autograd,
traced by ``torch.compile`` between the two ops of the WY path. :func:`fp8_row_qdq` is
the example such a function: E4M3 fake quantization, one scale per row.
"""

from __future__ import annotations

import torch

from kdn_compile.reference.fp8 import E4M3_MAX

__all__ = ["fp8_row_qdq"]


def fp8_row_qdq(w: torch.Tensor) -> torch.Tensor:
    """E4M3 quantize-dequantize of ``w`` with one dynamic scale per row (last dim), and the
    identity (straight-through) gradient.

    Each row is divided by ``amax / 448`` (1 for an all-zero row), rounded to
    ``torch.float8_e4m3fn`` (nearest, ties to even) and multiplied back; the rounding and
    the scales contribute no derivative. Elementwise PyTorch: Inductor fuses it.

    Args:
        w: a floating tensor ``[..., K]`` (for ``w_quantizer``: ``W [B, T, Hv, K]``).

    Returns:
        A tensor like ``w`` (same shape and dtype).

    Raises:
        Nothing of its own: ``w`` is meant to be the float32 ``W`` that ``chunk_gdn``
        hands a ``w_quantizer``, whose arguments it has already checked.

    Source: the E4M3 format of the OCP 8-bit floating point specification, as
    ``torch.float8_e4m3fn`` implements it (largest finite value 448); the same format
    as the FP8 state of :func:`kdn_compile.state_fp8_qdq`.

    Example:
        >>> o, state = kdn_compile.chunk_gdn(q, k, v, g, beta, w_quantizer=fp8_row_qdq)  # doctest: +SKIP
    """
    with torch.no_grad():
        amax = w.abs().amax(-1, keepdim=True)
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        rounded = (w / scale).to(torch.float8_e4m3fn).to(w.dtype) * scale
    return w + (rounded - w).detach()
