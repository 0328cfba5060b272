"""Per-kernel CUDA times of a training step, as the benchmarks' ``--profile`` prints them."""

from __future__ import annotations

import torch


def print_profile(name: str, step, repeats: int = 5, rows: int = 16) -> None:
    """Run ``step`` once (compile, warm up), then ``repeats`` times under the profiler and
    print the kernels sorted by total CUDA time."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
    print(f"{name}, {repeats} steps:", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows), flush=True)
