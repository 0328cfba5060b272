"""``kdn-compile bench``: time the ops and layers on one CUDA GPU, optionally against FLA.

    kdn-compile bench [--ops gdn,kda,kdn,layers,decode,checkpoints,qat,qwen3next,coldstart,coldstart-layers] [--shapes BxTxH,...] [--against fla] [--profile] [--out DIR]
    kdn-compile bench --quick [--against fla] [--recorded PATH] [--out DIR]

For each op family the command first checks ours (and FLA's, with ``--against fla``)
against the reference at a small shape, then times every shape with
``triton.testing.do_bench`` medians after a warm-up, prints a markdown table and writes
to ``--out``: ``rows.json`` (one row per measurement with GPU, versions, commit and UTC
time), ``results.md`` (the tables) and, where matplotlib is installed
(``pip install kdn-compile[bench]``), PNG plots of time against sequence length and
against batch.

``--quick`` (:mod:`kdn_compile.bench.quick`) is a speed guard: one recorded shape of each op
family, timed in one process (a 3-minute budget from empty caches) and judged against its row
in ``docs/benchmarks.md`` (:mod:`kdn_compile.bench.recorded`); exit status 3 when one of
ours is more than 5% slower than recorded.

Adding an op family
-------------------
A family is a module of this package named in :data:`FAMILIES` (``--ops`` name ->
module). It defines:

``TITLE: str``
    the heading of its table, naming what every shape shares (head size, dtype, ...).
``DEFAULT_SHAPES: tuple[Shape, ...]``
    the shapes timed when ``--shapes`` is not given.
``check(fla: bool) -> dict[str, float]``
    runs ours (and FLA's when ``fla`` is true) at a small shape against the reference
    and returns the relative errors by name (``"o"``, ``"dq"``, ``"o (FLA)"``, ...);
    raises :class:`~kdn_compile.bench.timing.CheckFailed` when one is above its tolerance.
    Called once, before any timing. A family whose measurements check themselves returns
    ``{}`` and raises ``CheckFailed`` from ``measure`` instead.
``measure(shape: Shape, fla: bool) -> list[dict]``
    times one shape and returns one row per measurement: ``{"case": str, "impl": str,
    "ms": float}`` plus, optionally, ``"peak_mib": float``, ``"GBps": float`` and
    ``"graph_breaks": int``, and ``"versus": str`` (an ``impl`` to show the time relative
    to). ``impl`` is ``"ours"`` for the
    timed kdn function, ``"FLA"`` for FLA's; other names (``"ours eager"``) add columns.
    The command adds the family, the shape and the run's metadata to each row. The
    ``gdn``, ``kda`` and ``kdn`` families also take ``on_row=``, a callable given each row
    as soon as it is measured (``--quick`` prints them so).
``profile_steps(shape: Shape, fla: bool) -> dict[str, Callable[[], None]]`` (optional)
    one forward+backward step per implementation, as ``measure`` times it: with
    ``--profile`` each is broken down by GPU kernel
    (:func:`~kdn_compile.bench.timing.kernel_times`) into ``profile.md``.
``PLOT_IMPLS: tuple[str, ...]`` (optional)
    the implementations drawn in the plots (default: all).

:mod:`kdn_compile.bench.timing` holds the shared helpers (:func:`~.timing.median_ms`,
:func:`~.timing.rotating`, :func:`~.timing.peak_mib`, :func:`~.timing.relative_error`).
"""

from kdn_compile.bench.timing import CheckFailed, Shape, parse_shapes

FAMILIES = {
    "gdn": "kdn_compile.bench.gdn",
    "kda": "kdn_compile.bench.kda",
    "kdn": "kdn_compile.bench.kdn",
    "layers": "kdn_compile.bench.layers",
    "decode": "kdn_compile.bench.decode",
    "checkpoints": "kdn_compile.bench.checkpoints",
    "qwen3next": "kdn_compile.bench.qwen3_next",
    "qat": "kdn_compile.bench.qat",
    "coldstart": "kdn_compile.bench.coldstart",
    "coldstart-layers": "kdn_compile.bench.coldstart_layers",
}
DEFAULT_OPS = ("gdn", "kda", "kdn", "layers", "decode", "checkpoints", "qat")
"""The families run when ``--ops`` is not given (``qwen3next`` needs transformers;
``coldstart`` and ``coldstart-layers`` compile everything from empty caches, minutes)."""

__all__ = ["DEFAULT_OPS", "FAMILIES", "CheckFailed", "Shape", "parse_shapes"]
