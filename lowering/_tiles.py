"""Device helpers on register tiles shared by the chunked kernels."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["dot32", "inv_dot", "inv_unit_lower"]


@triton.jit
def dot32(a, b):
    """``a @ b`` in exact float32 (no TF32 rounding of the inputs)."""
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def inv_dot(a, b, PREC: tl.constexpr):
    """``a @ b`` of float32 tiles with ``input_precision=PREC``: ``"ieee"`` (exact) or
    ``"tf32"`` (see :func:`~kdn_compile.lowering._launch.inverse_precision`)."""
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def inv_unit_lower(b_l, PREC: tl.constexpr):
    """``(I + L)^-1`` of a strictly lower ``[16, 16]`` float32 tile ``L``, its products
    taken with ``input_precision=PREC`` (:func:`inv_dot`).

    ``L`` is nilpotent (``L^16 = 0``), so ``(I + L)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8)``:
    six products instead of a 16-step row substitution, whose steps each wait on the last.
    """
    o_c = tl.arange(0, b_l.shape[0])
    b_n = -b_l
    b_t = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0) + b_n
    b_p = inv_dot(b_n, b_n, PREC)
    b_t += inv_dot(b_t, b_p, PREC)
    b_p = inv_dot(b_p, b_p, PREC)
    b_t += inv_dot(b_t, b_p, PREC)
    b_p = inv_dot(b_p, b_p, PREC)
    b_t += inv_dot(b_t, b_p, PREC)
    return b_t
