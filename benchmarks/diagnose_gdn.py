"""Which GDN kernel configurations are correct on this GPU, head size by head size.

Each job runs in its own process (an illegal memory access poisons a CUDA
context): GDN kernels with their launch configurations or, optionally, one
kernel's configuration forced, against the float64 reference on fresh
inputs (outputs poisoned with NaN first). Prints one line per job: relative
errors of the prepare kernel's ``(I + A)^-1`` and ``M``, of ``o``, the final
state and every gradient, or the error that stopped it. With ``$OUT`` set,
writes the lines as JSON there.

Run: ``python benchmarks/diagnose_gdn.py [--jobs 8] [--timeout 180] [--only K256]``.
A job: ``--one '{"dtype": "bf16", "K": 256, "V": 256, "rec": [16, 1, 4], "grad": [16, 4, 1]}'``
(``rec``: BV, stages, warps of the state passes; ``grad``: BV, warps, stages of the
per-chunk backward kernel).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
HALF_DIMS = [(16, 16), (32, 32), (32, 16), (16, 64), (64, 16), (128, 32), (32, 128),
             (64, 256), (256, 64), (128, 256), (256, 128), (256, 256), (16, 256), (256, 16)]
FP32_DIMS = [(16, 16), (256, 64), (128, 256), (256, 256), (16, 256)]
# 2026-11-30 (call 1 of the fourth session) the launchers ran one pipeline stage in the
# state passes at K = 256 and 4 warps in the per-chunk backward at every size; the jobs
# then also forced one kernel's configuration at a time ("rec", "grad", and the prepare
# kernel's warps, right at 2, 4 and 8): that is how one stage (half inputs) and 4 or 8
# warps (half inputs, a head size below 64) were found miscompiled. docs/benchmarks.md
# has the table.


def jobs() -> list[dict]:
    """Every head-size pair above with the launchers' own configurations, each dtype."""
    out = [{"dtype": dt, "K": K, "V": V} for dt in ("bf16", "fp16") for K, V in HALF_DIMS]
    out += [{"dtype": "fp32", "K": K, "V": V} for K, V in FP32_DIMS]
    return out


def _prepare_errors(x, gc, ai, aqk):
    """Relative errors of the prepare kernel's ``Ai`` and ``M`` (fixed length) vs float64."""
    import torch
    from tests._helpers import rel_error

    B, T, Hv = x["g"].shape
    hk = x["k"].shape[2]
    pad = (-T) % 64
    f = lambda t: torch.nn.functional.pad(t.double(), (0, 0) * (t.dim() - 2) + (0, pad))  # noqa: E731
    g = f(x["g"].unsqueeze(-1)).squeeze(-1).view(B, -1, 64, Hv)
    beta = f(x["beta"].unsqueeze(-1)).squeeze(-1).view(B, -1, 64, Hv)
    k = f(x["k"]).repeat_interleave(Hv // hk, 2).view(B, -1, 64, Hv, x["k"].shape[-1])
    q = f(x["q"]).repeat_interleave(Hv // hk, 2).view(B, -1, 64, Hv, x["k"].shape[-1])
    G = g.cumsum(2)
    decay = (G.unsqueeze(3) - G.unsqueeze(2)).movedim(-1, 2)  # [B, n, Hv, i, j]
    low = torch.ones(64, 64, dtype=torch.bool, device=g.device).tril()
    kk = torch.einsum("bcihd,bcjhd->bchij", k, k)
    qk = torch.einsum("bcihd,bcjhd->bchij", q, k)
    A = torch.where(low.tril(-1), beta.movedim(-1, 2).unsqueeze(-1) * kk * decay.exp(), 0.0)
    Ai = torch.linalg.inv(torch.eye(64, dtype=A.dtype, device=A.device) + A)
    M = torch.where(low, qk * decay.clamp_max(0).exp(), 0.0)
    back = lambda t: t.movedim(2, 3).reshape(B, -1, Hv, 64)[:, :T]  # noqa: E731
    return {"Ai": rel_error(ai, back(Ai)), "M": rel_error(aqk, back(M)),
            "G": rel_error(gc, G.reshape(B, -1, Hv)[:, :T])}


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def one(job: dict) -> dict:
    import torch

    from tests.test_gdn_kernels import GRADS, _inputs, _poisoned  # first: sets the interpreter

    import kdn_compile.lowering.chunk_gdn_bwd as bwd
    import kdn_compile.lowering.chunk_gdn_fwd as fwd
    from kdn_compile.reference import chunk_gdn_reference
    from tests._helpers import rel_error

    torch.backends.cuda.matmul.allow_tf32 = False
    if "rec" in job:
        bv, stages, warps = job["rec"]
        fwd.recurrence_config = bwd.recurrence_config = (
            lambda *a: (min(bv, job["V"]), stages, warps))
    if "grad" in job:
        bwd.grad_config = lambda *a: tuple(job["grad"])
    dtype = getattr(torch, DTYPES[job["dtype"]])
    B, T, H = (2, 300, 2) if torch.cuda.is_available() else (1, 70, 1)  # CPU: interpreter
    device = "cuda" if torch.cuda.is_available() else "cpu"
    seed = int.from_bytes(os.urandom(4), "little")
    x = _inputs(B, T, H, H, job["K"], job["V"], N=B, dtype=dtype, device=device, seed=seed)
    res: dict = {}
    stage = "prepare"
    try:
        layout = fwd.gdn_layout(x["q"], x["v"], None)
        with _poisoned():
            gc, ai, aqk = fwd.gdn_prepare(x["q"], x["k"], x["g"], x["beta"], None, layout)
        _sync()
        res.update(_prepare_errors(x, gc, ai, aqk))
        stage = "forward"
        scale = job["K"] ** -0.5
        with _poisoned():
            o, ht, *_ = fwd.chunk_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                      x["initial_state"], None, chunk_size=64, scale=scale,
                                      state_v_first=False)
        _sync()
        gen = torch.Generator().manual_seed(seed + 1)
        do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o)
        dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(ht)
        leaves = {n: x[n].detach().double().requires_grad_() for n in GRADS}
        ro, rh = chunk_gdn_reference(leaves["q"], leaves["k"], leaves["v"], leaves["g"],
                                     leaves["beta"], chunk_size=64, scale=scale,
                                     initial_state=leaves["initial_state"])
        res["o"], res["ht"] = rel_error(o, ro), rel_error(ht, rh)
        expected = torch.autograd.grad((ro * do.double()).sum() + (rh * dht.double()).sum(),
                                       [leaves[n] for n in GRADS])
        stage = "backward"
        with _poisoned():
            grads = bwd.chunk_gdn_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                      x["initial_state"], None, do, dht, chunk_size=64,
                                      scale=scale, state_v_first=False)
        _sync()
        for name, got, want in zip(GRADS, grads, expected):
            res[f"d{name}"] = rel_error(got, want)
    except Exception as exc:  # noqa: BLE001 - the report is the point
        res["error"] = f"{stage}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return res


def _spawn(job: dict, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--one", json.dumps(job)]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
    if run.returncode or not lines:
        tail = (run.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        return {"error": f"rc={run.returncode}: {tail[:200]}"}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", help="run one job (JSON) in this process")
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=180)
    parser.add_argument("--only", default="", help="substring of the job's JSON to keep")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if args.one:
        print(json.dumps(one(json.loads(args.one))), flush=True)
        return
    todo = [j for j in jobs() if args.only in json.dumps(j)]
    rows = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(_spawn, j, args.timeout): j for j in todo}
        for fut in concurrent.futures.as_completed(futures):
            job, res = futures[fut], fut.result()
            tol = 1e-3 if job["dtype"] == "fp32" else 2e-2
            bad = [k for k, v in res.items() if k != "error" and not v <= tol]
            verdict = res.get("error") or ("ok" if not bad else "WRONG " + ",".join(bad))
            errs = " ".join(f"{k}={v:.1e}" for k, v in res.items() if k != "error")
            print(f"{json.dumps(job)} | {verdict} | {errs}", flush=True)
            rows.append({"job": job, "result": res, "verdict": verdict})
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "diagnose_gdn.json"), "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
