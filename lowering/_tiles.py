"""Device helpers on register tiles shared by the chunked kernels."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["inv_unit_lower"]


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
    b_p = tl.dot(b_n, b_n, input_precision="ieee")
    b_t += tl.dot(b_t, b_p, input_precision="ieee")
    b_p = tl.dot(b_p, b_p, input_precision="ieee")
    b_t += tl.dot(b_t, b_p, input_precision="ieee")
    b_p = tl.dot(b_p, b_p, input_precision="ieee")
    b_t += tl.dot(b_t, b_p, input_precision="ieee")
    return b_t
