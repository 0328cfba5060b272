"""GDN chunked prefill/training: our Triton kernels against FLA's ``chunk_gated_delta_rule``.

Times, side by side in one process, at K = V = 128 in bf16 with an fp32 initial
state and the final state returned (shapes ``B x T x Hk x Hv``):

* forward: ours = ``kdn_compile.chunk_gdn`` (the ``kdn::chunk_gdn`` op, kernel
  path); FLA = ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``;
* forward + backward of a random output gradient, both through autograd;
* peak memory of one forward + backward above what the inputs hold.

FLA (fla-core 0.6.0) refuses its GDN backward on Triton >= 3.4, < 3.7.1 on
Hopper (a miscompiled gated kernel, FLA issue 640); the refusal is lifted here to
time it, so its backward numbers are its speed, not a correct result. Before
timing, checks that the two forwards agree. ``--sweep`` also times our
recurrence at each value tile and pipeline depth and ``--profile`` prints per-kernel times of five
forward + backward steps, ours and FLA's. Prints a markdown table; with ``$OUT`` set, writes the rows
as JSON there. Run: ``python benchmarks/bench_gdn.py [--shapes 8x4096x16x16,...]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import torch.nn.functional as F
import triton

import kdn_compile
from _profile import print_profile
from kdn_compile.lowering import chunk_gdn_fwd as fwd_module

SHAPES = "8x4096x16x16,1x32768x16x16,4x4096x16x32"


def make_inputs(B, T, Hk, Hv, K=128, V=128, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    dev = "cuda"
    q = F.normalize(torch.randn(B, T, Hk, K, device=dev), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, Hk, K, device=dev), dim=-1).to(dtype)
    v = torch.randn(B, T, Hv, V, device=dev, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, Hv, device=dev)).clamp_min(-5.0) / 4
    beta = torch.rand(B, T, Hv, device=dev, dtype=dtype)
    h0 = torch.randn(B, Hv, K, V, device=dev, dtype=torch.float32)
    return q, k, v, g, beta, h0


def ours(q, k, v, g, beta, h0, scale):
    return kdn_compile.chunk_gdn(q, k, v, g, beta, scale=scale, initial_state=h0)


def fla_gdn():
    try:
        import fla.ops.common.chunk_o as chunk_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    chunk_o.TRITON_ABOVE_3_7_1 = True  # lift the Hopper refusal: time it, do not trust it

    def run(q, k, v, g, beta, h0, scale):
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0,
                                      output_final_state=True)
    return run


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def fwd_bwd(fn, inputs, scale, do):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]

    def step():
        o, _ = fn(*leaves, scale)
        torch.autograd.backward([o], [do])
    return step


def peak_memory(step):
    """Peak bytes allocated by one call above what was allocated before it (MiB)."""
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def sweep(inputs, scale, do):
    """Our fwd and fwd+bwd at every value tile and pipeline depth of the sequential kernels."""
    import kdn_compile.lowering.chunk_gdn_bwd as bwd_module

    real = fwd_module.recurrence_config
    found = {}
    for tile in (16, 32, 64):
        for stages in (1, 2):
            def fixed(k_dim, v_dim, dtype, programs, device, _tile=tile, _stages=stages):
                return min(_tile, v_dim), _stages, 4
            fwd_module.recurrence_config = bwd_module.recurrence_config = fixed
            try:
                found[f"BV{tile}/s{stages}"] = (bench(lambda: ours(*inputs, scale)),
                                                bench(fwd_bwd(ours, inputs, scale, do)))
            finally:
                fwd_module.recurrence_config = bwd_module.recurrence_config = real
    return found


def table_row(r):
    nan = float("nan")
    fla_f, fla_fb = r.get("fla_fwd", nan), r.get("fla_fwd_bwd", nan)
    return (f"| {r['shape']} | {fla_f:.3f} | {r['ours_fwd']:.3f} | {r['ours_fwd'] / fla_f:.2f} "
            f"| {fla_fb:.3f} | {r['ours_fwd_bwd']:.3f} | {r['ours_fwd_bwd'] / fla_fb:.2f} "
            f"| {r.get('fla_peak_mib', nan):.0f} | {r['ours_peak_mib']:.0f} "
            f"| {r.get('o_vs_fla', nan):.1e} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    fla = fla_gdn()
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "fla": "fla-core 0.6.0" if fla else "absent",
    }
    print(f"{meta['date']}, {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}; "
          "K = V = 128, bf16, ms (do_bench median); peak MiB of one fwd+bwd", flush=True)
    header = ("| B x T x Hk x Hv | FLA fwd | ours fwd | ratio | FLA fwd+bwd | ours fwd+bwd | ratio "
              "| FLA peak | ours peak | o vs FLA |\n|---|---|---|---|---|---|---|---|---|---|")
    if args.profile:  # first: a run cut short still shows where the time goes
        B, T, Hk, Hv = (int(s) for s in args.shapes.split(",")[0].split("x"))
        inputs = make_inputs(B, T, Hk, Hv)
        for name, fn in (("ours", ours), ("FLA", fla)):
            if fn is None:
                continue
            step = fwd_bwd(fn, inputs, 128 ** -0.5, torch.randn_like(inputs[2]))
            print_profile(f"{name}, fwd+bwd at {B}x{T}x{Hk}x{Hv}", step)
        del inputs, step
        torch.cuda.empty_cache()

    rows = []
    for shape in args.shapes.split(","):
        B, T, Hk, Hv = (int(s) for s in shape.split("x"))
        inputs = make_inputs(B, T, Hk, Hv)
        scale = 128 ** -0.5
        do = torch.randn_like(inputs[2])
        row = {"shape": shape}
        o, final = ours(*inputs, scale)
        row["ours_fwd"] = bench(lambda: ours(*inputs, scale))
        step = fwd_bwd(ours, inputs, scale, do)
        row["ours_fwd_bwd"] = bench(step)
        row["ours_peak_mib"] = peak_memory(step)
        if fla is not None:
            o_fla, s_fla = fla(*inputs, scale)
            row["o_vs_fla"] = float((o.float() - o_fla.float()).norm() / o_fla.float().norm())
            row["state_vs_fla"] = float((final - s_fla.float()).norm() / s_fla.float().norm())
            row["fla_fwd"] = bench(lambda: fla(*inputs, scale))
            step = fwd_bwd(fla, inputs, scale, do)
            row["fla_fwd_bwd"] = bench(step)
            row["fla_peak_mib"] = peak_memory(step)
        if args.sweep:
            row["sweep"] = sweep(inputs, scale, do)
        rows.append(row)
        print(*([header] if len(rows) == 1 else []), table_row(row), sep="\n", flush=True)
        if "sweep" in row:
            print("sweep (fwd, fwd+bwd):", {n: tuple(round(x, 3) for x in v)
                                           for n, v in row["sweep"].items()}, flush=True)
        del inputs, do, o, final
        torch.cuda.empty_cache()

    print("\n" + header)
    for r in rows:
        print(table_row(r))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_gdn.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
