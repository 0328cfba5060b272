"""Registers, stack (spills) and shared memory of every Triton kernel, compiled for sm_90
without a GPU, at a benchmark shape.

Each op runs its launchers' host code on CPU tensors (``wrap_triton`` replaced by a
recorder, as ``tests/_sm90_compile.py`` does); each recorded kernel is then compiled
by Triton's CUDA backend for an H100/H200 with the pointers marked 16-byte aligned
and the integer sizes divisible by 16 marked so, as at run time. Without those marks
Triton can neither vectorize nor pipeline the loads and every kernel reports 255
registers and spills. Prints one line per kernel: registers and stack bytes per
thread (``cuobjdump -res-usage`` of the cubin), shared memory, warps, stages and
constexprs. Use the Triton of the target machine: the H200 image has 3.6.0, so
``pip install --target /tmp/t36 --no-deps triton==3.6.0`` and
``PYTHONPATH=/tmp/t36 python benchmarks/kernel_resources.py``.
Tiles that depend on the multiprocessor count are chosen as for ``--sms`` (132, an
H200). Run: ``python benchmarks/kernel_resources.py [--shape BxTxHxK] [--dtype bf16|fp16|fp32]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # real JIT functions, for the compiler

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import kdn_compile  # noqa: E402
from _helpers import launch_recorder, launcher_modules  # noqa: E402
from kdn_compile.ops import gdn, kda, kdn  # noqa: E402

_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.int32: "i32", torch.int64: "i64"}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def record(B, T, H, K, dtype, sms) -> dict:
    """One recorded launch per kernel of GDN, KDA and Diag-KDN, forward and backward,
    with tiles chosen as for a GPU of ``sms`` multiprocessors."""
    launches: list = []
    for module in launcher_modules():
        module.wrap_triton = launch_recorder(launches)
        if hasattr(module, "sm_count"):
            module.sm_count = lambda device: sms
    for module in (gdn, kda, kdn):
        module.can_launch = lambda x: True
    os.environ["TRITON_INTERPRET"] = "1"  # the gain's support check reads it at call time
    try:
        leaf = lambda t: t.to(dtype).requires_grad_()  # noqa: E731
        q, k = (leaf(F.normalize(torch.randn(B, T, H, K), dim=-1)) for _ in "qk")
        v = leaf(torch.randn(B, T, H, K))
        beta = leaf(torch.rand(B, T, H))
        h0 = torch.randn(B, H, K, K).requires_grad_()
        with kdn_compile.use_backend("triton"):
            for g in (-torch.rand(B, T, H), -torch.rand(B, T, H, K)):
                fn = kdn_compile.chunk_gdn if g.dim() == 3 else kdn_compile.chunk_kda
                o, s = fn(q, k, v, g.requires_grad_(), beta, initial_state=h0)
                torch.autograd.grad(o.sum() + s.sum(), [q, k, v])
            x = {n: leaf(torch.randn(B, T, H, K)) for n in ("log_alpha", "omega")}
            with torch.no_grad():
                x["log_alpha"].copy_(-x["log_alpha"].abs())
            out = kdn_compile.diag_kdn(q, k, v, x["log_alpha"], x["omega"],
                                       leaf(torch.rand(B, T, H) + 0.5), torch.zeros(B, H, K, K),
                                       torch.ones(B, H, K), scale=K ** -0.5, info_scale=1.0)
            torch.autograd.grad(out[0].sum(), [q, k])
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
    first: dict = {}
    for kernel, grid, args, kwargs in launches:
        first.setdefault(kernel.fn.__name__, (kernel, grid, args, kwargs))
    return first


def compile_sm90(kernel, args, kwargs):
    bound = dict(zip(kernel.arg_names, args), **kwargs)
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        value = bound[name]
        if kernel.params[i].is_constexpr or value is None:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    options = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options), constexprs


def resources(compiled) -> str:
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
    print(f"triton {triton.__version__}, sm_90, {args.dtype}, B x T x H x K = {args.shape}")
    print("| kernel | registers, stack B | shared B | warps, stages | constexprs |")
    print("|---|---|---|---|---|")
    for name, (kernel, grid, a, kw) in sorted(record(B, T, H, K, _DTYPES[args.dtype], args.sms).items()):
        compiled, consts = compile_sm90(kernel, a, kw)
        shown = {k: v for k, v in consts.items() if k.isupper() and v is not None}
        print(f"| {name} | {resources(compiled)} | {compiled.metadata.shared} "
              f"| {kw.get('num_warps', 4)}, {kw.get('num_stages', '-')} | {shown} |", flush=True)


if __name__ == "__main__":
    main()
