"""Device helpers on register tiles shared by the chunked kernels."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["dot32", "inv_dot", "inv_unit_lower", "inv_unit_lower_tile"]


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


@triton.jit
def inv_unit_lower_tile(b_a, BC: tl.constexpr, PREC: tl.constexpr):
    """``(I + A)^-1`` of a strictly lower ``[BT, BT]`` float32 tile ``A`` (``BT = 4 BC``),
    in registers, with ten ``[BT, BT]`` products at ``input_precision=PREC``.

    With ``D`` the ``BC x BC`` diagonal blocks of ``A`` and ``B = A - D``: ``P = (I + D)^-1 =
    (I - D)(I + D^2)(I + D^4)(I + D^8)`` (``D^16 = 0``), then ``I + A = (I + D)(I + N)`` with
    ``N = P B`` strictly block-lower (``N^4 = 0``), so ``(I + A)^-1 = (I - N + N^2 - N^3) P``.
    Products of lower-triangular tiles: the result's upper triangle is exactly zero. (Against
    float64 with TF32 products, normalized bf16 keys: largest error 1.0e-4 of the largest
    entry, 0.8e-4 by 16 x 16 block substitution; keys of norm 4: 5.9e-3 both.)
    """
    o_t = tl.arange(0, b_a.shape[0])
    eye = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)
    b_n = tl.where(o_t[:, None] // BC == o_t[None, :] // BC, -b_a, 0.0)  # -D
    b_b = b_a + b_n  # B
    b_p = eye + b_n
    b_q = inv_dot(b_n, b_n, PREC)
    b_p += inv_dot(b_p, b_q, PREC)
    b_q = inv_dot(b_q, b_q, PREC)
    b_p += inv_dot(b_p, b_q, PREC)
    b_q = inv_dot(b_q, b_q, PREC)
    b_p += inv_dot(b_p, b_q, PREC)  # P = (I + D)^-1
    b_n = inv_dot(b_p, b_b, PREC)  # N
    b_x = eye - b_n
    b_x += inv_dot(inv_dot(b_n, b_n, PREC), b_x, PREC)  # I - N + N^2 - N^3
    return inv_dot(b_x, b_p, PREC)
