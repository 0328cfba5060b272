"""GDN: ``kdn_compile.chunk_gdn`` against FLA's ``chunk_gated_delta_rule``.

Forward, and forward+backward of a random output gradient through autograd, at
K = V = 128 in bf16 with a float32 initial state and the final state returned.
"""

from __future__ import annotations

from kdn_compile.api import chunk_gdn
from kdn_compile.bench import _delta
from kdn_compile.bench.timing import Shape
from kdn_compile.reference import chunk_gdn_reference

TITLE = "GDN: chunk_gdn vs FLA chunk_gated_delta_rule, K = V = 128, bf16"
DEFAULT_SHAPES = (Shape(1, 4096, 16), Shape(1, 16384, 16), Shape(1, 32768, 16), Shape(4, 4096, 16),
                  Shape(8, 4096, 16))  # plots: T at B = 1, B at T = 4096


def ours(q, k, v, g, beta, h0, scale):
    return chunk_gdn(q, k, v, g, beta, scale=scale, initial_state=h0)


def fla():
    """FLA's GDN in our argument order.

    fla-core 0.6.0 refuses its GDN backward on Hopper with Triton < 3.7.1 (a miscompiled
    gated kernel); the refusal is lifted so that it can be timed: its forward is checked
    against the reference, its backward is not.
    """
    import fla.ops.common.chunk_o as chunk_o
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    chunk_o.TRITON_ABOVE_3_7_1 = True
    return _delta.fla_call(chunk_gated_delta_rule)


def check(against_fla: bool) -> dict[str, float]:
    return _delta.check(ours, fla() if against_fla else None, chunk_gdn_reference,
                        per_key=False, where="gdn")


def _impls(against_fla: bool) -> dict:
    return {"ours": ours, **({"FLA": fla()} if against_fla else {})}


def measure(shape: Shape, against_fla: bool, on_row=None) -> list[dict]:
    """Forward and forward+backward rows at ``shape``; ``on_row(row)`` as each is measured."""
    return _delta.measure(shape, _impls(against_fla), per_key=False, on_row=on_row)


def profile_steps(shape: Shape, against_fla: bool) -> dict:
    return _delta.steps(shape, _impls(against_fla), per_key=False)
