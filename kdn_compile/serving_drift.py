"""Drift of low-precision state pools: ``python -m kdn_compile.serving_drift``.

One layer advanced by ``steps`` single-token decode steps (``layer.step``) from three
caches that differ only in the recurrent state's dtype: float32 (the baseline),
bfloat16 and, for Gated DeltaNet and KDA, float8 E4M3 with per-tile scales. The table
gives the relative RMS error of the outputs against the float32 pool's, over the
first tenth of the steps, the last tenth and all of them, so a rounding error that
accumulates in the state shows as a growing error. The inputs are random (a fixed
seed), the layer freshly initialized.
"""

from __future__ import annotations

import argparse

import torch

from kdn_compile.layers import DiagKDN, GatedDeltaNet, KimiDeltaAttention

LAYERS = {"gdn": GatedDeltaNet, "kda": KimiDeltaAttention, "kdn": DiagKDN}

__all__ = ["pool_drift", "main"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@torch.no_grad()
def pool_drift(layer_name: str, steps: int = 1000, *, batch: int = 8, hidden: int = 256,
               heads: int = 2, head_dim: int = 128, device=None, seed: int = 0,
               verbose: bool = False) -> dict[str, dict[str, float]]:
    """Relative output error of bfloat16 (and float8) pools against a float32 pool.

    Args:
        layer_name: ``"gdn"``, ``"kda"`` or ``"kdn"``.
        steps: decode steps of one token per row.
        batch: rows, each in its own slot.
        hidden, heads, head_dim: the layer's ``hidden_size``, ``num_heads``, ``head_dim``.
        device: default CUDA when present, else the CPU.
        seed: of the layer's weights and the inputs.
        verbose: print the table.

    Returns:
        ``{dtype name: {"first": .., "last": .., "all": ..}}``: relative RMS errors of the
        outputs over the first tenth of the steps, the last tenth and all of them.

    Raises:
        ValueError: an unknown ``layer_name`` or ``steps < 1``.
    """
    if layer_name not in LAYERS:
        raise ValueError(f"layer_name must be one of {sorted(LAYERS)}, got {layer_name!r}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(seed)
    layer = LAYERS[layer_name](hidden, heads, head_dim).to(device).eval()
    dtypes = [torch.float32, torch.bfloat16]
    if layer_name != "kdn":
        dtypes.append(torch.float8_e4m3fn)
    caches = {d: layer.allocate_cache(batch, state_dtype=d) for d in dtypes}
    slots = torch.arange(batch, device=device)
    gen = torch.Generator(device).manual_seed(seed)
    outputs = {d: [] for d in dtypes}
    for _ in range(steps):
        x = torch.randn(batch, 1, hidden, device=device, generator=gen)
        for dtype, cache in caches.items():
            outputs[dtype].append(layer.step(x, cache, slots))
    outputs = {d: torch.cat(o, dim=1) for d, o in outputs.items()}
    tenth = max(steps // 10, 1)
    base = outputs[torch.float32]
    table = {
        str(d).replace("torch.", ""): {
            "first": _rel(outputs[d][:, :tenth], base[:, :tenth]),
            "last": _rel(outputs[d][:, -tenth:], base[:, -tenth:]),
            "all": _rel(outputs[d], base),
        }
        for d in dtypes[1:]
    }
    if verbose:
        print(f"{layer_name}: {steps} decode steps, batch {batch}, hidden {hidden}, "
              f"{heads} heads x {head_dim}, {device}; relative output error vs a float32 pool")
        print(f"{'pool':<14} {'first tenth':>12} {'last tenth':>12} {'all':>12}")
        for name, row in table.items():
            print(f"{name:<14} {row['first']:>12.3e} {row['last']:>12.3e} {row['all']:>12.3e}")
    return table


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kdn_compile.serving_drift",
                                     description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--layer", choices=sorted(LAYERS), action="append",
        help="layer(s) to run (default: all three)")
    add("--steps", type=int, default=1000, help="decode steps (default 1000)")
    add("--batch", type=int, default=8, help="rows (default 8)")
    add("--hidden", type=int, default=256, help="hidden size (default 256)")
    add("--heads", type=int, default=2, help="heads (default 2)")
    add("--head-dim", type=int, default=128, help="key and value width per head (default 128)")
    add("--device", default=None, help="default cuda when present, else cpu")
    add("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in args.layer or sorted(LAYERS):
        pool_drift(name, args.steps, batch=args.batch, hidden=args.hidden, heads=args.heads,
                   head_dim=args.head_dim, device=args.device, seed=args.seed, verbose=True)


if __name__ == "__main__":
    main()
