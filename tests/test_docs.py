"""Every python example of README.md and docs/ runs on the CPU and prints what it says.

The conventions of the docs' source (``# needs: ...``, ``# prints: ...``) are in
``tests/_doc_blocks.py``. Each page's blocks run in page order in one namespace, fresh for
the page, in this test process (the references on the CPU, compiled by Inductor where a
block compiles), so a block may use what an earlier block of its page defined, as a reader
working down the page would. A README block that is also a docs page's block runs there,
once. Blocks that need CUDA run in ``tests/test_docs_gpu.py`` (the GPU tier); blocks that
need torchrun are the scripts under ``examples/``, which
``tests/test_distributed_examples.py`` launches on two CPU ranks (and
``tests/test_docs_gpu.py`` on two GPUs).
"""

from __future__ import annotations

import re

import pytest
import torch

from _doc_blocks import ROOT, blocks, pages, run_blocks
from test_distributed_examples import EXAMPLES, _code

ALL = {page: blocks(page) for page in pages()}
DOCS_CODE = {b.code for page, found in ALL.items() if page.parent.name == "docs" for b in found}


def runs_here(block) -> bool:
    return not block.needs and not (block.page.name == "README.md" and block.code in DOCS_CODE)


def test_every_block_has_a_test():
    """A block either runs here, is a README copy of a docs block, needs CUDA (the GPU
    tier), or is a torchrun script under examples/ (launched by its own tests)."""
    scripts = [_code(name) for name in EXAMPLES]
    assert sum(len(found) for found in ALL.values()) >= 15
    for found in ALL.values():
        for block in found:
            if "torchrun" in block.needs:
                assert block.code in scripts, f"{block.name} is not a script of examples/"
            elif not block.needs and not runs_here(block):
                assert block.code in DOCS_CODE, block.name


def test_the_readme_quickstart_is_the_docs_quickstart():
    readme = [b.code for b in ALL[ROOT / "README.md"]]
    assert readme[0] == ALL[ROOT / "docs" / "quickstart.md"][0].code


def check_quickstart(printed):
    loss = float(re.fullmatch(r"loss ([\d.]+)\n", printed[0])[1])
    assert 4.0 < loss < 6.0, printed  # ln 128 = 4.85: untrained


def check_from_fla(printed):
    difference = re.search(r"^largest logit difference: (\S+)$", printed[1], re.M)
    assert difference and float(difference[1]) <= 1e-5, printed


# what a page's blocks print beyond their "# prints:" lines (a range, not a line)
CHECKS = {"quickstart.md": check_quickstart, "from_fla.md": check_from_fla}
PAGES = [page for page, found in ALL.items() if any(runs_here(b) for b in found)]


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_examples_run_and_print_what_they_say(page):
    torch._dynamo.reset()
    ran = [b for b in ALL[page] if runs_here(b)]
    printed = run_blocks(ran)
    for block, out in zip(ran, printed):
        lines = out.splitlines()
        position = 0
        for claim in block.claims:
            assert claim in lines[position:], f"{block.name} should print {claim!r}, printed:\n{out}"
            position = lines.index(claim, position) + 1
    if page.name in CHECKS:
        CHECKS[page.name](printed)
