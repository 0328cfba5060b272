"""The examples of docs/distributed.md: each page block is its script under examples/, and
each script runs as printed, ``python -m torch.distributed.run --nproc-per-node 2``, with gloo
on the CPU, its rank 0 reporting the parallel result within float32 rounding of one process's."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ["tensor_parallel", "context_parallel"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _code(name: str) -> str:
    """The script without its module docstring."""
    return (ROOT / "examples" / f"{name}.py").read_text().split('"""\n', 1)[1].lstrip("\n")


def test_the_page_shows_the_scripts_and_their_launch_lines():
    page = (ROOT / "docs" / "distributed.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    assert blocks == [_code(name) for name in EXAMPLES]
    assert "```text\nimport" not in page
    for name in EXAMPLES:
        assert (f"```bash\npython -m torch.distributed.run --nproc-per-node 2 "
                f"examples/{name}.py\n```") in page


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs_on_two_cpu_ranks(name):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
         f"examples/{name}.py"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.findall(r"^max difference to one process: (\S+)$", done.stdout, re.M)
    assert len(found) == 1, done.stdout  # rank 0 only
    assert float(found[0]) < 1e-5, done.stdout
