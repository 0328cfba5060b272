"""KDA chunked prefill/training: our two-key Triton kernels against FLA's ``chunk_kda``.

Times, side by side in one process, at K = V = 128 in bf16 with an fp32 initial
state and the final state returned:

* forward: ours = :func:`two_key_fwd` with ``beta`` (the kernels form ``w = beta k``);
  FLA = ``fla.ops.kda.chunk_kda(..., output_final_state=True)``;
* forward + backward of a random output gradient: ours adds :func:`two_key_bwd`
  with the ``beta`` chain rule in its kernels (``dbeta = sum(dw k)``, ``dk += beta
  dw``); FLA through autograd; "op" is ``kdn_compile.chunk_kda`` through autograd (its
  backward reuses the tensors that its forward saved);
* Diag-KDN: ``kdn_compile.diag_kdn`` (Kalman gains, then the same two-key
  memory kernels) forward and forward + backward through autograd, on the same
  ``q, k, v`` with ``log_alpha = g``, random ``omega``, ``r``, memory and
  precision (issue 4 bounds its forward + backward by 1.25x KDA's).

Before timing, checks that both agree on the output (relative error printed).
Prints a markdown table and, when ``$OUT`` is set, writes the rows as JSON there.
Run: ``python benchmarks/bench_kda.py [--shapes 8x4096x16,1x32768x16]``.
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
from kdn_compile.lowering.two_key_bwd import two_key_bwd
from kdn_compile.lowering.two_key_fwd import two_key_fwd


def make_inputs(B, T, H, K=128, V=128, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    dev = "cuda"
    q = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(dtype)
    v = torch.randn(B, T, H, V, device=dev, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, K, device=dev)).clamp_min(-5.0) / 4
    beta = torch.rand(B, T, H, device=dev, dtype=dtype)
    h0 = torch.randn(B, H, K, V, device=dev, dtype=torch.float32)
    return q, k, v, g, beta, h0


def ours_fwd(q, k, v, g, beta, h0, scale):
    return two_key_fwd(q, k, None, v, g, h0, None, chunk_size=64, scale=scale,
                       state_v_first=False, beta=beta)


def ours_fwd_bwd(q, k, v, g, beta, h0, scale, do):
    o, final, *saved = two_key_fwd(q, k, None, v, g, h0, None, chunk_size=64, scale=scale,
                                   state_v_first=False, beta=beta)
    dq, dk, dbeta, dv, dg, dh0 = two_key_bwd(q, k, None, v, g, h0, None, *saved, do, None,
                                             chunk_size=64, scale=scale, state_v_first=False,
                                             beta=beta)
    return dq, dk, dv, dg, dbeta, dh0


def two_key_step(module, B, T, H):
    """A timed call of a two-key launcher module at ``B x T x H`` (KDA form, with
    ``beta``): ``two_key_fwd``'s ``o``, or ``two_key_bwd``'s ``dq``, ``dk``,
    ``dlog_decay`` on one forward's saved tensors (for ``tune_two_key.py`` and
    ``compare_variants.py``)."""
    q, k, v, g, beta, _ = make_inputs(B, T, H)
    kw = dict(chunk_size=64, scale=128 ** -0.5, state_v_first=False, beta=beta)
    if hasattr(module, "two_key_fwd"):
        return lambda: module.two_key_fwd(q, k, None, v, g, None, None, **kw)[:1]
    saved = two_key_fwd(q, k, None, v, g, None, None, **kw)[2:]
    do = torch.randn(v.shape, generator=torch.Generator(v.device).manual_seed(1),
                     device=v.device, dtype=v.dtype)

    def run():
        grads = module.two_key_bwd(q, k, None, v, g, None, None, *saved, do, None, **kw)
        return grads[0], grads[1], grads[4]

    return run


def diag_kdn_inputs(q, k, v, g, h0):
    """Leaves ``(q, k, v, log_alpha, omega, r, memory, precision)`` of ``diag_kdn``."""
    B, T, H, K = k.shape
    omega = 0.1 * torch.rand(B, T, H, K, device=k.device)
    r = 0.5 + torch.rand(B, T, H, device=k.device)
    precision = 1.0 + torch.rand(B, H, K, device=k.device)
    return [t.detach().clone().requires_grad_()
            for t in (q, k, v, g, omega, r, h0, precision)]


def fla_step(chunk_kda, inputs, scale, do):
    """One FLA ``chunk_kda`` forward + backward through autograd, on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]

    def step():
        out, _ = chunk_kda(*leaves[:5], scale=scale, initial_state=leaves[5],
                           output_final_state=True)
        torch.autograd.backward([out], [do])
    return step


def bench(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8x4096x16,1x32768x16")
    parser.add_argument("--no-fla", action="store_true", help="time our kernels only")
    parser.add_argument("--profile", action="store_true",
                        help="also print per-kernel CUDA times of one fwd+bwd (first shape): "
                             "our kernels, the Diag-KDN op, FLA")
    args = parser.parse_args()
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        chunk_kda = None
    if args.no_fla:
        chunk_kda = None
    if args.profile:  # first: a run cut short still shows where the time goes
        B, T, H = (int(s) for s in args.shapes.split(",")[0].split("x"))
        q, k, v, g, beta, h0 = make_inputs(B, T, H)
        do = torch.randn_like(v)
        steps = [("ours", lambda: ours_fwd_bwd(q, k, v, g, beta, h0, 128 ** -0.5, do))]
        kdn_leaves = diag_kdn_inputs(q, k, v, g, h0)

        def kdn_step():
            out = kdn_compile.diag_kdn(*kdn_leaves, scale=128 ** -0.5, info_scale=1.0)[0]
            torch.autograd.backward([out], [do])

        steps.append(("Diag-KDN op", kdn_step))
        if chunk_kda is not None:
            steps.append(("FLA", fla_step(chunk_kda, (q, k, v, g, beta, h0), 128 ** -0.5, do)))
        for name, step in steps:
            print_profile(f"{name}, fwd+bwd at {B}x{T}x{H}", step)
    rows = []
    for shape in args.shapes.split(","):
        B, T, H = (int(s) for s in shape.split("x"))
        q, k, v, g, beta, h0 = make_inputs(B, T, H)
        scale = 128 ** -0.5
        do = torch.randn_like(v)
        row = {"shape": shape}
        o, final, *_ = ours_fwd(q, k, v, g, beta, h0, scale)
        row["ours_fwd"] = bench(lambda: ours_fwd(q, k, v, g, beta, h0, scale))
        row["ours_fwd_bwd"] = bench(lambda: ours_fwd_bwd(q, k, v, g, beta, h0, scale, do))
        # Through the op and autograd (its backward reuses the forward's saved tensors).
        op_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, g, beta, h0)]

        def op_fwd_bwd():
            out, _ = kdn_compile.chunk_kda(*op_leaves[:5], scale=scale,
                                           initial_state=op_leaves[5], chunk_size=64)
            torch.autograd.backward([out], [do])

        row["op_fwd_bwd"] = bench(op_fwd_bwd)
        kdn_leaves = diag_kdn_inputs(q, k, v, g, h0)

        def kdn_fwd():
            return kdn_compile.diag_kdn(*kdn_leaves, scale=scale, info_scale=1.0)

        def kdn_fwd_bwd():
            torch.autograd.backward([kdn_fwd()[0]], [do])

        row["kdn_fwd"] = bench(kdn_fwd)
        row["kdn_fwd_bwd"] = bench(kdn_fwd_bwd)
        if chunk_kda is not None:
            o_fla, s_fla = chunk_kda(q, k, v, g, beta, scale=scale, initial_state=h0,
                                     output_final_state=True)
            row["o_vs_fla"] = float((o.float() - o_fla.float()).norm() / o_fla.float().norm())
            row["state_vs_fla"] = float((final - s_fla.float()).norm() / s_fla.float().norm())
            row["fla_fwd"] = bench(lambda: chunk_kda(q, k, v, g, beta, scale=scale,
                                                     initial_state=h0, output_final_state=True))
            row["fla_fwd_bwd"] = bench(fla_step(chunk_kda, (q, k, v, g, beta, h0), scale, do))
        rows.append(row)
        print(row, flush=True)
        del q, k, v, g, beta, h0, do
        torch.cuda.empty_cache()

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__,
    }
    print(f"\n{meta['date']}, {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}; "
          "K = V = 128, bf16, ms (do_bench median)")
    print("| B x T x H | FLA fwd | ours fwd | ratio | FLA fwd+bwd | ours fwd+bwd | ratio |"
          " op fwd+bwd | o vs FLA | Diag-KDN fwd | Diag-KDN fwd+bwd | / op fwd+bwd |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fla_f, fla_fb = r.get("fla_fwd", float("nan")), r.get("fla_fwd_bwd", float("nan"))
        print(f"| {r['shape']} | {fla_f:.3f} | {r['ours_fwd']:.3f} | {r['ours_fwd'] / fla_f:.2f} "
              f"| {fla_fb:.3f} | {r['ours_fwd_bwd']:.3f} | {r['ours_fwd_bwd'] / fla_fb:.2f} "
              f"| {r['op_fwd_bwd']:.3f} | {r.get('o_vs_fla', float('nan')):.1e} "
              f"| {r['kdn_fwd']:.3f} | {r['kdn_fwd_bwd']:.3f} "
              f"| {r['kdn_fwd_bwd'] / r['op_fwd_bwd']:.2f} |")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_kda.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
