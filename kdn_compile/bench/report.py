"""Tables, JSON rows and plots of ``kdn-compile bench`` results.

A row is one measurement: ``family``, ``case``, ``impl``, ``batch``, ``length``,
``heads``, ``ms`` and optionally ``peak_mib``, ``GBps``, ``graph_breaks`` and ``versus``
(the implementation whose time the table divides this one's by), plus the run's metadata
(``gpu``, ``torch``, ``triton``, ``fla``, ``commit``, ``time``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

META_KEYS = ("gpu", "torch", "triton", "fla", "commit", "time")


def _shape(row: dict) -> str:
    return f"{row['batch']}x{row['length']}x{row['heads']}"


def _unique(values):
    return list(dict.fromkeys(values))


def table(rows: Sequence[dict]) -> str:
    """A markdown table of one family's rows: one line per (case, shape), the milliseconds
    of each implementation, ``ours / FLA`` (and of their CUDA-graph replays) where both ran
    and ``impl / versus`` for rows that name a ``versus``, peak memory, state bandwidth
    (``GBps``) and graph breaks where measured."""
    impls = _unique(r["impl"] for r in rows)
    by_key = {(r["case"], _shape(r), r["impl"]): r for r in rows}
    pairs = [("ours", "FLA"), ("ours graph", "FLA graph")]
    pairs += _unique((r["impl"], r["versus"]) for r in rows if "versus" in r)
    ratios = [(a, b) for a, b in pairs if a in impls and b in impls]
    peaks = [i for i in impls if any("peak_mib" in r for r in rows if r["impl"] == i)]
    rates = [i for i in impls if any("GBps" in r for r in rows if r["impl"] == i)]
    breaks = [i for i in impls if any("graph_breaks" in r for r in rows if r["impl"] == i)]
    header = ["case", "B x T x H", *(f"{i} ms" for i in impls)]
    header += [f"{a} / {b}" for a, b in ratios]
    header += [f"{i} peak MiB" for i in peaks]
    header += [f"{i} GB/s" for i in rates]
    header += [f"{i} graph breaks" for i in breaks]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for case, shape in _unique((r["case"], _shape(r)) for r in rows):
        got = {i: by_key.get((case, shape, i)) for i in impls}
        cells = [case, shape]
        cells += [f"{got[i]['ms']:.3f}" if got[i] else "-" for i in impls]
        for a, b in ratios:
            cells.append(f"{got[a]['ms'] / got[b]['ms']:.2f}" if got[a] and got[b] else "-")
        cells += [f"{got[i]['peak_mib']:.0f}" if got[i] and "peak_mib" in got[i] else "-"
                  for i in peaks]
        cells += [f"{got[i]['GBps']:.0f}" if got[i] and "GBps" in got[i] else "-"
                  for i in rates]
        cells += [str(got[i]["graph_breaks"]) if got[i] and "graph_breaks" in got[i] else "-"
                  for i in breaks]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kernel_table(kernels: Sequence[dict], top: int = 12) -> str:
    """A markdown table of :func:`~kdn_compile.bench.timing.kernel_times` rows: the ``top``
    slowest kernels with calls and milliseconds per step and their share of the step's GPU
    time, then one line for the rest and the total."""
    total = sum(k["ms"] for k in kernels) or 1.0
    lines = ["| kernel | calls | ms | share |", "|---|---|---|---|"]
    rest = kernels[top:]
    for k in kernels[:top]:
        name = k["kernel"] if len(k["kernel"]) <= 80 else k["kernel"][:77] + "..."
        lines.append(f"| `{name}` | {k['calls']:g} | {k['ms']:.3f} | {k['ms'] / total:.0%} |")
    if rest:
        ms = sum(k["ms"] for k in rest)
        lines.append(f"| ({len(rest)} others) | {sum(k['calls'] for k in rest):g} | {ms:.3f} | "
                     f"{ms / total:.0%} |")
    lines.append(f"| total | {sum(k['calls'] for k in kernels):g} | "
                 f"{sum(k['ms'] for k in kernels):.3f} | 100% |")
    return "\n".join(lines)


def profile_markdown(sections: Sequence[tuple[str, str, str, Sequence[dict]]], meta: dict,
                     command: str) -> str:
    """The profile page: the run's description, then per ``(family title, shape, impl,
    kernels)`` a heading and :func:`kernel_table`."""
    parts = [describe(meta, command).replace(
        "milliseconds are triton.testing.do_bench medians",
        "GPU milliseconds per forward+backward step by kernel (torch.profiler)")]
    for title, shape, impl, kernels in sections:
        parts += [f"### {title}: {impl}, {shape}", kernel_table(kernels)]
    return "\n\n".join(parts) + "\n"


def write_profile(out_dir: str, sections: Sequence[tuple[str, str, str, Sequence[dict]]],
                  meta: dict, command: str) -> str:
    """Writes :func:`profile_markdown` to ``out_dir/profile.md``; returns its path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "profile.md")
    with open(path, "w") as f:
        f.write(profile_markdown(sections, meta, command))
    return path


def describe(meta: dict, command: str) -> str:
    """One line naming the GPU, versions, commit and time of a run, and its command."""
    return (f"{meta['gpu']}, torch {meta['torch']}, Triton {meta['triton']}, FLA: {meta['fla']}; "
            f"commit {meta['commit']}, {meta['time']}; `{command}`; "
            "milliseconds are triton.testing.do_bench medians")


def markdown(sections: Sequence[tuple[str, Sequence[dict]]], meta: dict, command: str,
             extra: str = "") -> str:
    """The results page: the run's description, then ``### title`` and a table per family,
    then ``extra`` (markdown) if any."""
    parts = [describe(meta, command)]
    for title, rows in sections:
        parts += [f"### {title}", table(rows)]
    return "\n\n".join(parts + ([extra] if extra else [])) + "\n"


def write(out_dir: str, sections: Sequence[tuple[str, Sequence[dict]]], meta: dict,
          command: str, extra: str = "") -> list[str]:
    """Writes ``rows.json`` (every row with the metadata) and ``results.md`` (with
    ``extra`` after the tables) under ``out_dir`` (created if missing); returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    rows = [dict(row, **meta) for _, family in sections for row in family]
    paths = [os.path.join(out_dir, "rows.json"), os.path.join(out_dir, "results.md")]
    with open(paths[0], "w") as f:
        json.dump(rows, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(markdown(sections, meta, command, extra))
    return paths


def _series(rows, fixed: str, along: str):
    """``{(case, impl, fixed value): [(along value, ms), ...]}`` with heads held at their
    most common value, keeping only series of two points or more."""
    if not rows:
        return {}
    heads = max(_unique(r["heads"] for r in rows), key=[r["heads"] for r in rows].count)
    found = {}
    for r in rows:
        if r["heads"] == heads:
            found.setdefault((r["case"], r["impl"], r[fixed]), []).append((r[along], r["ms"]))
    return {key: sorted(points) for key, points in found.items() if len(points) > 1}


def plot(out_dir: str, family: str, rows: Sequence[dict],
         impls: Sequence[str] | None = None) -> list[str]:
    """PNG plots of time against sequence length (batch fixed) and against batch (length
    fixed), one line per implementation (those in ``impls`` when given) and case; returns
    the paths written. Prints why and returns ``[]`` when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("kdn-compile bench: matplotlib is not installed, no plots "
              "(pip install 'kdn-compile[bench]')")
        return []
    paths = []
    if impls is not None:
        rows = [r for r in rows if r["impl"] in impls]
    for along, fixed, label in (("length", "batch", "sequence length T"),
                                ("batch", "length", "batch B")):
        series = _series(rows, fixed, along)
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for (case, impl, value), points in series.items():
            ax.plot(*zip(*points), marker="o", label=f"{case} {impl} ({fixed} {value})")
        ax.set(xscale="log", yscale="log", xlabel=label, ylabel="ms (median)", title=family)
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        path = os.path.join(out_dir, f"{family}-vs-{along}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths
