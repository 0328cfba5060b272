"""Cold start of the layers: :mod:`kdn_compile.bench.coldstart` for its
:data:`~kdn_compile.bench.coldstart.LAYER_CASES`, one compiled training step of each of our
layers (FLA's eager), from empty caches and cached, in new processes within the same
budget."""

from __future__ import annotations

from kdn_compile.bench import coldstart
from kdn_compile.bench.timing import Shape

TITLE = ("Cold start of the layers: first training step in a new process, empty caches and "
         "cached, hidden = heads x 128, bf16 (ms)")
DEFAULT_SHAPES = coldstart.DEFAULT_SHAPES
PLOT_IMPLS = ()
check = coldstart.check


def measure(shape: Shape, against_fla: bool) -> list[dict]:
    """:func:`kdn_compile.bench.coldstart.measure` of the layer cases."""
    return coldstart.measure(shape, against_fla, cases=coldstart.LAYER_CASES)
