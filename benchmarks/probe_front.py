"""Where the layers' time outside the ``kdn`` op goes: the front of the layer (q/k/v
projections, short convolution + SiLU, L2 normalization of q and k) written several
ways, each compiled with ``fullgraph=True`` and timed forward + backward.

Variants (``--variants``, comma separated; default all), each one change from what
the layers run (``layers``: ``convolved_qkv``, three projections and a cat, then
``l2_normalize``):

* ``stacked``: one product on the stacked q/k/v weights (in the layers for one commit,
  ``255daa9``: 2% faster here, but it bypassed hooks and adapters on the projections);
* ``normalize``: ``F.normalize`` in place of ``l2_normalize``;
* ``slices_t``: the convolution's taps as ``[n, C]`` rows (contiguous per tap);
* ``function`` / ``function_keep``: the convolution as an ``autograd.Function`` with
  its backward spelled out, recomputing / saving the pre-activation;
* ``conv1d``: ``F.conv1d`` (depthwise, channels first).

Prints a markdown table (ms, ``do_bench`` medians) and, with ``--profile``, the kernels
of each variant. CUDA only. Run: ``python benchmarks/probe_front.py [--profile]``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import kdn_compile.layers as ours
from _profile import print_profile
from kdn_compile.layers._common import convolved_qkv, heads, l2_normalize


class _ConvSiLU(torch.autograd.Function):
    """``silu(sum_j padded[:, j:j+T] * taps[j])`` (``taps [n, C]``) with its backward
    spelled out; ``keep``: save the pre-activation in place of recomputing it."""

    @staticmethod
    def forward(ctx, padded, taps, keep):
        n = taps.shape[0]
        length = padded.shape[1] - n + 1
        pre = sum(padded[:, j:j + length] * taps[j] for j in range(n))
        ctx.keep = keep
        ctx.save_for_backward(padded, taps, pre if keep else None)
        return F.silu(pre)

    @staticmethod
    def backward(ctx, dy):
        padded, taps, pre = ctx.saved_tensors
        n = taps.shape[0]
        length = padded.shape[1] - n + 1
        if not ctx.keep:
            pre = sum(padded[:, j:j + length] * taps[j] for j in range(n))
        pre = pre.float()
        sig = torch.sigmoid(pre)
        dpre = dy.float() * sig * (1 + pre * (1 - sig))
        dpadded = sum(F.pad(dpre * taps[j].float(), (0, 0, j, n - 1 - j)) for j in range(n))
        dtaps = torch.stack([(dpre * padded[:, j:j + length].float()).sum((0, 1))
                             for j in range(n)])
        return dpadded.to(padded.dtype), dtaps.to(taps.dtype), None


def _front(layer, x, *, stacked=False, normalize=False, conv="slices"):
    """``conv``: "slices" (the layers' own), "slices_t" (taps as ``[n, C]`` rows),
    "function" / "function_keep" (:class:`_ConvSiLU`), "conv1d" (``F.conv1d``)."""
    if stacked:
        weight = torch.cat((layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight))
        qkv = F.linear(x, weight)
    else:
        qkv = torch.cat((layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)), dim=-1)
    n = layer.conv.kernel_size
    weight = layer.conv.weight.to(x.dtype)
    if conv == "conv1d":
        pre = F.conv1d(qkv.transpose(1, 2), weight[:, None, :], padding=n - 1,
                       groups=weight.shape[0])[..., : qkv.shape[1]]
        y = F.silu(pre.transpose(1, 2))
    else:
        padded = F.pad(qkv, (0, 0, n - 1, 0))
        length = qkv.shape[1]
        if conv == "slices":
            y = F.silu(sum(padded[:, j:j + length] * weight[:, j] for j in range(n)))
        elif conv == "slices_t":
            taps = layer.conv.weight.t().contiguous().to(x.dtype)
            y = F.silu(sum(padded[:, j:j + length] * taps[j] for j in range(n)))
        else:
            taps = layer.conv.weight.t().contiguous().to(x.dtype)
            y = _ConvSiLU.apply(padded, taps, conv == "function_keep")
    width = layer.num_heads * layer.head_dim
    q, k, v = y.split((width, width, y.shape[-1] - 2 * width), dim=-1)
    q, k, v = heads(q, layer.num_heads), heads(k, layer.num_heads), heads(v, layer.num_v_heads)
    if normalize:
        return F.normalize(q, dim=-1), F.normalize(k, dim=-1), v
    return l2_normalize(q), l2_normalize(k), v


def _layers(layer, x):
    """What the layers run now (``convolved_qkv``, ``l2_normalize``)."""
    q, k, v, _ = convolved_qkv(layer, x, None, None, layer.num_v_heads)
    return l2_normalize(q), l2_normalize(k), v


VARIANTS = {
    "layers": _layers,
    "stacked": lambda m, x: _front(m, x, stacked=True),
    "normalize": lambda m, x: _front(m, x, normalize=True),
    "slices_t": lambda m, x: _front(m, x, conv="slices_t"),
    "function": lambda m, x: _front(m, x, conv="function"),
    "function_keep": lambda m, x: _front(m, x, conv="function_keep"),
    "conv1d": lambda m, x: _front(m, x, conv="conv1d"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--shape", default="4x4096x2048", help="B x T x hidden")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    from triton.testing import do_bench

    B, T, D = (int(s) for s in args.shape.split("x"))
    torch.manual_seed(0)
    layer = ours.KimiDeltaAttention(D, 16, D // 16).cuda().to(torch.bfloat16)
    x = torch.randn(B, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():
        ref = [t.float() for t in _layers(layer, x)]
    grads = [torch.randn_like(t) for t in ref]
    rows = []
    for name in args.variants.split(","):
        fn = torch.compile(lambda t, f=VARIANTS[name]: f(layer, t), fullgraph=True)

        def step(fn=fn):
            x.grad = None
            torch.autograd.backward(list(fn(x)), grads)

        out = fn(x)
        err = max(float((a.detach().float() - b).abs().max()) for a, b in zip(out, ref))
        fwd = do_bench(lambda fn=fn: fn(x), warmup=25, rep=200, return_mode="median")
        both = do_bench(step, warmup=25, rep=200, return_mode="median")
        rows.append((name, fwd, both, err))
        print(rows[-1], flush=True)
        if args.profile:
            print_profile(f"front {name}", step, rows=14)
    print(f"\nfront of the KDA layer at {args.shape}, bf16, compiled fullgraph, ms (median)")
    print("| variant | fwd | fwd+bwd | max abs diff vs layers |\n|---|---|---|---|")
    for name, fwd, both, err in rows:
        print(f"| {name} | {fwd:.3f} | {both:.3f} | {err:.1e} |")


if __name__ == "__main__":
    main()
