"""``kdn-compile bench`` without a GPU: arguments, refusals, tables, JSON and plots."""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import subprocess
import sys
import types

import pytest
import torch

from kdn_compile.__main__ import main
from kdn_compile.bench import DEFAULT_OPS, FAMILIES, Shape, cli, parse_shapes, report, timing
from kdn_compile.bench.timing import CheckFailed, require_close

META = {"gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "fla": "fla-core 0.6.0",
        "commit": "abc1234", "time": "2026-12-01T03:30:00+00:00"}


def fake_rows():
    rows = []
    for length, batch, ours, fla in ((4096, 8, 2.0, 2.5), (32768, 1, 3.0, 2.0), (8192, 8, 4.0, 5.0)):
        for impl, ms in (("ours", ours), ("FLA", fla)):
            rows.append({"family": "kda", "case": "fwd", "impl": impl, "ms": ms,
                         "batch": batch, "length": length, "heads": 16})
    rows.append({"family": "kda", "case": "fwd+bwd", "impl": "ours", "ms": 7.0,
                 "peak_mib": 1185.4, "batch": 8, "length": 4096, "heads": 16})
    return rows


def parser():
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p


def test_shapes_parse_and_reject():
    assert parse_shapes("8x4096x16, 1X32768x16") == [Shape(8, 4096, 16), Shape(1, 32768, 16)]
    assert str(Shape(8, 4096, 16)) == "8x4096x16"
    for bad in ("8x4096", "8x4096x0", "8x4096x16x2", "axbxc", ""):
        with pytest.raises(ValueError, match="BxTxH"):
            parse_shapes(bad)


def test_arguments_defaults_and_errors(capsys):
    args = parser().parse_args([])
    assert args.ops == list(DEFAULT_OPS) and args.shapes is None and args.against is None
    args = parser().parse_args(["--ops", "gdn,layers", "--shapes", "2x64x4", "--against", "fla",
                                "--out", "x"])
    assert args.ops == ["gdn", "layers"] and args.shapes == [Shape(2, 64, 4)]
    assert cli.reproducing_command(args) == (
        "kdn-compile bench --ops gdn,layers --shapes 2x64x4 --against fla")
    for bad in (["--ops", "gdn,nope"], ["--shapes", "8x4096"], ["--against", "flash"]):
        with pytest.raises(SystemExit) as exit_info:
            parser().parse_args(bad)
        assert exit_info.value.code == 2
    assert "unknown op family nope" in capsys.readouterr().err


def test_refuses_without_cuda(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--out", str(tmp_path)]) == cli.NO_CUDA
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_against_fla_refused_when_fla_is_missing(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    args = parser().parse_args(["--against", "fla"])
    assert cli.run(args) == cli.NO_CUDA
    assert "--against fla needs flash-linear-attention" in capsys.readouterr().err


def test_every_family_has_the_interface():
    for name, module in FAMILIES.items():
        family = importlib.import_module(module)
        assert isinstance(family.TITLE, str) and family.TITLE, name
        assert family.DEFAULT_SHAPES and all(isinstance(s, Shape) for s in family.DEFAULT_SHAPES)
        assert callable(family.check) and callable(family.measure), name


def test_table_has_ratio_peaks_and_gaps():
    lines = report.table(fake_rows()).splitlines()
    assert lines[0] == ("| case | B x T x H | ours ms | FLA ms | ours / FLA | ours peak MiB |")
    assert lines[2] == "| fwd | 8x4096x16 | 2.000 | 2.500 | 0.80 | - |"
    assert lines[3] == "| fwd | 1x32768x16 | 3.000 | 2.000 | 1.50 | - |"
    assert lines[-1] == "| fwd+bwd | 8x4096x16 | 7.000 | - | - | 1185 |"


def test_table_counts_graph_breaks():
    rows = [{"case": "train step", "impl": impl, "ms": ms, "graph_breaks": breaks,
             "batch": 2, "length": 4096, "heads": 16}
            for impl, ms, breaks in (("ours", 3.0, 0), ("FLA", 4.0, 6))]
    lines = report.table(rows).splitlines()
    assert lines[0].endswith("| ours graph breaks | FLA graph breaks |")
    assert lines[2] == "| train step | 2x4096x16 | 3.000 | 4.000 | 0.75 | 0 | 6 |"


def test_table_divides_by_the_named_implementation():
    rows = [{"family": "qat", "case": "fwd+bwd", "impl": impl, "ms": ms, "peak_mib": mib,
             "batch": 8, "length": 4096, "heads": 16, **extra}
            for impl, ms, mib, extra in (("plain", 4.0, 900.0, {}),
                                         ("state_qdq", 3.0, 800.0, {"versus": "plain"}))]
    lines = report.table(rows).splitlines()
    assert lines[0] == ("| case | B x T x H | plain ms | state_qdq ms | state_qdq / plain | "
                        "plain peak MiB | state_qdq peak MiB |")
    assert lines[2] == "| fwd+bwd | 8x4096x16 | 4.000 | 3.000 | 0.75 | 900 | 800 |"


def test_write_json_rows_and_markdown(tmp_path):
    paths = report.write(str(tmp_path / "out"), [("KDA", fake_rows())], META, "kdn-compile bench")
    rows = json.loads((tmp_path / "out" / "rows.json").read_text())
    assert len(rows) == len(fake_rows()) and all(r["gpu"] == "NVIDIA H200" for r in rows)
    assert {"commit", "time", "torch", "triton", "fla", "ms", "batch"} <= set(rows[0])
    text = (tmp_path / "out" / "results.md").read_text()
    assert "NVIDIA H200, torch 2.11.0" in text and "commit abc1234" in text
    assert "### KDA\n\n| case |" in text and "`kdn-compile bench`" in text
    assert [p.rsplit("/", 1)[1] for p in paths] == ["rows.json", "results.md"]


def test_plots_skipped_without_matplotlib(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert report.plot(str(tmp_path), "kda", fake_rows()) == []
    assert "matplotlib is not installed" in capsys.readouterr().out


def test_plot_series_need_two_points():
    by_length = report._series(fake_rows(), "batch", "length")
    assert by_length == {("fwd", "ours", 8): [(4096, 2.0), (8192, 4.0)],
                         ("fwd", "FLA", 8): [(4096, 2.5), (8192, 5.0)]}
    assert report._series(fake_rows(), "length", "batch") == {}


def test_require_close_names_what_failed():
    assert require_close({"o": 1e-3}, 1e-2, "gdn") == {"o": 1e-3}
    with pytest.raises(CheckFailed, match=r"gdn: .* dq 5\.00e-02, dk nan"):
        require_close({"o": 1e-3, "dq": 5e-2, "dk": float("nan")}, 1e-2, "gdn")


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


def test_a_check_failing_while_measuring_stops_only_that_family(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("kdn_compile.bench.timing.run_metadata", lambda: META)

    def failing(shape, against):
        raise CheckFailed("coldstart gdn: relative error 5.00e-01 above 0.03")

    monkeypatch.setattr("kdn_compile.bench.coldstart.measure", failing)
    args = parser().parse_args(["--ops", "coldstart", "--out", str(tmp_path)])
    assert cli.run(args) == 1
    assert "coldstart: CHECK FAILED: coldstart gdn" in capsys.readouterr().out


def _event(name, us, device=torch.autograd.DeviceType.CUDA):
    return types.SimpleNamespace(name=name, device_type=device,
                                 time_range=types.SimpleNamespace(elapsed_us=lambda: us))


def test_kernel_times_group_device_events_per_step():
    events = [_event("fwd", 100.0), _event("bwd", 300.0), _event("fwd", 120.0),
              _event("bwd", 280.0), _event("aten::mm", 999.0, torch.autograd.DeviceType.CPU)]
    kernels = timing.summarize_kernels(events, steps=2)
    assert kernels == [{"kernel": "bwd", "calls": 1.0, "ms": 0.29},
                       {"kernel": "fwd", "calls": 1.0, "ms": 0.11}]


def test_kernel_table_shows_the_slowest_then_the_rest_and_the_total():
    kernels = [{"kernel": f"k{i}", "calls": 1.0, "ms": float(10 - i)} for i in range(4)]
    lines = report.kernel_table(kernels, top=2).splitlines()
    assert lines[2] == "| `k0` | 1 | 10.000 | 29% |"
    assert lines[4] == "| (2 others) | 2 | 15.000 | 44% |"
    assert lines[5] == "| total | 4 | 34.000 | 100% |"
    long = report.kernel_table([{"kernel": "x" * 200, "calls": 2.0, "ms": 1.0}])
    assert "`" + "x" * 77 + "...`" in long


def test_profile_option_writes_each_families_kernels(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(timing, "run_metadata", lambda: META)
    family = importlib.import_module(FAMILIES["gdn"])
    monkeypatch.setattr(family, "check", lambda fla: {"o": 1e-3})
    monkeypatch.setattr(family, "measure", lambda shape, fla: [
        {"case": "fwd", "impl": "ours", "ms": 1.0}])
    monkeypatch.setattr(family, "profile_steps", lambda shape, fla: {"ours": None, "FLA": None})
    monkeypatch.setattr(timing, "kernel_times", lambda step: [
        {"kernel": "_chunk_gdn_fwd_kernel", "calls": 1.0, "ms": 0.5}])
    args = parser().parse_args(["--ops", "gdn", "--shapes", "2x64x4", "--profile",
                                "--out", str(tmp_path)])
    assert cli.reproducing_command(args).endswith("--shapes 2x64x4 --profile")
    assert cli.run(args) == 0
    text = (tmp_path / "profile.md").read_text()
    assert text.count("| `_chunk_gdn_fwd_kernel` | 1 | 0.500 | 100% |") == 2
    assert f"### {family.TITLE}: FLA, 2x64x4" in text
    assert "by kernel (torch.profiler)" in text
    assert "ours, 2x64x4, GPU time per forward+backward by kernel" in capsys.readouterr().out


def test_families_that_profile_return_steps_by_implementation():
    profiled = [n for n, m in FAMILIES.items()
                if hasattr(importlib.import_module(m), "profile_steps")]
    assert profiled == ["gdn", "kda", "kdn", "layers", "qat"]


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


def _git(folder, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=folder, check=True, capture_output=True, text=True).stdout.strip()


def _package_copy(folder):
    package = folder / "kdn_compile"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("x = 1\n")
    return package


def test_source_commit_is_the_checkout_holding_the_package(tmp_path):
    assert timing.source_commit(str(_package_copy(tmp_path / "plain"))) == "unknown"
    repo = tmp_path / "repo"
    package = _package_copy(repo / "src")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "a")
    clean = timing.source_commit(str(package))
    assert clean == _git(repo, "rev-parse", "--short", "HEAD") and "+" not in clean
    (package / "__init__.py").write_text("x = 2\n")
    assert timing.source_commit(str(package)) == clean + "+dirty"


def test_source_commit_ignores_a_repository_around_an_untracked_copy(tmp_path, monkeypatch):
    """A copy unpacked inside another repository (tracked files of its own, the copy
    untracked or ignored) is not that repository's code."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "README").write_text("another project\n")
    _git(other, "init", "-q")
    _git(other, "add", ".")
    _git(other, "commit", "-q", "-m", "other")
    package = _package_copy(other / "vendor" / "kdn-compile-0.1.0")
    assert timing.source_commit(str(package)) == "unknown"

    def distribution(name):
        assert name == "kdn-compile"
        return types.SimpleNamespace(version="0.1.0", locate_file=lambda p: located / p)

    monkeypatch.setattr(timing.importlib.metadata, "distribution", distribution)
    located = package.parent  # the installed distribution is this copy
    assert timing.source_commit(str(package)) == "unknown (kdn-compile 0.1.0)"
    located = tmp_path / "site-packages"  # another copy is installed: its version says nothing
    assert timing.source_commit(str(package)) == "unknown"


def test_run_metadata_names_the_imported_packages_commit(monkeypatch):
    import os

    import kdn_compile

    asked = []
    monkeypatch.setattr(timing, "source_commit", lambda folder: asked.append(folder) or "abc")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    meta = timing.run_metadata()
    assert meta["commit"] == "abc" and meta["gpu"] == "NVIDIA H200"
    assert asked == [os.path.dirname(os.path.abspath(kdn_compile.__file__))]


PAGE = """# Benchmarks

| case | B x T x H | ours ms |
|---|---|---|
| fwd | 8x4096x16 | 9.000 |

## GDN: `chunk_gdn` against FLA

| case | B x T x H | ours ms | FLA ms | ours / FLA |
|---|---|---|---|---|
| fwd | 8x4096x16 | 0.821 | 0.943 | 0.87 |
| fwd+bwd | 8x4096x16 | 4.537 | - | - |

## Quantization-aware training

| case | B x T x H | plain ms |
|:---|---:|---|
| fwd+bwd | 8x4096x16 | 4.5 |
"""


def test_recorded_tables_parse_by_section_case_shape_and_column():
    from kdn_compile.bench import recorded

    rows = recorded.parse_tables(PAGE)
    assert [r["section"] for r in rows] == ["", "GDN: `chunk_gdn` against FLA",
                                           "GDN: `chunk_gdn` against FLA",
                                           "Quantization-aware training"]
    assert rows[1] == {"section": "GDN: `chunk_gdn` against FLA", "case": "fwd",
                       "B x T x H": "8x4096x16", "ours ms": "0.821", "FLA ms": "0.943",
                       "ours / FLA": "0.87"}
    assert recorded.recorded_ms(rows, "GDN:", "fwd", "8x4096x16", "ours ms") == 0.821
    assert recorded.recorded_ms(rows, "GDN:", "fwd+bwd", "8x4096x16", "ours ms") == 4.537
    assert recorded.recorded_ms(rows, "GDN:", "fwd+bwd", "8x4096x16", "FLA ms") is None  # "-"
    assert recorded.recorded_ms(rows, "GDN:", "fwd", "1x4096x16", "ours ms") is None
    assert recorded.recorded_ms(rows, "GDN:", "fwd", "8x4096x16", "chunk_kda ms") is None
    assert recorded.recorded_ms(rows, "KDA:", "fwd", "8x4096x16", "ours ms") is None
    assert recorded.recorded_ms(rows, "Quant", "fwd+bwd", "8x4096x16", "plain ms") == 4.5


def test_the_benchmarks_page_has_every_row_quick_compares_on_each_gpu_it_records():
    from kdn_compile.bench import quick, recorded

    page = recorded.read_page(recorded.default_page())
    assert page, recorded.default_page()
    gpus = {recorded.TABLES_GPU} | {r["GPU"] for r in page
                                    if r["section"] == recorded.GUARD_SECTION}
    assert len(gpus) > 1  # the family tables' GPU and at least one other
    for gpu in gpus:
        for case in quick.CASES:
            cases = (("GDN f32 pool", "KDA f32 pool") if case.family == "decode"
                     else ("fwd", "fwd+bwd"))
            for name in cases:
                for impl in (*case.judged, *case.judged.values()):
                    ms = recorded.recorded_for(page, gpu, case.section, case.family, name,
                                               str(case.shape), impl)
                    assert ms is not None and ms > 0, (gpu, case.family, name, impl)
    assert recorded.read_page(recorded.default_page() + ".missing") is None


GUARD_PAGE = PAGE + f"""
## {{section}}

| GPU | case | B x T x H | impl | ms | commit | date |
|---|---|---|---|---|---|---|
| NVIDIA H100 80GB HBM3 | gdn fwd | 8x4096x16 | ours | 0.900 | `abc1234` | 2026-12-01 |
| NVIDIA H100 80GB HBM3 | gdn fwd+bwd | 8x4096x16 | FLA | 4.400 | `abc1234` | 2026-12-01 |
"""


def test_recorded_times_are_only_ever_the_same_gpus():
    from kdn_compile.bench import recorded

    rows = recorded.parse_tables(GUARD_PAGE.format(section=recorded.GUARD_SECTION))
    h100, h200 = "NVIDIA H100 80GB HBM3", recorded.TABLES_GPU
    assert recorded.recorded_for(rows, h100, "GDN:", "gdn", "fwd", "8x4096x16", "ours") == 0.9
    assert recorded.recorded_for(rows, h100, "GDN:", "gdn", "fwd+bwd", "8x4096x16",
                                 "FLA") == 4.4
    # the family tables are the H200's: never an H100's fallback
    assert recorded.recorded_for(rows, h100, "GDN:", "gdn", "fwd+bwd", "8x4096x16",
                                 "ours") is None
    assert recorded.recorded_for(rows, h200, "GDN:", "gdn", "fwd", "8x4096x16", "ours") == 0.821
    assert recorded.recorded_for(rows, "NVIDIA A100", "GDN:", "gdn", "fwd", "8x4096x16",
                                 "ours") is None
    assert recorded.has_rows_for(rows, h100) and recorded.has_rows_for(rows, h200)
    assert not recorded.has_rows_for(rows, "NVIDIA A100")
    row = {**META, "gpu": h100, "family": "gdn", "case": "fwd", "batch": 8, "length": 4096,
           "heads": 16, "impl": "ours", "ms": 0.9}
    line = recorded.guard_row(row)
    assert line == ("| NVIDIA H100 80GB HBM3 | gdn fwd | 8x4096x16 | ours | 0.900 | `abc1234` "
                    "| 2026-12-01 |")
    # a recorded line reads back as the same time
    back = recorded.parse_tables(f"## {recorded.GUARD_SECTION}\n\n| "
                                 + " | ".join(recorded.GUARD_HEADER) + " |\n|---|\n" + line)
    assert recorded.guard_ms(back, h100, "gdn fwd", "8x4096x16", "ours") == 0.9


def test_verdict_is_slower_only_more_than_five_percent_above_the_recorded_time():
    from kdn_compile.bench import recorded

    assert recorded.TOLERANCE == 0.05
    assert recorded.verdict(4.0 * 1.049, 4.0) == "ok"
    assert recorded.verdict(4.0 * 1.051, 4.0) == "SLOWER"
    assert recorded.verdict(4.0 * 0.949, 4.0) == "ok"  # faster is never a failure
    assert recorded.verdict(4.0 * 0.5, 4.0) == "ok"
    assert recorded.verdict(4.0, None) == "no recorded row"
    assert recorded.verdict(4.0 * 1.09, 4.0, tolerance=0.1) == "ok"
    assert recorded.change(4.2, 4.0) == pytest.approx(0.05)
    assert recorded.change(4.2, None) is None


def test_quick_refuses_without_cuda(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--quick", "--out", str(tmp_path)]) == cli.NO_CUDA
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_quick_takes_no_family_options(capsys, tmp_path):
    for extra in (["--ops", "gdn"], ["--shapes", "2x64x4"], ["--profile"]):
        assert main(["bench", "--quick", *extra, "--out", str(tmp_path)]) == cli.USAGE
        assert "--quick times its own cases" in capsys.readouterr().err
    args = parser().parse_args(["--quick", "--against", "fla"])
    assert cli.reproducing_command(args) == "kdn-compile bench --quick --against fla"


def _fake_quick(monkeypatch, capsys, slower: str | None = None, fla: bool = True,
                gpu: str = META["gpu"]):
    """Runs quick.measure's rows at the times recorded on ``gpu`` (``slower``: that family's
    ours fwd+bwd 10% above), checking that each row was printed before the next is
    measured."""
    from kdn_compile.bench import quick, recorded

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(timing, "run_metadata", lambda: {**META, "gpu": gpu})
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if fla else None)
    page = recorded.read_page(recorded.default_page())
    lines = []

    def measure(case, against_fla, on_row):
        names = ("GDN f32 pool", "KDA f32 pool") if case.family == "decode" else ("fwd", "fwd+bwd")
        impls = [*case.judged, *(case.judged.values() if against_fla or case.family == "kdn"
                                 else ())]
        for impl in impls:
            for name in names:
                ms = recorded.recorded_for(page, gpu, case.section, case.family, name,
                                           str(case.shape), impl) or 1.0
                if case.family == slower and impl in case.judged and name == "fwd+bwd":
                    ms *= 1.10
                on_row({"case": name, "impl": impl, "ms": ms})
                lines.append(capsys.readouterr().out)
        return []

    monkeypatch.setattr(quick, "measure", measure)
    return lines


def test_quick_prints_rows_as_measured_and_passes_at_the_recorded_times(monkeypatch, capsys,
                                                                        tmp_path):
    lines = _fake_quick(monkeypatch, capsys)
    assert main(["bench", "--quick", "--out", str(tmp_path)]) == 0
    printed = [text.splitlines()[-1] for text in lines]  # the last line: the row just measured
    assert len(printed) == 16 and lines[1] == printed[1] + "\n"
    assert printed[0].startswith("gdn fwd 8x4096x16 ours: ") and printed[0].endswith("(+0.0%): ok")
    assert printed[3].startswith("gdn fwd+bwd 8x4096x16 FLA: ") and printed[3].endswith("(+0.0%)")
    assert printed[-1].startswith("decode KDA f32 pool 256x1x32 FLA graph: ")
    out = capsys.readouterr().out
    assert "quick: 8 of 8 cases ok" in out
    assert "| kdn fwd+bwd | 8x4096x16 | ours |" in out
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert {r["family"] for r in rows} == {"gdn", "kda", "kdn", "decode"}
    judged = [r for r in rows if "verdict" in r]
    assert len(judged) == 8 and all(r["verdict"] == "ok" for r in judged)
    assert all(r["recorded_ms"] == r["ms"] for r in rows)
    text = (tmp_path / "results.md").read_text()
    assert "`kdn-compile bench --quick`" in text and "### Against " in text


def test_quick_exits_non_zero_when_a_case_is_slower(monkeypatch, capsys, tmp_path):
    from kdn_compile.bench import quick

    lines = _fake_quick(monkeypatch, capsys, slower="kda", fla=False)
    assert main(["bench", "--quick", "--out", str(tmp_path)]) == quick.SLOWER_EXIT
    assert any(text.splitlines()[-1].startswith("kda fwd+bwd 8x4096x16 ours: ")
               and text.endswith("(+10.0%): SLOWER\n") for text in lines)
    out = capsys.readouterr().out
    assert "quick: FLA is not installed" in lines[0]
    assert "quick: SLOWER than recorded: kda fwd+bwd 8x4096x16 ours (+10.0%)" in out


def test_quick_without_a_recorded_page_says_so_and_passes(monkeypatch, capsys, tmp_path):
    lines = _fake_quick(monkeypatch, capsys, slower="gdn")
    missing = str(tmp_path / "nowhere.md")
    monkeypatch.setattr("kdn_compile.bench.recorded.read_page", lambda path: None
                        if path == missing else pytest.fail(path))
    assert main(["bench", "--quick", "--recorded", missing, "--out", str(tmp_path)]) == 0
    out = "".join(lines) + capsys.readouterr().out
    assert f"quick: {missing} does not exist (--recorded PATH): no recorded rows" in out
    assert "gdn fwd+bwd 8x4096x16 ours: " in out and ", no recorded row\n" in out
    assert "quick: 0 of 8 cases ok, 8 with no recorded row" in out


def test_quick_compares_another_gpu_with_its_own_rows(monkeypatch, capsys, tmp_path):
    from kdn_compile.bench import quick

    lines = _fake_quick(monkeypatch, capsys, slower="gdn", gpu="NVIDIA H100 80GB HBM3")
    assert main(["bench", "--quick", "--out", str(tmp_path)]) == quick.SLOWER_EXIT
    out = "".join(lines) + capsys.readouterr().out
    assert "records on NVIDIA H100 80GB HBM3" in out
    assert "quick: SLOWER than recorded: gdn fwd+bwd 8x4096x16 ours (+10.0%)" in out
    assert "no recorded row" not in out


def test_quick_on_a_gpu_without_rows_gives_no_verdicts_and_the_lines_to_record(
        monkeypatch, capsys, tmp_path):
    from kdn_compile.bench import recorded

    lines = _fake_quick(monkeypatch, capsys, slower="gdn", gpu="NVIDIA A100-SXM4-80GB")
    assert main(["bench", "--quick", "--out", str(tmp_path)]) == 0
    out = "".join(lines) + capsys.readouterr().out
    assert "records no rows on NVIDIA A100-SXM4-80GB: no verdicts" in out
    assert "quick: 0 of 8 cases ok, 8 with no recorded row" in out
    text = (tmp_path / "results.md").read_text()
    assert f"### Lines for `{recorded.GUARD_SECTION}`" in text
    assert "| NVIDIA A100-SXM4-80GB | gdn fwd+bwd | 8x4096x16 | ours | 1.100 | `abc1234` | " \
           "2026-12-01 |" in text


def test_quick_calls_each_family_as_it_is_defined(monkeypatch):
    import inspect

    from kdn_compile.bench import decode, gdn, kda, kdn, quick

    bound = []
    for module, name in ((gdn, "measure"), (kda, "measure"), (kdn, "measure"),
                         (decode, "pool_rows")):
        def fake(*args, real=getattr(module, name), **kwargs):
            bound.append(inspect.signature(real).bind(*args, **kwargs).arguments)
            return []
        monkeypatch.setattr(module, name, fake)
    for case in quick.CASES:
        quick.measure(case, True, print)
    assert [b["shape"] for b in bound] == [c.shape for c in quick.CASES]
    assert all(b["on_row"] is print for b in bound)
    assert bound[-1]["pools"] == ("f32",) and bound[-1]["eager"] is False


def test_rows_reach_on_row_as_they_are_measured(monkeypatch):
    from kdn_compile.bench import decode

    seen = []
    monkeypatch.setattr(decode, "median_ms", lambda fn: 0.5)
    monkeypatch.setattr(decode, "graphed", lambda fn: fn)
    rows = decode._rows("GDN f32 pool", {"ours": None, "FLA": None}, 10**6, eager=False,
                        on_row=lambda row: seen.append(dict(row)))
    assert [r["impl"] for r in rows] == ["ours graph", "FLA graph"] and seen == rows
    assert rows[0]["GBps"] == pytest.approx(2.0)
    for name in ("median_ms", "peak_mib"):
        monkeypatch.setattr(timing, name, lambda fn: 1.0)
    monkeypatch.setattr(timing, "rotating", lambda make, fn: fn)
    monkeypatch.setattr(timing.torch.cuda, "empty_cache", lambda: None)
    seen.clear()
    rows = timing.time_forward_backward(lambda seed: [torch.ones(2)] * 3,
                                        {"ours": None, "FLA": None},
                                        on_row=lambda row: seen.append((row["impl"], row["case"])))
    assert seen == [("ours", "fwd"), ("ours", "fwd+bwd"), ("FLA", "fwd"), ("FLA", "fwd+bwd")]
    assert [(r["impl"], r["case"]) for r in rows] == seen
