"""The quickstart runs as written, and the README and the docs show the same code."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def python_blocks(path: Path) -> list[str]:
    """The ```python blocks of a markdown file."""
    found = re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
    assert found, f"no python block in {path}"
    return found


def python_block(path: Path) -> str:
    """The first ```python block of a markdown file."""
    return python_blocks(path)[0]


def test_quickstart_runs_and_matches_the_readme():
    code = python_block(ROOT / "docs" / "quickstart.md")
    assert code == python_block(ROOT / "README.md"), "README and docs/quickstart.md differ"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    loss = float(re.fullmatch(r"loss ([\d.]+)\n", done.stdout)[1])
    assert 4.0 < loss < 6.0, done.stdout


def test_serving_example_runs():
    code = python_block(ROOT / "docs" / "serving.md")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("torch.Size([2, 1, 64]) 0.0"), done.stdout


def test_from_fla_examples_run_and_agree():
    """The FLA-style call and the port to kdn_compile's own function give the same result."""
    blocks = python_blocks(ROOT / "docs" / "from_fla.md")
    check = ("\nfla_o, fla_state = o, final_state\n" + blocks[-1]
             + "\nimport torch\ntorch.testing.assert_close(o, fla_o)"
             + "\ntorch.testing.assert_close(final_state, fla_state)\nprint('same')\n")
    done = subprocess.run([sys.executable, "-c", blocks[0] + check], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "same\n", done.stdout
