"""The docs' examples that need CUDA or a multi-process launch, in the GPU tier.

A ``needs: cuda`` block runs alone in a fresh interpreter and must print its
``# prints:`` lines; a ``needs: torchrun`` block (a script of ``examples/``) is launched on
two ranks, one GPU each. Conventions: ``tests/_doc_blocks.py``; the CPU side:
``tests/test_docs.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from _doc_blocks import ROOT, blocks, pages

pytestmark = pytest.mark.gpu

ALL = [b for page in pages() for b in blocks(page)]
CUDA_BLOCKS = [b for b in ALL if "cuda" in b.needs and "torchrun" not in b.needs]
TORCHRUN_BLOCKS = [b for b in ALL if "torchrun" in b.needs]


def check_claims(block, out: str) -> None:
    lines = out.splitlines()
    for claim in block.claims:
        assert claim in lines, f"{block.name} should print {claim!r}, printed:\n{out}"


@pytest.mark.parametrize("block", CUDA_BLOCKS, ids=[b.name for b in CUDA_BLOCKS])
def test_cuda_example_runs(block, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(block.code)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert done.returncode == 0, f"{block.name}:\n{done.stderr[-3000:]}"
    check_claims(block, done.stdout)


@pytest.mark.parametrize("block", TORCHRUN_BLOCKS, ids=[b.name for b in TORCHRUN_BLOCKS])
def test_torchrun_example_runs_on_two_gpus(block, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (tests/test_distributed_examples.py runs it on CPU ranks)")
    script = tmp_path / "example.py"
    script.write_text(block.code)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(script)], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path, env=env)
    assert done.returncode == 0, f"{block.name}:\n{done.stderr[-3000:]}"
    check_claims(block, done.stdout)
