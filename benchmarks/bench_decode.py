"""Decode over state pools on CUDA, side by side with FLA's fused recurrent kernels.

Checks each timed configuration against float64 first, then times (``do_bench``
medians): the launch sweep of the token-recurrence kernel, GDN and KDA decode over
float32 / bfloat16 / float8 pools against ``fused_recurrent_gated_delta_rule`` and
``fused_recurrent_kda`` (Hk=16, Hv=32, K=V=128, bf16 q/k/v, batch 1 / 64 / 256, T = 1
and 4), Diag-KDN decode, and a decode step of the layers in a CUDA graph. Effective state
bandwidth = state bytes read + written (scales included) / time. Writes JSON rows and a
markdown table to ``--out``.

Run: ``python benchmarks/bench_decode.py [--out DIR] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
import traceback

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

import kdn_compile
from kdn_compile import reference as ref
from kdn_compile.lowering.recurrent import recurrent_delta_fwd
from kdn_compile.reference.fp8 import quantize_state_fp8

FP8 = torch.float8_e4m3fn
HK, HV, K, V = 16, 32, 128, 128
ROWS: list[dict] = []


def _ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _inputs(B, T, per_key, hk=HK, hv=HV, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    return {
        "q": F.normalize(r(B, T, hk, K), dim=-1).bfloat16(),
        "k": F.normalize(r(B, T, hk, K), dim=-1).bfloat16(),
        "v": r(B, T, hv, V).bfloat16(),
        "g": -torch.rand(*((B, T, hv, K) if per_key else (B, T, hv)), device="cuda",
                         generator=gen) * 0.5,
        "beta": torch.rand(B, T, hv, device="cuda", generator=gen).bfloat16(),
    }


def _pool(S, dtype, hv=HV):
    state = torch.randn(S, hv, K, V, device="cuda") * 0.1
    if dtype == FP8:
        values, scales = quantize_state_fp8(state)
        return values, scales
    return state.to(dtype), None


def _state_bytes(B, dtype, hv=HV):
    per = {torch.float32: 4, torch.bfloat16: 2, FP8: 1}[dtype]
    scales = 4 * triton.cdiv(V, 64) if dtype == FP8 else 0
    return 2 * B * hv * (K * V * per + scales)


def _row(**kw):
    ROWS.append(kw)
    print(json.dumps(kw), flush=True)


def check_correctness():
    """Each pool dtype and gate kind at the benchmark's head sizes against float64."""
    for per_key in (False, True):
        for dtype in (torch.float32, torch.bfloat16, FP8):
            x = _inputs(3, 4, per_key, seed=1)
            pool, scales = _pool(5, dtype)
            start = pool.float().clone() if scales is None else (
                kdn_compile.reference.fp8.dequantize_state_fp8(pool, scales))
            idx = torch.tensor([4, -1, 1], device="cuda")
            o = kdn_compile.delta_rule_decode(*x.values(), pool, idx, pool_scales=scales)
            for row, slot in ((0, 4), (2, 1)):
                sub = {n: t[row:row + 1].double() for n, t in x.items()}
                o64, _ = ref.recurrent_delta_rule_reference(
                    **sub, initial_state=start[slot:slot + 1].double())
                err = float((o[row:row + 1].double() - o64).norm() / o64.norm())
                assert err < 1e-2, (per_key, dtype, err)
            assert torch.equal(o[1], torch.zeros_like(o[1]))
    print("correctness: decode vs float64 ok", flush=True)


def sweep():
    """(BV, warps) of the token-recurrence kernel: float32 pool, T = 1, GDN."""
    for B in (1, 64, 256):
        x = _inputs(B, 1, False)
        pool, _ = _pool(B, torch.float32)
        idx = torch.randperm(B, device="cuda")
        for bv in (8, 16, 32, 64):
            for warps in (1, 2, 4, 8):
                if bv * K // (32 * warps) > 128:
                    continue
                fn = lambda: recurrent_delta_fwd(  # noqa: E731
                    *x.values(), scale=K**-0.5, state_in=pool, state_out=pool, indices=idx,
                    block_v=bv, num_warps=warps)
                ms = _ms(fn)
                _row(kind="sweep", B=B, BV=bv, warps=warps, ms=ms,
                     GBps=_state_bytes(B, torch.float32) / ms / 1e6)
    for B in (64, 256):  # float8 pools: BV = 64 fixed, warps swept
        x = _inputs(B, 1, False)
        pool, scales = _pool(B, FP8)
        idx = torch.randperm(B, device="cuda")
        for warps in (2, 4, 8):
            fn = lambda: recurrent_delta_fwd(  # noqa: E731
                *x.values(), scale=K**-0.5, state_in=pool, state_out=pool, scales=scales,
                indices=idx, num_warps=warps)
            ms = _ms(fn)
            _row(kind="sweep-fp8", B=B, BV=64, warps=warps, ms=ms,
                 GBps=_state_bytes(B, FP8) / ms / 1e6)


def decode_table(fla):
    for per_key in (False, True):
        op = "kda" if per_key else "gdn"
        for B in (1, 64, 256):
            for T in (1, 4):
                x = _inputs(B, T, per_key)
                idx = torch.randperm(B, device="cuda")
                row = dict(kind="decode", op=op, B=B, T=T)
                for dtype in (torch.float32, torch.bfloat16, FP8):
                    pool, scales = _pool(B, dtype)
                    fn = lambda: kdn_compile.delta_rule_decode(  # noqa: E731
                        *x.values(), pool, idx, pool_scales=scales)
                    name = {torch.float32: "f32", torch.bfloat16: "bf16", FP8: "fp8"}[dtype]
                    ms = _ms(fn)
                    row[f"ours_{name}_ms"] = ms
                    row[f"ours_{name}_GBps"] = _state_bytes(B, dtype) / ms / 1e6
                    # the kernel alone (no argument checks, no dispatch): the same launch
                    row[f"kernel_{name}_ms"] = _ms(lambda: recurrent_delta_fwd(  # noqa: E731
                        *x.values(), scale=K**-0.5, state_in=pool, state_out=pool,
                        scales=scales, indices=idx))
                if fla is not None:
                    h0 = torch.randn(B, HV, K, V, device="cuda") * 0.1
                    if per_key:
                        fn = lambda: fla.fused_recurrent_kda(  # noqa: E731
                            x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0,
                            output_final_state=True)
                    else:
                        fn = lambda: fla.fused_recurrent_gated_delta_rule(  # noqa: E731
                            x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0,
                            output_final_state=True)
                    ms = _ms(fn)
                    row["fla_ms"] = ms
                    row["fla_GBps"] = _state_bytes(B, torch.float32) / ms / 1e6
                _row(**row)


def graphed_table(fla):
    """The same steps captured in a CUDA graph (launch overhead out): ours vs FLA."""
    for per_key in (False, True):
        for B in (1, 64, 256):
            x = _inputs(B, 1, per_key)
            idx = torch.randperm(B, device="cuda")
            pool, _ = _pool(B, torch.float32)
            fns = {"ours": lambda: kdn_compile.delta_rule_decode(*x.values(), pool, idx)}
            if fla is not None:
                h0 = torch.randn(B, HV, K, V, device="cuda") * 0.1
                f = fla.fused_recurrent_kda if per_key else fla.fused_recurrent_gated_delta_rule
                fns["fla"] = lambda: f(x["q"], x["k"], x["v"], x["g"], x["beta"],  # noqa: E731
                                       initial_state=h0, output_final_state=True)
            row = dict(kind="graphed", op="kda" if per_key else "gdn", B=B, T=1)
            for name, fn in fns.items():
                fn()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                ms = _ms(graph.replay)
                row[f"{name}_ms"] = ms
                row[f"{name}_GBps"] = _state_bytes(B, torch.float32) / ms / 1e6
            _row(**row)


def kdn_table():
    for B in (1, 64, 256):
        for T in (1, 4):
            gen = torch.Generator(device="cuda").manual_seed(B)
            r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
            q, k = (F.normalize(r(B, T, HV, K), dim=-1).bfloat16() for _ in "qk")
            v = r(B, T, HV, V).bfloat16()
            la = -torch.rand(B, T, HV, K, device="cuda", generator=gen) * 0.5
            om = torch.rand(B, T, HV, K, device="cuda", generator=gen) * 0.1
            rr = torch.rand(B, T, HV, device="cuda", generator=gen) + 0.1
            memory = torch.randn(B, HV, K, V, device="cuda") * 0.1
            precision = torch.rand(B, HV, K, device="cuda") + 0.5
            idx = torch.randperm(B, device="cuda")
            ms = _ms(lambda: kdn_compile.diag_kdn_decode(  # noqa: E731
                q, k, v, la, om, rr, memory, precision, idx, scale=K**-0.5, info_scale=1.0))
            x = _inputs(B, T, True, hk=HV)
            pool, _ = _pool(B, torch.float32)
            kda = _ms(lambda: kdn_compile.delta_rule_decode(*x.values(), pool, idx))  # noqa: E731
            _row(kind="kdn", B=B, T=T, H=HV, kdn_ms=ms, kda_ms=kda, ratio=ms / kda,
                 GBps=(_state_bytes(B, torch.float32) + 2 * B * HV * K * 4) / ms / 1e6)


def layer_table():
    from kdn_compile.layers import DiagKDN, GatedDeltaNet, KimiDeltaAttention

    for name, cls in (("gdn", GatedDeltaNet), ("kda", KimiDeltaAttention), ("kdn", DiagKDN)):
        layer = cls(2048, 16, 128).cuda().bfloat16().eval()
        B = 64
        x = torch.randn(B, 1, 2048, device="cuda", dtype=torch.bfloat16)
        row = dict(kind="layer", layer=name, B=B, T=1)
        with torch.no_grad():
            if hasattr(layer, "step"):
                cache = layer.allocate_cache(B, device="cuda")
                idx = torch.arange(B, device="cuda")
                prompt = torch.randn(B, 512, 2048, device="cuda", dtype=torch.bfloat16)
                layer.step(prompt, cache, idx)
                step = torch.compile(layer.step, fullgraph=True, mode="reduce-overhead")
                for _ in range(3):
                    step(x, cache, idx)
                row["eager_ms"] = _ms(lambda: layer.step(x, cache, idx))  # noqa: E731
                row["graphed_ms"] = _ms(lambda: step(x, cache, idx))  # noqa: E731
            else:
                _, state = layer(torch.randn(B, 512, 2048, device="cuda", dtype=torch.bfloat16))
                row["eager_forward_ms"] = _ms(lambda: layer(x, state))  # noqa: E731
        _row(**row)


def _table(out_dir):
    lines = ["| op | B | T | ours f32 pool ms (GB/s) | bf16 pool ms (x f32) | fp8 pool ms (x f32) "
             "| kernel alone f32 ms | FLA ms (GB/s) | ours/FLA |", "|---|---|---|---|---|---|---|---|---|"]
    for r in ROWS:
        if r["kind"] != "decode":
            continue
        f32 = r["ours_f32_ms"]
        fla = r.get("fla_ms")
        lines.append(
            f"| {r['op']} | {r['B']} | {r['T']} | {f32:.4f} ({r['ours_f32_GBps']:.0f}) | "
            f"{r['ours_bf16_ms']:.4f} ({r['ours_bf16_ms'] / f32:.2f}) | {r['ours_fp8_ms']:.4f} "
            f"({r['ours_fp8_ms'] / f32:.2f}) | {r['kernel_f32_ms']:.4f} | "
            + (f"{fla:.4f} ({r['fla_GBps']:.0f}) | {f32 / fla:.2f} |" if fla else "- | - |"))
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(out_dir, "decode.md"), "w") as f:
        f.write(text + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--sections", default="check,sweep,decode,graphed,kdn,layers")
    args = parser.parse_args()
    try:
        import fla  # noqa: F401
        import fla.ops.gated_delta_rule as fgdn
        import fla.ops.kda as fkda

        class F_:
            fused_recurrent_gated_delta_rule = staticmethod(fgdn.fused_recurrent_gated_delta_rule)
            fused_recurrent_kda = staticmethod(fkda.fused_recurrent_kda)
        fla_ops, fla_version = F_, getattr(fla, "__version__", "?")
    except ImportError:
        fla_ops, fla_version = None, None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    meta = dict(kind="meta", gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, fla=fla_version, commit=commit,
                python=platform.python_version(),
                utc=time.strftime("%Y-%m-%d %H:%M", time.gmtime()))
    _row(**meta)
    sections = {"check": check_correctness, "sweep": sweep, "decode": lambda: decode_table(fla_ops),
                "graphed": lambda: graphed_table(fla_ops), "kdn": kdn_table, "layers": layer_table}
    for name in args.sections.split(","):
        try:
            sections[name]()
        except Exception:  # noqa: BLE001 - report and go on with the other sections
            print(f"SECTION {name} FAILED\n{traceback.format_exc()[-3000:]}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "decode.json"), "w") as f:
        json.dump(ROWS, f, indent=1)
    _table(args.out)


if __name__ == "__main__":
    main()
