"""Quantization-aware GDN: ``chunk_gdn`` with FP8 state QDQ and with a fake quantizer of
``W``, against the plain op.

Forward, and forward+backward (with peak memory) of a random output gradient, at
K = V = 128 in bf16 with a float32 initial state, each under
``torch.compile(fullgraph=True)`` as training runs them: the plain op; ``state_qdq=True``
(the backward recomputes the forward's float8 chunk states bit for bit); and
``w_quantizer=fp8_row_qdq`` (two ops with the fake quantizer between them, fused by
Inductor). The ratio columns divide each by the plain op.
"""

from __future__ import annotations

import functools

import torch

from kdn_compile.api import chunk_gdn
from kdn_compile.bench import _delta
from kdn_compile.bench.timing import Shape
from kdn_compile.quantization import fp8_row_qdq
from kdn_compile.reference import chunk_gdn_reference

TITLE = ("Quantization-aware GDN: chunk_gdn with state_qdq / w_quantizer vs plain, "
         "K = V = 128, bf16, torch.compile")
DEFAULT_SHAPES = (Shape(8, 4096, 16), Shape(1, 32768, 16))
# A final state under QDQ lies on the E4M3 grid of its tiles: rounding at bf16 level moves
# some elements by one E4M3 step (2^-3 relative). The float64 reference itself, from
# bf16-rounded inputs, is 1.6e-2 from the one from exact inputs at the check shape.
STATE_TOLERANCE = 6e-2
OPTIONS = {"plain": {}, "state_qdq": {"state_qdq": True},
           "w_quantizer": {"w_quantizer": fp8_row_qdq}}


def _path(options: dict):
    def run(q, k, v, g, beta, h0, scale):
        return chunk_gdn(q, k, v, g, beta, scale=scale, initial_state=h0, **options)
    return run


def check(against_fla: bool) -> dict[str, float]:
    """Each path (eager) against ``chunk_gdn_reference`` with the same options."""
    errors = {}
    for name, options in OPTIONS.items():
        found = _delta.check(
            _path(options), None, functools.partial(chunk_gdn_reference, **options),
            per_key=False, where=f"qat {name}",
            state_tolerance=STATE_TOLERANCE if "state_qdq" in options else _delta.TOLERANCE)
        errors.update({f"{n} ({name})": e for n, e in found.items()})
    return errors


def _compiled() -> dict:
    torch._dynamo.reset()
    return {name: torch.compile(_path(options), fullgraph=True) for name, options in OPTIONS.items()}


def measure(shape: Shape, against_fla: bool) -> list[dict]:
    rows = _delta.measure(shape, _compiled(), per_key=False)
    return [dict(row, versus="plain") if row["impl"] != "plain" else row for row in rows]


def profile_steps(shape: Shape, against_fla: bool) -> dict:
    return _delta.steps(shape, _compiled(), per_key=False)
