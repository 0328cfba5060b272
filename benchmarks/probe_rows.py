"""Where the two-key backward's rows kernel spends its time: the whole ``two_key_bwd``
timed with one part of ``_two_key_bwd_rows_kernel`` cut out at a time (a copy of
``lowering/two_key_bwd.py`` with the part's condition made false, imported from a
temporary file; the results are wrong by design and only timed).

Parts: the state terms (the loop over value tiles), the earlier blocks' columns, the
later blocks' rows, the diagonal block. Each variant is timed back to back with the
real kernel (``do_bench`` medians, ms) at K = V = 128, bf16, KDA form (with beta).
Run: ``python benchmarks/probe_rows.py [--shape 8x4096x16]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import tempfile

import torch
import triton

from bench_kda import make_inputs
from kdn_compile.lowering import two_key_bwd as real
from kdn_compile.lowering.two_key_fwd import two_key_fwd

CUTS = {
    "state terms": ("    for i_v in range(V // BV):\n        o_v = i_v * BV + tl.arange(0, BV)\n"
                    "        b_x = load_tile(x, ti,",
                    "    for i_v in range(0):\n        o_v = i_v * BV + tl.arange(0, BV)\n"
                    "        b_x = load_tile(x, ti,"),
    "earlier columns": ("    if i_i > 0:\n", "    if i_i > 1000:\n"),
    "later rows": ("    if ti + BC <= last:\n", "    if ti + BC <= last - 1000000:\n"),
    "diagonal": ("    for half in tl.static_range(2):\n        start = half * (BC // 2)\n"
                 "        r = tl.minimum(ti + start",
                 "    for half in range(0):\n        start = half * (BC // 2)\n"
                 "        r = tl.minimum(ti + start"),
}


def variant(name: str, old: str, new: str):
    source = pathlib.Path(real.__file__).read_text()
    if source.count(old) != 1:
        raise SystemExit(f"{name}: the cut's text is not in two_key_bwd.py once")
    path = pathlib.Path(tempfile.mkdtemp()) / f"probe_{abs(hash(name))}.py"
    path.write_text(source.replace(old, new))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module.two_key_bwd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8x4096x16")
    args = parser.parse_args()
    B, T, H = (int(s) for s in args.shape.split("x"))
    q, k, v, g, beta, _ = make_inputs(B, T, H)
    kw = dict(chunk_size=64, scale=128 ** -0.5, state_v_first=False, beta=beta)
    saved = two_key_fwd(q, k, None, v, g, None, None, **kw)[2:]
    do = torch.randn_like(v)

    def timed(bwd):
        return triton.testing.do_bench(
            lambda: bwd(q, k, None, v, g, None, None, *saved, do, None, **kw))

    print(f"two_key_bwd at {args.shape}, K = V = 128, bf16, ms (do_bench median)")
    print("| rows kernel without | bwd ms | real bwd ms | saved ms |")
    print("|---|---|---|---|")
    for name, (old, new) in CUTS.items():
        cut = variant(name, old, new)
        timed(cut)  # compile
        ms_real, ms = timed(real.two_key_bwd), timed(cut)
        print(f"| {name} | {ms:.3f} | {ms_real:.3f} | {ms_real - ms:.3f} |", flush=True)


if __name__ == "__main__":
    main()
