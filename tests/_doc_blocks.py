"""The python examples of README.md and docs/*.md, docs/*.rst, and how they run.

A python block is a ```` ```python ```` fence (markdown) or a ``.. code-block:: python``
directive (reStructuredText). Conventions in the docs' source:

* ``# needs: cuda`` as a block's first line, or the same words in a comment on the line
  before the block (``<!-- needs: cuda -->`` before a markdown fence, ``.. needs: cuda``
  before an rst directive, a reason may follow): the test suite runs the block only on a
  CUDA machine, in the GPU tier, alone in a fresh interpreter. ``needs: torchrun``: a
  script launched on several processes, ``python -m torch.distributed.run
  --nproc-per-node 2``. Several needs are separated by commas.
* ``# prints: TEXT`` (on a line of its own or after a statement): the block prints the
  line ``TEXT``; the test checks it.
* A block that is not meant to run (a signature, shell commands, output) is not
  ``python``: ``text``, ``bash`` and the like.

Run as a script, ``python tests/_doc_blocks.py PAGE`` executes the page's blocks that need
nothing in page order, in one namespace, in this interpreter, and prints a JSON list of
each block's printed output; an error stops it with a traceback whose file and line are
the page's own.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEEDS = {"cuda", "torchrun"}


@dataclass
class Block:
    page: Path
    line: int  # the page line of the block's first code line (1-based)
    code: str
    needs: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def claims(self) -> list[str]:
        """The lines the block says it prints (``# prints: TEXT``), in order."""
        return re.findall(r"#\s*prints: (.*?)\s*$", self.code, re.M)


def pages() -> list[Path]:
    docs = ROOT / "docs"
    return [ROOT / "README.md", *sorted(docs.glob("*.md")), *sorted(docs.glob("*.rst"))]


def _needs(text: str | None, where: str) -> set[str]:
    """The needs of ``needs: a, b`` (then anything that is not a word: a reason)."""
    if text is None:
        return set()
    found = set(re.findall(r"[a-z]+", re.match(r"\s*[a-z]+(?:\s*,\s*[a-z]+)*", text)[0]))
    unknown = found - NEEDS
    if unknown:
        raise ValueError(f"{where}: unknown needs {sorted(unknown)} (known: {sorted(NEEDS)})")
    return found


def _first_line_needs(code: str, where: str) -> set[str]:
    match = re.match(r"#\s*needs:(.*)\n", code)
    return _needs(match[1] if match else None, where)


def blocks(page: Path) -> list[Block]:
    """The python blocks of one page, in page order."""
    lines = page.read_text().splitlines()
    found = []
    if page.suffix == ".md":
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                end = lines.index("```", i + 1)
                code = "\n".join(lines[i + 1:end]) + "\n"
                where = f"{page.name}:{i + 2}"
                comment = re.fullmatch(r"<!--\s*needs:(.*)-->", lines[i - 1].strip()) if i else None
                needs = _needs(comment[1] if comment else None, where)
                found.append(Block(page, i + 2, code, needs | _first_line_needs(code, where)))
                i = end
            i += 1
    else:
        for i, text in enumerate(lines):
            if text.strip() != ".. code-block:: python":
                continue
            indent = len(text) - len(text.lstrip()) + 3
            start = i + 1
            while start < len(lines) and not lines[start].strip():
                start += 1
            end = start
            while end < len(lines) and (not lines[end].strip()
                                        or len(lines[end]) - len(lines[end].lstrip()) >= indent):
                end += 1
            body = [line[indent:] for line in lines[start:end]]
            while body and not body[-1]:
                body.pop()
            code = "\n".join(body) + "\n"
            where = f"{page.name}:{start + 1}"
            before = i - 1
            while before >= 0 and not lines[before].strip():
                before -= 1
            comment = re.fullmatch(r"\.\. needs:(.*)", lines[before].strip()) if before >= 0 else None
            needs = _needs(comment[1] if comment else None, where)
            found.append(Block(page, start + 1, code, needs | _first_line_needs(code, where)))
    return found


def run_blocks(found: list[Block]) -> list[str]:
    """Executes the blocks in order in one namespace; returns what each printed."""
    namespace = {"__name__": "__main__"}
    printed = []
    for block in found:
        # page line numbers in tracebacks
        code = compile("\n" * (block.line - 1) + block.code, str(block.page), "exec")
        out = io.StringIO()
        start = time.perf_counter()
        try:
            with contextlib.redirect_stdout(out):
                exec(code, namespace)
        finally:
            sys.stderr.write(f"--- {block.name} ({time.perf_counter() - start:.1f} s) printed:\n"
                             f"{out.getvalue()}")
        printed.append(out.getvalue())
    return printed


if __name__ == "__main__":
    print(json.dumps(run_blocks([b for b in blocks(Path(sys.argv[1]).resolve()) if not b.needs])))
