"""``kdn-compile bench --quick`` without a GPU: the recorded page's tables (docs/benchmarks.md),
the verdicts against the rows recorded on the same GPU, rows printed as they are measured."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from _bench import META, parser
from kdn_compile.__main__ import main
from kdn_compile.bench import cli, timing


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
