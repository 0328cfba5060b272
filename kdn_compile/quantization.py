"""Fake quantizers for quantization-aware training with :func:`kdn_compile.chunk_gdn`.

``chunk_gdn(..., w_quantizer=f)`` calls ``f`` once on the whole WY operand ``W [B, T, Hv,
K]`` (float32) and uses what it returns; ``f`` is ordinary PyTorch with its own autograd,
traced by ``torch.compile`` between the two ops of the WY path. :func:`fp8_row_qdq` is
the example such a function: E4M3 fake quantization, one scale per row.
"""

from __future__ import annotations

import torch

from kdn_compile.reference._common import to_work
from kdn_compile.reference.fp8 import e4m3_scale

__all__ = ["fp8_row_qdq"]


def fp8_row_qdq(w: torch.Tensor) -> torch.Tensor:
    """E4M3 quantize-dequantize of ``w`` with one dynamic scale per row (last dim), and the
    identity (straight-through) gradient.

    Each row is divided by its scale ``amax * (1 / 448)``, rounded to
    ``torch.float8_e4m3fn`` (nearest, ties to even) and multiplied back; the rounding and
    the scales contribute no derivative. The scales, the division and the rounding happen
    in ``promote_types(w.dtype, float32)`` whatever ``w``'s dtype (a float16 scale would
    underflow), the result is cast back to ``w.dtype``. A row whose ``amax * (1 / 448)``
    is below ``2^-126`` (amax below ~5.3e-36: all zero, subnormal or tiny) takes scale 1
    and comes back as zeros, off by at most its amax, never NaN: the rule of
    :func:`kdn_compile.reference.fp8.e4m3_scale`, as for the FP8 state. Elementwise
    PyTorch: Inductor fuses it.

    Args:
        w: a floating tensor ``[..., K]`` (for ``w_quantizer``: ``W [B, T, Hv, K]``).

    Returns:
        A tensor like ``w`` (same shape and dtype: float16, bfloat16, float32 or float64).

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
        wide = to_work(w)
        scale = e4m3_scale(wide.abs().amax(-1, keepdim=True))
        rounded = ((wide / scale).to(torch.float8_e4m3fn).to(wide.dtype) * scale).to(w.dtype)
    return w + (rounded - w).detach()
