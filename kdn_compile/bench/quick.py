"""``kdn-compile bench --quick``: a speed guard against the rows recorded in
``docs/benchmarks.md``.

One process times one recorded shape of each op family (:data:`CASES`), with FLA beside
ours wherever FLA is installed: GDN, KDA and Diag-KDN forward and forward+backward at
8 x 4096 x 16 heads (bf16, K = V = 128; Diag-KDN beside our ``chunk_kda``, FLA having
none), and GDN and KDA decode over a float32 pool at batch 256, one token, 32 value heads,
replayed from a CUDA graph. The timing is the families' own (``triton.testing.do_bench``
medians, :data:`~kdn_compile.bench.timing.WARMUP_MS` of warm-up and
:data:`~kdn_compile.bench.timing.REPEAT_MS` of repeats), without their correctness checks
(the GPU tests check the kernels), which would compile at other shapes; the whole run, cold
compiles included, has a budget of :data:`BUDGET_S` and says when it took longer.

Each row is printed as it is measured, with the time recorded for the same case, shape
and implementation; each of our rows gets a verdict (:func:`~.recorded.verdict`): ``ok``,
``SLOWER`` (more than 5% above the recorded time) or ``no recorded row``. FLA's rows show
its drift from its own recorded time: the noise of the machine. The exit status is
:data:`SLOWER_EXIT` when any case is SLOWER.

FLA's autotuning would take most of the budget on a cold machine: a run replays FLA's
choices recorded for this GPU and these versions (:mod:`~kdn_compile.bench.fla_choices`),
where they exist, and writes the choices it used to ``fla_choices.json`` beside its rows.
"""

from __future__ import annotations

import importlib
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from kdn_compile.bench import FAMILIES, fla_choices, recorded
from kdn_compile.bench.timing import Shape

BUDGET_S = 180  # the whole run from empty Triton caches; the run says when it took longer
SLOWER_EXIT = 3  # exit status when one of our times is SLOWER than its recorded row


class Case(NamedTuple):
    """One op family as ``--quick`` times it."""

    family: str
    """the ``--ops`` name; its table's title is the family's ``TITLE``"""
    section: str
    """how the heading of its table in ``docs/benchmarks.md`` starts"""
    shape: Shape
    judged: dict[str, str]
    """our implementation judged against its recorded row -> the one printed beside it"""


CASES = (
    Case("gdn", "GDN:", Shape(8, 4096, 16), {"ours": "FLA"}),
    Case("kda", "KDA:", Shape(8, 4096, 16), {"ours": "FLA"}),
    Case("kdn", "Diag-KDN:", Shape(8, 4096, 16), {"ours": "chunk_kda"}),
    Case("decode", "Decode", Shape(256, 1, 32), {"ours graph": "FLA graph"}),
)


def measure(case: Case, against_fla: bool, on_row: Callable[[dict], object]) -> list[dict]:
    """Times ``case``: its family's forward and forward+backward rows, or for ``decode`` the
    CUDA-graph replays over float32 pools; ``on_row(row)`` as each row is measured."""
    if case.family == "decode":
        from kdn_compile.bench import decode

        return decode.pool_rows(case.shape, against_fla, pools=("f32",), eager=False,
                                on_row=on_row)
    family = importlib.import_module(FAMILIES[case.family])
    return family.measure(case.shape, against_fla, on_row=on_row)


def annotate(case: Case, row: dict, page: list[dict], gpu: str) -> dict:
    """Adds to ``row`` (a measured row of ``case``) its family and shape, the time recorded
    for it on ``page`` on this ``gpu`` (``recorded_ms``, None without a row:
    :func:`~.recorded.recorded_for`) and, for a judged implementation, its ``verdict``;
    returns it."""
    row.update(family=case.family, batch=case.shape.batch, length=case.shape.length,
               heads=case.shape.heads)
    row["recorded_ms"] = recorded.recorded_for(page, gpu, case.section, case.family, row["case"],
                                               str(case.shape), row["impl"])
    if row["impl"] in case.judged:
        row["verdict"] = recorded.verdict(row["ms"], row["recorded_ms"])
    return row


def _against(ms: float | None, was: float | None) -> str:
    if ms is None:
        return "-"
    if was is None:
        return f"{ms:.3f} ms, no recorded row"
    return f"{ms:.3f} ms, recorded {was:.3f} ms ({recorded.change(ms, was):+.1%})"


def row_line(case: Case, row: dict) -> str:
    """``gdn fwd+bwd 8x4096x16 ours: 4.512 ms, recorded 4.537 ms (-0.6%): ok``."""
    line = f"{case.family} {row['case']} {case.shape} {row['impl']}: "
    line += _against(row["ms"], row["recorded_ms"])
    if "verdict" in row and row["recorded_ms"] is not None:
        line += f": {row['verdict']}"
    return line


def verdicts(case: Case, rows: list[dict]) -> list[dict]:
    """One entry per judged row of ``case`` (annotated by :func:`annotate`): ``{"case",
    "impl", "ms", "recorded_ms", "verdict", "beside", "beside_ms", "beside_recorded_ms"}``,
    the ``beside`` implementation's times None where it did not run."""
    by_key = {(r["case"], r["impl"]): r for r in rows}
    found = []
    for row in rows:
        if row["impl"] not in case.judged:
            continue
        beside = case.judged[row["impl"]]
        other = by_key.get((row["case"], beside), {})
        found.append({"case": f"{case.family} {row['case']}", "shape": str(case.shape),
                      "impl": row["impl"], "ms": row["ms"], "recorded_ms": row["recorded_ms"],
                      "verdict": row["verdict"], "beside": beside, "beside_ms": other.get("ms"),
                      "beside_recorded_ms": other.get("recorded_ms")})
    return found


def verdict_table(found: list[dict]) -> str:
    """A markdown table of :func:`verdicts` entries."""
    def ms(value):
        return "-" if value is None else f"{value:.3f}"

    def pct(value, was):
        return "-" if value is None or was is None else f"{recorded.change(value, was):+.1%}"

    lines = ["| case | B x T x H | impl | ms | recorded ms | change | verdict | beside | "
             "beside ms | beside recorded ms | beside change |", "|" + "---|" * 11]
    for v in found:
        cells = [v["case"], v["shape"], v["impl"], ms(v["ms"]), ms(v["recorded_ms"]),
                 pct(v["ms"], v["recorded_ms"]), v["verdict"], v["beside"], ms(v["beside_ms"]),
                 ms(v["beside_recorded_ms"]), pct(v["beside_ms"], v["beside_recorded_ms"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def guard_lines(sections: list[tuple[str, list[dict]]], meta: dict) -> str:
    """This run's rows as lines of the page's :data:`~.recorded.GUARD_SECTION` table, under
    its heading, for recording them on this GPU."""
    lines = [f"### Lines for `{recorded.GUARD_SECTION}`", "",
             "| " + " | ".join(recorded.GUARD_HEADER) + " |",
             "|" + "---|" * len(recorded.GUARD_HEADER)]
    lines += [recorded.guard_row({**meta, **row}) for _, rows in sections for row in rows]
    return "\n".join(lines)


def summary(found: list[dict]) -> str:
    """One line: every case ok, or the SLOWER ones with their change."""
    slower = [v for v in found if v["verdict"] == recorded.SLOWER]
    missing = sum(v["verdict"] == recorded.MISSING for v in found)
    if slower:
        return "quick: SLOWER than recorded: " + ", ".join(
            f"{v['case']} {v['shape']} {v['impl']} "
            f"({recorded.change(v['ms'], v['recorded_ms']):+.1%})" for v in slower)
    return (f"quick: {len(found) - missing} of {len(found)} cases ok"
            + (f", {missing} with no recorded row" if missing else ""))


def run(args, command: str) -> int:
    """Times :data:`CASES`, prints every row as it comes and the verdicts, writes
    ``rows.json`` and ``results.md`` under ``args.out``; returns :data:`SLOWER_EXIT` when a
    case is SLOWER, else 0. CUDA (and FLA, with ``--against fla``) must be there."""
    from kdn_compile.bench import report
    from kdn_compile.bench.timing import run_metadata

    started = time.monotonic()
    meta = run_metadata()
    print(report.describe(meta, command), flush=True)
    against = args.against == "fla" or importlib.util.find_spec("fla") is not None
    if not against:
        print("quick: FLA is not installed (import fla fails): ours only", flush=True)
    path = args.recorded or recorded.default_page()
    page = recorded.read_page(path)
    if page is None:
        print(f"quick: {path} does not exist (--recorded PATH): no recorded rows", flush=True)
    elif recorded.has_rows_for(page, meta["gpu"]):
        print(f"quick: comparing with the rows {path} records on {meta['gpu']}", flush=True)
    else:
        print(f"quick: {path} records no rows on {meta['gpu']}: no verdicts (the lines of "
              f"`{recorded.GUARD_SECTION}` in results.md record this run's)", flush=True)
    versions = {key: meta[key] for key in ("gpu", "fla", "triton")}
    choices = Path(args.out) / "fla_choices.json"
    if against:
        print("quick: " + fla_choices.replay_file(
            fla_choices.FOLDER / fla_choices.file_name(meta["gpu"]), versions), flush=True)
    sections, found = [], []
    for case in CASES:
        rows = []

        def show(row, case=case, rows=rows):
            rows.append(annotate(case, row, page or [], meta["gpu"]))
            print(row_line(case, row), flush=True)
        measure(case, against, show)
        found += verdicts(case, rows)
        sections.append((importlib.import_module(FAMILIES[case.family]).TITLE, rows))
        print(f"{case.family} {case.shape}: done, {time.monotonic() - started:.0f} s into the "
              "run", flush=True)
        # written after every family: a run stopped later keeps what it finished
        paths = report.write(args.out, sections, meta, command,
                             extra=f"### Against {path}\n\n{verdict_table(found)}\n\n"
                             + guard_lines(sections, meta))
        if against:
            fla_choices.write(choices, versions)
            paths.append(str(choices))
    print(f"\n{verdict_table(found)}\n", flush=True)
    print(summary(found), flush=True)
    elapsed = time.monotonic() - started
    print(f"quick: {elapsed:.0f} s" + ("" if elapsed <= BUDGET_S else
                                       f", over its {BUDGET_S} s budget"), flush=True)
    print("wrote " + ", ".join(paths), flush=True)
    if against:
        print(f"quick: {choices} holds FLA's autotuning choices of this run; a copy at "
              f"{fla_choices.FOLDER / fla_choices.file_name(meta['gpu'])} is replayed by later "
              "runs", flush=True)
    return SLOWER_EXIT if any(v["verdict"] == recorded.SLOWER for v in found) else 0
