"""Where the layers' time outside the ``kdn`` op goes: the front of the layer (q/k/v
projections, short convolution + SiLU, L2 normalization of q and k) written several
ways, each compiled with ``fullgraph=True`` and timed forward + backward.

Variants (``--variants``, comma separated; default all):

* ``current``: the layers' own code (``convolved_qkv`` + ``F.normalize``);
* ``fused``: one matmul on the concatenated q/k/v weights in place of three and a cat;
* ``function``: the convolution as an ``autograd.Function`` with its backward spelled
  out (``dpre`` formed once, then ``dx`` and ``dweight`` from it);
* ``rsqrt``: ``x * rsqrt(sum x^2 + eps)`` in place of ``F.normalize``;
* ``conv1d``: ``F.conv1d`` (depthwise, channels first) for the convolution;
* ``all``: fused + function + rsqrt.

Prints a markdown table (ms, ``do_bench`` medians) and, with ``--profile``, the kernels
of each variant. CUDA only. Run: ``python benchmarks/probe_front.py [--profile]``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import kdn_compile.layers as ours
from _profile import print_profile
from kdn_compile.layers._common import heads


class _ConvSiLU(torch.autograd.Function):
    """``silu(sum_j padded[:, j:j+T] * weight[:, j])`` with an explicit backward."""

    @staticmethod
    def forward(ctx, padded, weight):
        taps = weight.shape[1]
        length = padded.shape[1] - taps + 1
        pre = sum(padded[:, j:j + length] * weight[:, j] for j in range(taps))
        ctx.save_for_backward(padded, weight)
        return F.silu(pre)

    @staticmethod
    def backward(ctx, dy):
        padded, weight = ctx.saved_tensors
        taps = weight.shape[1]
        length = padded.shape[1] - taps + 1
        pre = sum(padded[:, j:j + length].float() * weight[:, j].float() for j in range(taps))
        sig = torch.sigmoid(pre)
        dpre = dy.float() * sig * (1 + pre * (1 - sig))
        dpadded = sum(F.pad(dpre * weight[:, j].float(), (0, 0, j, taps - 1 - j))
                      for j in range(taps))
        dweight = torch.stack([(dpre * padded[:, j:j + length].float()).sum((0, 1))
                               for j in range(taps)], dim=1)
        return dpadded.to(padded.dtype), dweight.to(weight.dtype)


def _front(layer, x, *, fused=False, function=False, rsqrt=False, conv1d=False):
    if fused:
        weight = torch.cat((layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight))
        qkv = F.linear(x, weight)
    else:
        qkv = torch.cat((layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)), dim=-1)
    conv = layer.conv
    tail = conv.kernel_size - 1
    weight = conv.weight.to(x.dtype)
    if conv1d:
        pre = F.conv1d(qkv.transpose(1, 2), weight[:, None, :], padding=tail,
                       groups=weight.shape[0])[..., : qkv.shape[1]]
        y = F.silu(pre.transpose(1, 2))
    else:
        padded = F.pad(qkv, (0, 0, tail, 0))
        if function:
            y = _ConvSiLU.apply(padded, weight)
        else:
            y = F.silu(sum(padded[:, j:j + qkv.shape[1]] * weight[:, j]
                           for j in range(conv.kernel_size)))
    width = layer.num_heads * layer.head_dim
    q, k, v = y.split((width, width, y.shape[-1] - 2 * width), dim=-1)
    q, k, v = heads(q, layer.num_heads), heads(k, layer.num_heads), heads(v, layer.num_v_heads)
    if rsqrt:
        def norm(t):
            tf = t.float()
            return (tf * torch.rsqrt(tf.square().sum(-1, keepdim=True) + 1e-12)).to(t.dtype)
    else:
        def norm(t):
            return F.normalize(t, dim=-1)
    return norm(q), norm(k), v


def _current(layer, x):
    from kdn_compile.layers._common import convolved_qkv

    q, k, v, _ = convolved_qkv(layer, x, None, None, layer.num_v_heads)
    return F.normalize(q, dim=-1), F.normalize(k, dim=-1), v


VARIANTS = {
    "current": _current,
    "fused": lambda m, x: _front(m, x, fused=True),
    "function": lambda m, x: _front(m, x, function=True),
    "rsqrt": lambda m, x: _front(m, x, rsqrt=True),
    "conv1d": lambda m, x: _front(m, x, conv1d=True),
    "all": lambda m, x: _front(m, x, fused=True, function=True, rsqrt=True),
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
    ref = [t.float() for t in _current(layer, x)]
    grads = [torch.randn_like(t) for t in ref]
    rows = []
    for name in args.variants.split(","):
        fn = torch.compile(lambda t, f=VARIANTS[name]: f(layer, t), fullgraph=True)

        def step(fn=fn):
            x.grad = None
            torch.autograd.backward(list(fn(x)), grads)

        out = fn(x)
        err = max(float((a.float() - b).abs().max()) for a, b in zip(out, ref))
        fwd = do_bench(lambda fn=fn: fn(x), warmup=25, rep=200, return_mode="median")
        both = do_bench(step, warmup=25, rep=200, return_mode="median")
        rows.append((name, fwd, both, err))
        print(rows[-1], flush=True)
        if args.profile:
            print_profile(f"front {name}", step, rows=14)
    print(f"\nfront of the KDA layer at {args.shape}, bf16, compiled fullgraph, ms (median)")
    print("| variant | fwd | fwd+bwd | max abs diff vs current |\n|---|---|---|---|")
    for name, fwd, both, err in rows:
        print(f"| {name} | {fwd:.3f} | {both:.3f} | {err:.1e} |")


if __name__ == "__main__":
    main()
