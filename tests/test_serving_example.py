"""examples/serving.py runs on the CPU: continuous batching with a prefix cache and
speculative decoding on a tiny hybrid model, whose generations it checks against plain
greedy decoding."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch


def test_serving_example_matches_plain_decoding():
    path = Path(__file__).resolve().parents[1] / "examples" / "serving.py"
    spec = importlib.util.spec_from_file_location("serving_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(["--requests", "8", "--slots", "3", "--draft", "4", "--seed", "1"])
    counts = torch.tensor(result["accepted"])
    # both ends of the acceptance: drafts rejected at once and drafts kept whole
    assert (counts == 1).any() and (counts == 4).any(), counts.tolist()
    assert len(result["generations"]) == 8 and all(result["generations"])
    assert result["hits"] == 7  # every request after the first starts from the checkpoint
