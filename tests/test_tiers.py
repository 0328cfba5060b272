"""The test tiers themselves (tests/conftest.py, ./dev.sh gpu): markers, the CUDA skip, the
full tier's groups, seeds printed and replayed, global switches restored.

Each case runs pytest on a folder holding copies of the suite's conftest and helpers and a
small test file: several times in one child process (:data:`DRIVER`, one import of torch).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

PROBE = '''
import pytest
import torch
from _helpers import gpu, kernels, slow


@gpu
def test_needs_cuda():
    assert torch.cuda.is_available()


@kernels
def test_kernels_anywhere():
    from _helpers import interpreting
    assert torch.cuda.is_available() or interpreting()


@gpu
@slow
def test_full_tier_only():
    pass


def test_fails_with_its_seed(seed):
    assert seed < 0


def test_changes_a_switch():
    torch.backends.cuda.matmul.allow_tf32 = not torch.backends.cuda.matmul.allow_tf32


def test_sees_the_switch_as_it_was():
    assert torch.backends.cuda.matmul.allow_tf32 == ALLOW_TF32
'''


# argv[1]: a JSON list of [pytest arguments, environment]; pytest runs in this process once
# for each, its environment set meanwhile, and a last line "RESULTS [[exit code, output], ...]".
DRIVER = '''
import contextlib, io, json, os, sys
import pytest

results = []
for args, env in json.loads(sys.argv[1]):
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        code = pytest.main(args)
    for name, value in before.items():
        if value is None:
            os.environ.pop(name)
        else:
            os.environ[name] = value
    results.append([int(code), output.getvalue()])
print("RESULTS " + json.dumps(results))
'''


def _suite(tmp_path: Path, file_name: str) -> Path:
    for name in ("conftest.py", "_helpers.py", "_bounds.py", "_interpreter.py"):
        shutil.copy(TESTS / name, tmp_path / name)
    source = f"ALLOW_TF32 = {torch.backends.cuda.matmul.allow_tf32}\n" + PROBE
    (tmp_path / file_name).write_text(source)
    return tmp_path


def _pytest(folder: Path, *runs: tuple) -> list:
    """``[(exit code, output)]`` of ``pytest ARGS`` on ``folder`` for each ``(ARGS,
    environment)`` of ``runs``, in one child process."""
    environ = dict(os.environ, PYTHONPATH=str(ROOT))
    environ.pop("PYTEST_XDIST_WORKER", None)
    runs = [[["-p", "no:cacheprovider", "-rA", str(folder), *args], env] for args, env in runs]
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(runs)], cwd=folder,
                          env=environ, capture_output=True, text=True, timeout=600)
    last = done.stdout.rstrip().rpartition("\n")[2]
    assert done.returncode == 0 and last.startswith("RESULTS "), done.stdout + done.stderr
    return [tuple(result) for result in json.loads(last[len("RESULTS "):])]


def _outcomes(output: str) -> dict:
    return dict((name, state) for state, name in
                re.findall(r"^(PASSED|FAILED|SKIPPED|ERROR)\S* .*?::(test_\w+)", output, re.M))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU side of the tiers")
def test_markers_skip_and_seed(tmp_path):
    folder = _suite(tmp_path, "test_probe.py")
    (_, output), (_, replayed), (code, refused) = _pytest(
        folder, ((), {}), (("-k", "seed"), {"KDN_TEST_SEED": "12345"}),
        (("-k", "seed"), {"KDN_TEST_SEED": "abc"}))
    found = _outcomes(output)
    assert found.get("test_kernels_anywhere") == "PASSED", output[-3000:]
    assert found.get("test_sees_the_switch_as_it_was") == "PASSED", output[-3000:]
    assert found.get("test_fails_with_its_seed") == "FAILED", output[-3000:]
    assert "needs CUDA" in output, output[-3000:]
    seed = re.search(r"seed (\d+); replay: KDN_TEST_SEED=(\d+) pytest", output)
    assert seed and seed.group(1) == seed.group(2), output[-3000:]
    assert "seed 12345; replay: KDN_TEST_SEED=12345" in replayed, replayed[-3000:]
    assert code != 0 and "KDN_TEST_SEED must be a non-negative integer" in refused


def test_tiers_select_by_marker_and_group(tmp_path):
    folder = _suite(tmp_path, "test_decode_gpu.py")  # a file of the kernels group
    (_, smoke), (_, group), (_, other) = _pytest(
        folder, *((("--co", "-q", "-m", m), {}) for m in
                  ("gpu and not slow", "gpu and kernels", "gpu and capture")))
    assert "test_needs_cuda" in smoke and "test_kernels_anywhere" in smoke, smoke[-2000:]
    assert "test_full_tier_only" not in smoke and "test_fails_with_its_seed" not in smoke
    assert "test_full_tier_only" in group, group[-2000:]
    assert "test_needs_cuda" not in other, other[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without CUDA")
def test_dev_sh_gpu_needs_cuda():
    done = subprocess.run(["bash", str(ROOT / "dev.sh"), "gpu", "smoke"], cwd=ROOT,
                          env=dict(os.environ, PYTHON=sys.executable), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no torch with a CUDA device" in done.stderr
    done = subprocess.run(["bash", str(ROOT / "dev.sh"), "gpu", "nightly"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "unknown tier 'nightly'" in done.stderr
