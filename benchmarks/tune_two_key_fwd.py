"""Launch configurations of the two-key forward's pairs kernel, timed on this GPU.

Each configuration (``BK``, warps, stages of ``_two_key_fwd_pairs_kernel``, set
through ``kdn_compile.lowering.two_key_fwd.PAIRS_LAUNCH``) runs in its own process
(compiling in parallel; everything after compiling, the check and the timing, holds
a file lock, so one process at a time uses the GPU): the whole forward :func:`two_key_fwd` is checked against the
launchers' own configuration (relative error of ``o``) and timed back to back with it
(``triton.testing.do_bench`` medians, ms, and their ratio: robust to drift between
processes) at K = V = 128, bf16.
Prints a markdown table; with ``$OUT`` set, writes the rows as JSON there.
Run: ``python benchmarks/tune_two_key_fwd.py [--shape 8x4096x16] [--jobs 8]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fcntl
import itertools
import json
import os
import subprocess
import sys

LOCK = "/tmp/tune_two_key_fwd.lock"


def one(shape: str, config: dict) -> dict:
    import torch
    import torch.nn.functional as F
    import triton

    from kdn_compile.lowering import two_key_fwd as fwd

    B, T, H = (int(s) for s in shape.split("x"))
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    q = F.normalize(torch.randn(B, T, H, 128, device=dev), dim=-1).to(dt)
    k = F.normalize(torch.randn(B, T, H, 128, device=dev), dim=-1).to(dt)
    w = (k * torch.rand(B, T, H, 1, device=dev)).to(dt)
    v = torch.randn(B, T, H, 128, device=dev, dtype=dt)
    g = F.logsigmoid(torch.randn(B, T, H, 128, device=dev)).clamp_min(-5.0) / 4

    def run():
        return fwd.two_key_fwd(q, k, w, v, g, None, None, chunk_size=64, scale=128 ** -0.5,
                               state_v_first=False)[0]

    # compile both configurations outside the lock, then run and time under it
    default = dict(fwd.PAIRS_LAUNCH)
    run()
    fwd.PAIRS_LAUNCH = dict(config)
    run()
    torch.cuda.synchronize()
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        fwd.PAIRS_LAUNCH = default
        o_ref = run().float()
        ms_default = triton.testing.do_bench(run)
        fwd.PAIRS_LAUNCH = dict(config)
        o = run().float()
        ms = triton.testing.do_bench(run)
        torch.cuda.synchronize()
    err = ((o - o_ref).norm() / o_ref.norm()).item()
    return {**config, "ms": ms, "ms_default": ms_default, "o_vs_default": err}


def _spawn(shape: str, config: dict, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--shape", shape, "--one", json.dumps(config)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**config, "error": f"timed out after {timeout} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        return {**config, "error": (done.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8x4096x16", help="B x T x H")
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--one", help="one configuration as JSON (internal)")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.shape, json.loads(args.one))))
        return
    configs = [{"BK": bk, "num_warps": nw, "num_stages": ns}
               for bk, nw, ns in itertools.product((16, 32, 64), (1, 2, 4, 8), (1, 2))]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda c: _spawn(args.shape, c, args.timeout), configs))
    print(f"pairs kernel launch configurations, two_key_fwd at {args.shape}, K = V = 128, bf16")
    print("| BK | warps | stages | fwd ms | default ms | ratio | o vs default |")
    print("|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: r["ms"] / r["ms_default"] if "ms" in r else float("inf")):
        tail = (f"{r['ms']:.3f} | {r['ms_default']:.3f} | {r['ms'] / r['ms_default']:.3f} | "
                f"{r['o_vs_default']:.1e}" if "ms" in r else f"{r['error']} | | |")
        print(f"| {r['BK']} | {r['num_warps']} | {r['num_stages']} | {tail} |")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "tune_two_key_fwd.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
