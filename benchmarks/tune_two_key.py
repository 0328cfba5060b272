"""Launch configurations of the two-key kernels, timed on this GPU.

Forward kernels, timing the whole :func:`two_key_fwd` and checking its ``o``:
``--kernel pairs`` (``_two_key_fwd_pairs_kernel``: ``BK``, warps, stages, set through
``kdn_compile.lowering.two_key_fwd.PAIRS_LAUNCH``), ``--kernel fwd-state``
(``_two_key_fwd_state_kernel``: ``BV``, warps, stages; ``two_key_fwd.STATE_LAUNCH``).
Backward kernels, timing the whole :func:`two_key_bwd` (KDA form, with ``beta``) on one
forward's saved tensors and checking ``dq``, ``dk``, ``dlog_decay``: ``--kernel rows``
(``_two_key_bwd_rows_kernel``: ``BK``, ``BV``, warps, stages; ``two_key_bwd.ROWS_LAUNCH``),
``--kernel bwd-state`` (``_two_key_bwd_state_kernel``; ``two_key_bwd.STATE_LAUNCH``).
The state passes run one program per sequence, head and value tile and have two launch
tables each: ``STATE_LAUNCH``, and ``STATE_LAUNCH_NARROW`` where the former's tiles
leave fewer than two programs per multiprocessor (``state_launch``): time
``--kernel fwd-state`` / ``bwd-state`` at ``--shape 8x4096x16`` and
``fwd-state-narrow`` / ``bwd-state-narrow`` at ``--shape 1x32768x16``.

Each configuration runs in its own process (compiling in parallel; everything after
compiling, the check and the timing, holds a file lock, so one process at a time uses
the GPU) and is checked against and timed alternately with the launchers' own
configuration (the least of three ``triton.testing.do_bench`` medians each, ms, and their
ratio: robust to drift between processes) at K = V = 128, bf16. Compiling runs at
length 128 (outside the lock), so other processes put next to no load on the GPU
while one times.
Prints a markdown table; with ``$OUT`` set, writes the rows as JSON there.
Run: ``python benchmarks/tune_two_key.py [--kernel pairs|rows] [--shape 8x4096x16] [--jobs 8]
[--configs '[{"BK": 64, "BV": 64, "num_warps": 8, "num_stages": 2}, ...]']``.
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

LOCK = "/tmp/tune_two_key.lock"
# kernel: (module, launch-table name, the searched values of each key)
SPACES = {
    "pairs": ("two_key_fwd", "PAIRS_LAUNCH",
              {"BK": (16, 32, 64), "num_warps": (1, 2, 4, 8), "num_stages": (1, 2)}),
    "rows": ("two_key_bwd", "ROWS_LAUNCH",
             {"BK": (16, 32, 64), "BV": (32, 64), "num_warps": (4, 8), "num_stages": (1, 2)}),
    # 2 warps spill at every value tile (ptxas, sm_90)
    "fwd-state": ("two_key_fwd", "STATE_LAUNCH",
                  {"BV": (16, 32, 64), "num_warps": (4, 8), "num_stages": (1, 2, 3)}),
    "bwd-state": ("two_key_bwd", "STATE_LAUNCH",
                  {"BV": (16, 32, 64), "num_warps": (4, 8), "num_stages": (1, 2, 3)}),
    "fwd-state-narrow": ("two_key_fwd", "STATE_LAUNCH_NARROW",
                         {"BV": (16, 32), "num_warps": (4, 8), "num_stages": (1, 2, 3)}),
    "bwd-state-narrow": ("two_key_bwd", "STATE_LAUNCH_NARROW",
                         {"BV": (16, 32), "num_warps": (4, 8), "num_stages": (2, 3)}),
}


def one(kernel: str, shape: str, config: dict, rounds: int = 3) -> dict:
    import importlib

    import torch
    import triton

    from bench_kda import two_key_step

    module_name, table, _ = SPACES[kernel]
    module = importlib.import_module(f"kdn_compile.lowering.{module_name}")
    B, T, H = (int(s) for s in shape.split("x"))
    default = dict(getattr(module, table))
    # Compile both configurations outside the lock at a short length (same batch and
    # heads, so the same specializations; next to no GPU work while another process
    # times), then run and time at the real shape under the lock, alternating.
    warm = two_key_step(module, B, 128, H)
    for launch in (default, config):
        setattr(module, table, dict(launch))
        warm()
    torch.cuda.synchronize()
    del warm
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        run = two_key_step(module, B, T, H)
        setattr(module, table, default)
        want = [t.float() for t in run()]
        setattr(module, table, dict(config))
        got = [t.float() for t in run()]
        ms_default, ms = float("inf"), float("inf")
        for _ in range(rounds):
            setattr(module, table, default)
            ms_default = min(ms_default, triton.testing.do_bench(run))
            setattr(module, table, dict(config))
            ms = min(ms, triton.testing.do_bench(run))
        torch.cuda.synchronize()
    err = max(((a - b).norm() / b.norm()).item() for a, b in zip(got, want))
    return {**config, "ms": ms, "ms_default": ms_default, "vs_default": err}


def _spawn(kernel: str, shape: str, config: dict, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--kernel", kernel, "--shape", shape,
           "--one", json.dumps(config)]
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
    parser.add_argument("--kernel", choices=sorted(SPACES), default="rows")
    parser.add_argument("--shape", default="8x4096x16", help="B x T x H")
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--configs", help="a JSON list of configurations to time instead "
                        "of the whole space (e.g. those ptxas fits without spilling)")
    parser.add_argument("--one", help="one configuration as JSON (internal)")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.kernel, args.shape, json.loads(args.one))))
        return
    _, table, space = SPACES[args.kernel]
    configs = (json.loads(args.configs) if args.configs else
               [dict(zip(space, values)) for values in itertools.product(*space.values())])
    for c in configs:
        if sorted(c) != sorted(space):
            parser.error(f"--configs: each configuration needs the keys {sorted(space)}, got {c}")
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda c: _spawn(args.kernel, args.shape, c, args.timeout),
                             configs))
    print(f"{table} configurations ({args.kernel} kernel) at {args.shape}, K = V = 128, bf16")
    keys = list(space)
    print(f"| {' | '.join(keys)} | ms | default ms | ratio | vs default |")
    print("|" + "---|" * (len(keys) + 4))
    for r in sorted(rows, key=lambda r: r["ms"] / r["ms_default"] if "ms" in r else float("inf")):
        tail = (f"{r['ms']:.3f} | {r['ms_default']:.3f} | {r['ms'] / r['ms_default']:.3f} | "
                f"{r['vs_default']:.1e}" if "ms" in r else f"{r['error']} | | |")
        print(f"| {' | '.join(str(r[k]) for k in keys)} | {tail} |")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"tune_two_key_{args.kernel}.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
