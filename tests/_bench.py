"""What the ``kdn-compile bench`` tests share: run metadata, rows of a family and the
command's argument parser."""

from __future__ import annotations

import argparse

from kdn_compile.bench import cli

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
