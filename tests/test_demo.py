"""The command line: ``kdn-compile demo`` end to end (tiny) and ``kdn-compile check``."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

import kdn_compile
from kdn_compile import capture_report, demo
from kdn_compile.__main__ import main


def test_corpus_is_deterministic_python_source():
    text = demo.load_corpus(50_000)
    assert len(text) == 50_000 and text == demo.load_corpus(50_000)
    assert "def " in text and "import " in text
    ids = demo.encode(text)
    assert ids.max() < len(demo.VOCAB) and demo.decode(ids[:200].tolist()) == text[:200]


def test_demo_end_to_end():
    # the default path (torch.compile with Inductor) at a tiny size, in a fresh process
    result = subprocess.run(
        [sys.executable, "-m", "kdn_compile", "demo", "--steps", "3", "--batch", "2",
         "--length", "32", "--dim", "32", "--device", "cpu"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "graph breaks: 0 " in out and "recompiles: 0" in out, out
    # stdout is a pipe here: plain progress lines, no carriage-return redraws
    assert "train step 3/3: loss " in out and "\r" not in out, out
    # the first compile, the longest wait, is announced before it starts
    assert 0 <= out.find("compiling the model (first step") < out.find("train step "), out
    assert 0 <= out.find("compiling the decode step") < out.find("generation with step"), out
    losses = re.search(r"held-out batch: ([\d.]+) before, ([\d.]+) after", out)
    assert losses and float(losses[2]) < float(losses[1]), out
    assert re.search(r"prefill 24 \+ decode 8 tokens vs one pass: .*\(ok\)", out), out
    assert re.search(r"torch\.export .*kdn\.chunk_gdn.*\(ok\)", out), out
    assert re.search(r"generation with step over slot caches \(8 greedy tokens\): eager [\d,]+ "
                     r"tok/s, compiled \(default\) [\d,]+ tok/s", out), out
    sample = out.split("200 characters sampled after 'def __init__(self':\n")[1]
    assert sample.startswith(demo.PROMPT) and len(sample) >= len(demo.PROMPT) + 200, out


def test_demo_other_layers_eager_in_process(capsys):
    for layer, op in (("kda", "kdn.chunk_kda"), ("kdn", "kdn.diag_kdn")):
        main(["demo", "--layer", layer, "--steps", "2", "--batch", "2", "--length", "16",
              "--dim", "16", "--no-compile", "--device", "cpu"])
        out = capsys.readouterr().out
        assert "MISMATCH" not in out and out.count("(ok)") == 2, out
        assert f"ops: {op}" in out and "compiling" not in out, out


def test_demo_quantization_aware_training_in_process(capsys):
    """``--state-qdq``: GDN layers with FP8 state QDQ and the fake quantizer of W train under
    torch.compile(fullgraph=True) without a graph break; the checks after run unquantized."""
    main(["demo", "--state-qdq", "--steps", "2", "--batch", "2", "--length", "16", "--dim",
          "16", "--compile-backend", "aot_eager", "--device", "cpu", "--generate", "2"])
    out = capsys.readouterr().out
    assert "quantization-aware: FP8 state QDQ and fp8_row_qdq on W" in out, out
    assert "graph breaks: 0 " in out and "recompiles: 0" in out, out
    assert "MISMATCH" not in out and out.count("(ok)") == 2, out
    with pytest.raises(SystemExit, match="--state-qdq trains GDN layers"):
        main(["demo", "--state-qdq", "--layer", "kda", "--device", "cpu"])


def test_check_reports_every_op(capsys):
    assert main(["check", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for name in capture_report.CASES:
        row = next(line for line in out.splitlines() if line.startswith(name + " "))
        assert "FAIL" not in row and row.count("ok") == 4, row


def test_check_flags_a_wrong_op(monkeypatch):
    broken = lambda **x: tuple(t + 1e-2 for t in kdn_compile.chunk_gdn(**x))  # noqa: E731
    cases = capture_report.CASES
    monkeypatch.setitem(cases, "chunk_gdn", (broken, *cases["chunk_gdn"][1:]))
    row = capture_report.check_op("chunk_gdn", torch.device("cpu"))
    assert row["vs_reference"].startswith("FAIL") and row["failures"], row


@pytest.mark.parametrize("argv,usage,message", [
    (["demo", "--steps", "-3"], "kdn-compile demo", "argument --steps: must be >= 1, got -3"),
    (["demo", "--batch", "x"], "kdn-compile demo", "expected an integer, got 'x'"),
    (["demo", "--length", "8"], "kdn-compile demo", "argument --length: must be >= 9, got 8"),
    (["bench", "--opz", "gdn"], "kdn-compile bench", "unrecognized arguments: --opz gdn"),
    (["check", "--device", "nonsense"], "kdn-compile check", "--device:"),
])
def test_command_line_errors_show_the_subcommand_usage(argv, usage, message, capsys):
    """Bad arguments exit with status 2, the subcommand's usage and a message naming the
    argument (never a run that does nothing and exits 0)."""
    from kdn_compile.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert f"usage: {usage} " in err and f"{usage}: error: " in err and message in err, err
