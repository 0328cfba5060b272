"""``kdn-compile bench --ops coldstart`` without a GPU: each case in new processes on
fresh caches, its first output checked, rows printed as processes end, the time budgets."""

from __future__ import annotations

import copy
import json
import subprocess
import types

import pytest
import torch

from kdn_compile.bench import Shape
from kdn_compile.bench.timing import CheckFailed


def test_coldstart_runs_each_case_in_new_processes_on_fresh_caches(monkeypatch):
    from kdn_compile.bench import coldstart

    calls = []

    def fake_run(argv, env, **kwargs):
        calls.append((argv[-3:], env["TRITON_CACHE_DIR"], env["TORCHINDUCTOR_CACHE_DIR"]))
        error = None if argv[-2] == "FLA" else 1e-3
        out = coldstart._RESULT + json.dumps({"seconds": 2.5, "error": error})
        return types.SimpleNamespace(returncode=0, stdout=f"log line\n{out}\n", stderr="")

    monkeypatch.setattr(coldstart.subprocess, "run", fake_run)
    rows = coldstart.measure(Shape(1, 64, 2), True, cases=coldstart.CASES)
    expected = [(case, impl) for case in coldstart.CASES for impl in ("ours", "FLA")
                if impl == "ours" or case in coldstart.FLA_CASES]
    assert [(r["case"], r["impl"]) for r in rows[::2]] == expected
    assert [r["impl"] for r in rows[1::2]] == [f"{impl} cached" for _, impl in expected]
    assert all(r["ms"] == 2500.0 for r in rows)
    assert [c[0] for c in calls[:2]] == [["gdn", "ours", "1x64x2"]] * 2
    # each pair shares its caches (the second process is the cached one); pairs do not
    triton_dirs = [c[1] for c in calls]
    assert triton_dirs[0] == triton_dirs[1] != triton_dirs[2] == triton_dirs[3]
    assert all(c[2].startswith(c[1].rsplit("/", 1)[0]) for c in calls)


def test_coldstart_fails_on_a_wrong_first_output_or_a_crashed_process(monkeypatch):
    from kdn_compile.bench import coldstart

    result = {"stdout": coldstart._RESULT + json.dumps({"seconds": 1.0, "error": 0.5}),
              "returncode": 0}
    monkeypatch.setattr(coldstart.subprocess, "run", lambda argv, env, **kwargs:
                        types.SimpleNamespace(stderr="Traceback: boom", **result))
    with pytest.raises(CheckFailed, match="coldstart gdn: relative error 5.00e-01"):
        coldstart.measure(Shape(1, 64, 2), False)
    result.update(stdout="", returncode=1)
    with pytest.raises(RuntimeError, match="exit code 1:\nTraceback: boom"):
        coldstart.measure(Shape(1, 64, 2), False)


def test_coldstart_layer_reference_is_the_timed_layer_in_float64(monkeypatch):
    """The first output of a layer is checked against the same layer, its bf16 weights in
    float64 (not the float32 weights it was rounded from)."""
    from kdn_compile import layers as our_layers
    from kdn_compile.bench import coldstart, layers

    made = []

    def small_layer(name, heads):
        torch.manual_seed(0)
        made.append(our_layers.GatedDeltaNet(heads * 16, heads, 16))
        return made[-1]

    monkeypatch.setattr(layers, "our_layer", small_layer)
    monkeypatch.setattr(layers, "HEAD_DIM", 16)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    step, reference = coldstart._layer_step("gdn layer", "ours", Shape(1, 12, 2))
    y = step()
    timed = made[-1]
    assert next(timed.parameters()).dtype == torch.bfloat16
    x = torch.randn(1, 12, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    expected = copy.deepcopy(timed).double()(x.double())[0]
    assert torch.equal(reference(), expected)
    assert (y.double() - expected).norm() <= 3e-2 * expected.norm()


def test_coldstart_families_split_the_cases(monkeypatch):
    from kdn_compile.bench import coldstart, coldstart_layers

    seen = []
    monkeypatch.setattr(coldstart, "_in_new_process", lambda case, impl, shape, caches, timeout:
                        seen.append(case) or {"seconds": 1.0, "error": None})
    coldstart.measure(Shape(1, 64, 2), False)
    assert seen == [case for case in coldstart.OP_CASES for _ in range(2)]
    seen.clear()
    coldstart_layers.measure(Shape(1, 64, 2), False)
    assert seen == [case for case in coldstart.LAYER_CASES for _ in range(2)]
    assert set(coldstart.OP_CASES + coldstart.LAYER_CASES) == set(coldstart.CASES)


def test_coldstart_prints_each_row_when_its_process_ends(monkeypatch, capsys):
    from kdn_compile.bench import coldstart

    printed_before = []

    def fake_run(argv, env, **kwargs):
        printed_before.append(capsys.readouterr().out)
        out = coldstart._RESULT + json.dumps({"seconds": 2.5, "error": 1e-3})
        return types.SimpleNamespace(returncode=0, stdout=out, stderr="")

    monkeypatch.setattr(coldstart.subprocess, "run", fake_run)
    coldstart.measure(Shape(1, 64, 2), False, cases=("gdn", "kda"))
    assert "4 processes" in printed_before[0]
    assert printed_before[1] == "coldstart gdn ours 1x64x2: 2.5 s, 1.0e-03 from float64\n"
    assert printed_before[2] == "coldstart gdn ours cached 1x64x2: 2.5 s, 1.0e-03 from float64\n"
    assert printed_before[3].startswith("coldstart kda ours 1x64x2: 2.5 s")


def test_coldstart_stops_a_process_over_its_budget_and_the_run_at_its_budget(monkeypatch,
                                                                              capsys):
    from kdn_compile.bench import coldstart

    now, timeouts = [0.0], []

    def fake_run(argv, env, timeout, **kwargs):
        timeouts.append(timeout)
        seconds = float("inf") if argv[-3] == "kda" else 30.0  # kda's process never ends
        if seconds > timeout:
            now[0] += timeout
            raise subprocess.TimeoutExpired(argv, timeout)
        now[0] += seconds
        out = coldstart._RESULT + json.dumps({"seconds": seconds, "error": None})
        return types.SimpleNamespace(returncode=0, stdout=out, stderr="")

    monkeypatch.setattr(coldstart.subprocess, "run", fake_run)
    monkeypatch.setattr(coldstart, "_clock", lambda: now[0])
    monkeypatch.setattr(coldstart, "ROW_BUDGET_S", 50)
    monkeypatch.setattr(coldstart, "RUN_BUDGET_S", 200)
    rows = coldstart.measure(Shape(1, 64, 2), False, cases=coldstart.CASES)
    out = capsys.readouterr().out
    # gdn 30 + 30 s; kda stopped at 50 s, its cached run skipped; kdn 30 + 30 s; the gdn
    # layer's first process gets the 30 s left, its cached one nothing; the rest not run
    assert timeouts == [50, 50, 50, 50, 50, 30]
    assert [(r["case"], r["impl"]) for r in rows] == [
        ("gdn", "ours"), ("gdn", "ours cached"), ("kdn", "ours"), ("kdn", "ours cached"),
        ("gdn layer", "ours")]
    assert "coldstart kda ours 1x64x2: not recorded, stopped after 50 s\n" in out
    assert "kda ours cached" not in out
    assert "coldstart gdn layer ours cached 1x64x2: not recorded, the 200 s budget is spent" in out
    assert ("the 200 s budget is spent; not timed: kda layer (ours), kdn layer (ours)\n") in out
    assert now[0] == 200
