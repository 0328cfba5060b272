"""Device helpers on register tiles shared by the chunked kernels."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["dot32", "inv_unit_lower"]


@triton.jit
def dot32(a, b):
    """``a @ b`` in exact float32 (no TF32 rounding of the inputs)."""
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def inv_unit_lower(b_l):
    """``(I + L)^-1`` of a strictly lower ``[16, 16]`` float32 tile ``L``.

    ``L`` is nilpotent (``L^16 = 0``), so ``(I + L)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8)``:
    six exact float32 products instead of a 16-step row substitution, whose steps
    each wait on the last.
    """
    o_c = tl.arange(0, b_l.shape[0])
    b_n = -b_l
    b_t = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0) + b_n
    b_p = dot32(b_n, b_n)
    b_t += dot32(b_t, b_p)
    b_p = dot32(b_p, b_p)
    b_t += dot32(b_t, b_p)
    b_p = dot32(b_p, b_p)
    b_t += dot32(b_t, b_p)
    return b_t
