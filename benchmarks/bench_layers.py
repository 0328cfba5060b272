"""Whole token-mixing layers: ours under ``torch.compile(fullgraph=True)`` vs FLA's.

Times forward+backward of ``kdn_compile.layers`` (compiled, Triton kernels through
Inductor) against ``fla.layers`` (flash-linear-attention 0.6.0) eager, at hidden
2048, 16 heads x 128, B=4, T=4096, bf16, and prints a markdown table plus one JSON
row per measurement with GPU, versions, commit and time. Ours compiles with
``fullgraph=True``, so it has no graph break by construction; FLA under
``torch.compile`` (11 and 14 graph breaks) is in ``../shared/ANCHORS.md``. CUDA only.

    python benchmarks/bench_layers.py [--layers gdn,kda,kdn] [--batch 4] [--length 4096]
        [--mode max-autotune-no-cudagraphs] [--profile]

``--profile`` also prints each layer's kernels by CUDA time (ours compiled, FLA eager).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess

import torch

import kdn_compile.layers as ours
from _profile import print_profile


def _median_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=50, rep=300, return_mode="median")


def _peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**20


def _fla_layer(name: str, hidden: int, heads: int, head_dim: int):
    try:
        import fla.ops.common.chunk_o as chunk_o
        from fla.layers import GatedDeltaNet, KimiDeltaAttention
    except ImportError:
        return None
    # fla-core 0.6.0 refuses its GDN backward on Triton < 3.7.1 on Hopper (a
    # miscompiled gated kernel, FLA issue 640). Lifted to time it, not to trust it.
    chunk_o.TRITON_ABOVE_3_7_1 = True
    cls = {"gdn": GatedDeltaNet, "kda": KimiDeltaAttention}.get(name)
    if cls is None:
        return None
    return cls(hidden_size=hidden, expand_v=1, head_dim=head_dim, num_heads=heads)


def _our_layer(name: str, hidden: int, heads: int, head_dim: int):
    cls = {"gdn": ours.GatedDeltaNet, "kda": ours.KimiDeltaAttention, "kdn": ours.DiagKDN}[name]
    return cls(hidden, heads, head_dim)


def _step(fn, x, dy):
    def run():
        x.grad = None
        y = fn(x)
        y.backward(dy)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="gdn,kda,kdn")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--mode", default=None,
                        help="torch.compile mode for ours (e.g. max-autotune-no-cudagraphs)")
    parser.add_argument("--profile", action="store_true",
                        help="print each layer's kernels by CUDA time after timing it")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_layers.py needs CUDA")
    import triton

    torch.manual_seed(0)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    shape = (args.batch, args.length, args.hidden)
    rows = []
    for name in args.layers.split(","):
        x = torch.randn(shape, device=dev, dtype=dtype, requires_grad=True)
        dy = torch.randn(shape, device=dev, dtype=dtype)
        row = {"layer": name, "mode": args.mode, **meta}
        layer = _our_layer(name, args.hidden, args.heads, args.head_dim).to(dev, dtype)
        compiled = torch.compile(lambda t, m=layer: m(t)[0], fullgraph=True, mode=args.mode)
        row["ours_compiled_ms"] = _median_ms(_step(compiled, x, dy))
        row["ours_peak_mib"] = _peak_mib(_step(compiled, x, dy))
        row["ours_eager_ms"] = _median_ms(_step(lambda t, m=layer: m(t)[0], x, dy))
        if args.profile:
            print_profile(f"{name}: ours compiled, fwd+bwd", _step(compiled, x, dy), rows=30)
        fla = _fla_layer(name, args.hidden, args.heads, args.head_dim)
        if fla is not None:
            fla = fla.to(dev, dtype)
            eager = lambda t, m=fla: m(t)[0]  # noqa: E731
            row["fla_eager_ms"] = _median_ms(_step(eager, x, dy))
            row["fla_peak_mib"] = _peak_mib(_step(eager, x, dy))
            if args.profile:
                print_profile(f"{name}: FLA eager, fwd+bwd", _step(eager, x, dy), rows=30)
        rows.append(row)
        print(json.dumps(row), flush=True)
    nan = math.nan
    print(f"\n{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['time']}")
    print(f"B x T x D = {' x '.join(map(str, shape))}, {args.heads} heads x {args.head_dim}, "
          "bf16, forward+backward, ms (median)")
    print("| layer | FLA eager | ours eager | ours compiled fullgraph | ours compiled / FLA eager "
          "| peak MiB FLA / ours |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        fla_e = r.get("fla_eager_ms", nan)
        print(f"| {r['layer']} | {fla_e:.3f} | {r['ours_eager_ms']:.3f} | "
              f"{r['ours_compiled_ms']:.3f} | {r['ours_compiled_ms'] / fla_e:.2f} | "
              f"{r.get('fla_peak_mib', nan):.0f} / {r['ours_peak_mib']:.0f} |")


if __name__ == "__main__":
    main()
