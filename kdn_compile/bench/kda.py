"""KDA: ``kdn_compile.chunk_kda`` against FLA's ``chunk_kda``.

Forward, and forward+backward of a random output gradient through autograd, at
K = V = 128 in bf16 with per-key float32 gates, a float32 initial state and the final
state returned.
"""

from __future__ import annotations

from kdn_compile.api import chunk_kda
from kdn_compile.bench import _delta
from kdn_compile.bench.timing import Shape
from kdn_compile.reference import chunk_kda_reference

TITLE = "KDA: chunk_kda vs FLA chunk_kda, K = V = 128, bf16"
DEFAULT_SHAPES = (Shape(1, 4096, 16), Shape(1, 16384, 16), Shape(1, 32768, 16), Shape(4, 4096, 16),
                  Shape(8, 4096, 16))  # plots: T at B = 1, B at T = 4096


def ours(q, k, v, g, beta, h0, scale):
    return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=h0)


def fla():
    """FLA's KDA in our argument order."""
    from fla.ops.kda import chunk_kda

    return _delta.fla_call(chunk_kda)


def check(against_fla: bool) -> dict[str, float]:
    return _delta.check(ours, fla() if against_fla else None, chunk_kda_reference,
                        per_key=True, where="kda")


def _impls(against_fla: bool) -> dict:
    return {"ours": ours, **({"FLA": fla()} if against_fla else {})}


def measure(shape: Shape, against_fla: bool, on_row=None) -> list[dict]:
    """Forward and forward+backward rows at ``shape``; ``on_row(row)`` as each is measured."""
    return _delta.measure(shape, _impls(against_fla), per_key=True, on_row=on_row)


def profile_steps(shape: Shape, against_fla: bool) -> dict:
    return _delta.steps(shape, _impls(against_fla), per_key=True)
