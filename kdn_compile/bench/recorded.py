"""The recorded rows of ``docs/benchmarks.md`` and the verdict of a new time against them.

The page's tables are markdown: a header line, a ``|---|`` line, then one line per row.
:func:`parse_tables` turns each row into a dict keyed by its table's header cells plus
``"section"``, the ``## `` heading the table stands under; :func:`recorded_ms` looks a
time up by section, case, shape and column.

The family tables are one GPU's (:data:`TABLES_GPU`). For every other GPU the page keeps
``--quick``'s own rows in one table with a ``GPU`` column (:data:`GUARD_SECTION`), looked
up by :func:`guard_ms`; :func:`recorded_for` chooses between the two by the GPU of the run.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

TOLERANCE = 0.05  # a time more than 5% above its recorded row is SLOWER
SLOWER = "SLOWER"
OK = "ok"
MISSING = "no recorded row"
TABLES_GPU = "NVIDIA H200"
"""the GPU of the page's family tables (``torch.cuda.get_device_name()``)"""
GUARD_SECTION = "Speed guard rows on other GPUs"
"""the ``## `` heading of the table of ``--quick`` rows by GPU"""
GUARD_HEADER = ("GPU", "case", "B x T x H", "impl", "ms", "commit", "date")


def default_page() -> str:
    """``docs/benchmarks.md`` of the checkout that holds the imported ``kdn_compile`` (the
    path is returned whether or not the file exists: an installed package has no docs)."""
    package = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    return os.path.join(os.path.dirname(package), "docs", "benchmarks.md")


def parse_tables(text: str) -> list[dict[str, str]]:
    """Every body row of every markdown table in ``text``: ``{"section": heading, header
    cell: row cell, ...}``, ``heading`` the text of the last ``## `` line above the table
    (``""`` before the first)."""
    rows, section, header = [], "", None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("## "):
            section = line[3:].strip()
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if header is None:
            header = cells
        elif not all(set(cell) <= set("-: ") for cell in cells):
            rows.append({"section": section, **dict(zip(header, cells))})
    return rows


def read_page(path: str) -> list[dict[str, str]] | None:
    """:func:`parse_tables` of the file at ``path``, or None when there is none."""
    try:
        with open(path, encoding="utf-8") as f:
            return parse_tables(f.read())
    except FileNotFoundError:
        return None


def _first_ms(rows: Sequence[dict[str, str]], matches, column: str) -> float | None:
    """The milliseconds in ``column`` of the first row for which ``matches(row)``, or None
    when there is no such row or its cell is not a number (``-``)."""
    for row in rows:
        if matches(row):
            try:
                return float(row.get(column, ""))
            except ValueError:
                return None
    return None


def recorded_ms(rows: Sequence[dict[str, str]], section: str, case: str, shape: str,
                column: str) -> float | None:
    """The milliseconds in ``column`` (``"ours ms"``, ``"FLA graph ms"``, ...) of the row of
    ``case`` at ``shape`` (``"8x4096x16"``) in the first table whose section starts with
    ``section``, or None when there is no such row or its cell is not a number (``-``)."""
    return _first_ms(rows, lambda row: (row["section"].startswith(section)
                                        and row.get("case") == case
                                        and row.get("B x T x H") == shape), column)


def guard_ms(rows: Sequence[dict[str, str]], gpu: str, case: str, shape: str,
             impl: str) -> float | None:
    """The milliseconds of ``impl`` (``"ours"``, ``"FLA graph"``, ...) for ``case`` (the
    family and its case, ``"gdn fwd+bwd"``) at ``shape`` recorded on ``gpu`` in the
    :data:`GUARD_SECTION` table, or None without such a row."""
    return _first_ms(rows, lambda row: (row["section"] == GUARD_SECTION
                                        and row.get("GPU") == gpu and row.get("case") == case
                                        and row.get("B x T x H") == shape
                                        and row.get("impl") == impl), "ms")


def has_rows_for(rows: Sequence[dict[str, str]], gpu: str) -> bool:
    """Whether the page records ``--quick``'s times for ``gpu``: its family tables are
    ``gpu``'s, or the :data:`GUARD_SECTION` table has a row of ``gpu``."""
    return gpu == TABLES_GPU or any(
        row["section"] == GUARD_SECTION and row.get("GPU") == gpu for row in rows)


def recorded_for(rows: Sequence[dict[str, str]], gpu: str, section: str, family: str,
                 case: str, shape: str, impl: str) -> float | None:
    """The time recorded on ``gpu`` for ``impl`` in ``case`` of ``family`` at ``shape``: a
    :data:`GUARD_SECTION` row of ``gpu`` first; else, on :data:`TABLES_GPU`, the family
    table under ``section`` (:func:`recorded_ms`, column ``"<impl> ms"``); else None. Times
    of one GPU are never compared with another's."""
    ms = guard_ms(rows, gpu, f"{family} {case}", shape, impl)
    if ms is None and gpu == TABLES_GPU:
        ms = recorded_ms(rows, section, case, shape, f"{impl} ms")
    return ms


def guard_row(row: dict) -> str:
    """One line of the :data:`GUARD_SECTION` table for a measured ``--quick`` row (with
    its run's metadata): ``| GPU | family case | BxTxH | impl | ms | commit | date |``."""
    cells = [row["gpu"], f"{row['family']} {row['case']}",
             f"{row['batch']}x{row['length']}x{row['heads']}", row["impl"], f"{row['ms']:.3f}",
             f"`{row['commit']}`", row["time"][:10]]
    return "| " + " | ".join(cells) + " |"


def change(ms: float, recorded: float | None) -> float | None:
    """``ms / recorded - 1`` (0.05: 5% slower), or None without a recorded time."""
    return None if recorded is None else ms / recorded - 1


def verdict(ms: float, recorded: float | None, tolerance: float = TOLERANCE) -> str:
    """``"SLOWER"`` when ``ms`` is more than ``tolerance`` (a fraction) above ``recorded``,
    ``"no recorded row"`` without one, else ``"ok"`` (equal, faster, or at most
    ``tolerance`` slower)."""
    if recorded is None:
        return MISSING
    return SLOWER if ms > recorded * (1 + tolerance) else OK
