"""The recorded rows of ``docs/benchmarks.md`` and the verdict of a new time against them.

The page's tables are markdown: a header line, a ``|---|`` line, then one line per row.
:func:`parse_tables` turns each row into a dict keyed by its table's header cells plus
``"section"``, the ``## `` heading the table stands under; :func:`recorded_ms` looks a
time up by section, case, shape and column.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

TOLERANCE = 0.05  # a time more than 5% above its recorded row is SLOWER
SLOWER = "SLOWER"
OK = "ok"
MISSING = "no recorded row"


def default_page() -> str:
    """``docs/benchmarks.md`` of the checkout that holds the imported ``kdn_compile`` (the
    path is returned whether or not the file exists: an installed package has no docs)."""
    import kdn_compile

    package = os.path.dirname(os.path.realpath(kdn_compile.__file__))
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


def recorded_ms(rows: Sequence[dict[str, str]], section: str, case: str, shape: str,
                column: str) -> float | None:
    """The milliseconds in ``column`` (``"ours ms"``, ``"FLA graph ms"``, ...) of the row of
    ``case`` at ``shape`` (``"8x4096x16"``) in the first table whose section starts with
    ``section``, or None when there is no such row or its cell is not a number (``-``)."""
    for row in rows:
        if (row["section"].startswith(section) and row.get("case") == case
                and row.get("B x T x H") == shape):
            try:
                return float(row.get(column, ""))
            except ValueError:
                return None
    return None


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
