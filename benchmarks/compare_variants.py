"""Code variants of a two-key launcher module, timed against the installed one.

Each FILE is a full copy of ``lowering/two_key_bwd.py`` (or ``two_key_fwd.py``) with
a change in it (say, a rewritten kernel). Each is imported from its path, checked
against the installed module on the same inputs (the relative error of ``dq``,
``dk``, ``dlog_decay``, or of ``o``) and timed alternately with it (least of three
``triton.testing.do_bench`` medians each, ms) at K = V = 128, bf16, KDA form (with
``beta``). Compiling runs first, every variant in its own process at length 128.
Prints a markdown table.
Run: ``python benchmarks/compare_variants.py FILE [FILE ...] [--shape 8x4096x16]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import subprocess
import sys


def _load(path: str):
    path = pathlib.Path(path).resolve()
    name = f"variant_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--shape", default="8x4096x16", help="B x T x H")
    parser.add_argument("--warm", action="store_true", help="compile FILE only (internal)")
    args = parser.parse_args()
    B, T, H = (int(s) for s in args.shape.split("x"))
    if args.warm:
        from bench_kda import two_key_step

        two_key_step(_load(args.files[0]), B, 128, H)()
        return
    warm = [subprocess.Popen([sys.executable, __file__, f, "--shape", args.shape, "--warm"])
            for f in args.files]
    for p in warm:
        p.wait()
    import torch
    import triton

    from bench_kda import two_key_step
    from kdn_compile.lowering import two_key_bwd, two_key_fwd

    print(f"{args.shape}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}; ms (least of three do_bench medians)")
    print("| variant | ms | installed ms | ratio | rel. error vs installed |\n"
          "|---|---|---|---|---|")
    for f in args.files:
        try:
            module = _load(f)
            base = two_key_fwd if hasattr(module, "two_key_fwd") else two_key_bwd
            run, ref = two_key_step(module, B, T, H), two_key_step(base, B, T, H)
            got, want = [t.float() for t in run()], [t.float() for t in ref()]
            err = max(((a - b).norm() / b.norm()).item() for a, b in zip(got, want))
            ms, ms_ref = float("inf"), float("inf")
            for _ in range(3):
                ms_ref = min(ms_ref, triton.testing.do_bench(ref))
                ms = min(ms, triton.testing.do_bench(run))
            print(f"| {f} | {ms:.3f} | {ms_ref:.3f} | {ms / ms_ref:.3f} | {err:.1e} |", flush=True)
            del run, ref, got, want
            torch.cuda.empty_cache()
        except Exception as exc:  # one failing variant leaves the others' rows
            print(f"| {f} | {type(exc).__name__}: {str(exc)[:150]} | | | |", flush=True)


if __name__ == "__main__":
    main()
