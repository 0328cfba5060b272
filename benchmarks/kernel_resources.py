"""Registers, stack (spills) and shared memory of every Triton kernel, compiled for sm_90
without a GPU, at a benchmark shape.

The launches are recorded and compiled by ``tests/_sm90_compile.py``
(:func:`record_launches`, :func:`compile_sm90`), here with the pointers marked
16-byte aligned, the integer sizes divisible by 16 marked so and floats typed fp32,
as at an eager launch.
Without those marks Triton can neither vectorize nor pipeline the loads and every
kernel reports 255 registers and spills. Prints one row per kernel: registers and
stack bytes per thread (``cuobjdump -res-usage`` of the cubin), shared memory, warps,
stages and constexprs. Tiles that depend on the multiprocessor count are chosen as
for ``--sms`` (132, an H200). Use the Triton of the target machine: the H200 image
has 3.6.0, so ``pip install --target /tmp/t36 --no-deps triton==3.6.0`` and
``PYTHONPATH=/tmp/t36 python benchmarks/kernel_resources.py``.
Run: ``python benchmarks/kernel_resources.py [--shape BxTxHxK] [--dtype bf16|fp16|fp32]``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _sm90_compile import compile_sm90, record_launches  # noqa: E402 (pops TRITON_INTERPRET)

import torch  # noqa: E402
import triton  # noqa: E402

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resources(compiled) -> str:
    """``REG:n STACK:m`` of a compiled kernel's cubin."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        report = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True,
                                text=True).stdout
    line = next((ln for ln in report.splitlines() if "REG:" in ln), "")
    return " ".join(line.split()[:2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="2x128x4x128", help="B x T x H x K (K = V)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    parser.add_argument("--sms", type=int, default=132, help="multiprocessors (H200: 132)")
    args = parser.parse_args()
    B, T, H, K = (int(s) for s in args.shape.split("x"))
    launches = record_launches(B, T, H, K, (_DTYPES[args.dtype],), sms=args.sms)
    print(f"triton {triton.__version__}, sm_90, {args.dtype}, B x T x H x K = {args.shape}")
    print("| kernel | registers, stack B | shared B | warps, stages | constexprs |")
    print("|---|---|---|---|---|")
    for name, (kernel, _, a, kw) in sorted(launches.items()):
        compiled = compile_sm90(kernel, a, kw, aligned=True, float_type="fp32")
        consts = dict(zip(kernel.arg_names, a), **kw)
        shown = {n: consts[n] for i, n in enumerate(kernel.arg_names)
                 if kernel.params[i].is_constexpr and n.isupper()}
        print(f"| {name} | {resources(compiled)} | {compiled.metadata.shared} "
              f"| {kw.get('num_warps', 4)}, {kw.get('num_stages', '-')} | {shown} |", flush=True)


if __name__ == "__main__":
    main()
