"""``kdn-compile bench`` without a GPU: arguments, refusals, tables, JSON, plots, kernel
profiles and the run's metadata (``--ops coldstart``: test_bench_coldstart.py; ``--quick``
and the recorded page: test_bench_quick.py)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import types

import pytest
import torch

from _bench import META, fake_rows, parser
from kdn_compile.__main__ import main
from kdn_compile.bench import DEFAULT_OPS, FAMILIES, Shape, cli, parse_shapes, report, timing
from kdn_compile.bench.timing import CheckFailed, require_close


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


def test_forward_backward_step_starts_from_no_gradients():
    # each step is a training step after zero_grad(): the leaves' gradients are this step's,
    # not the sum over the steps run so far
    x = torch.arange(6.0).reshape(2, 3)
    seen = []

    def fn(a, b):
        seen[:] = [a, b]
        return (a * b,)
    step = timing.fwd_bwd(fn, [x, x + 1.0], torch.ones(2, 3))
    for _ in range(3):
        step()
    a, b = seen
    torch.testing.assert_close(a.grad, x + 1.0)
    torch.testing.assert_close(b.grad, x)


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
