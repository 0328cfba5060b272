"""Compile every Triton kernel for sm_90 with the argument types Inductor gives it.

Run as a script without ``TRITON_INTERPRET`` (``@triton.jit`` must build real
JIT functions). The op layer is forced onto the kernel path on CPU tensors and
``wrap_triton`` is replaced by a recorder, so each launcher runs its host code
(grids, allocations, arguments) and records its launches without running them. Per
kernel and sequence layout (fixed length, packed), the launch on its common path and
the one with the most extra paths (the constexpr flags of :data:`_PATH_FLAGS`) are then
compiled by Triton for an H100/H200 (``GPUTarget("cuda", 90, 32)``, no GPU needed) with
Python floats typed ``fp64`` and ints ``i32``, as Inductor's generated code types them.
Prints one line per kernel, ``ok`` or the error, and exits non-zero if any failed, or if
torch's mutation analysis of ``wrap_triton`` sees any launch (fixed length or packed)
write an index tensor such as ``cu_seqlens`` (see ``lowering/_launch.py``). That analysis
is the installed torch's: torch 2.11's ``identify_mutated_tensors`` (scalars folded in as
constants) or the ``identify_accessed_tensors`` of later versions.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import types
import unittest.mock
from concurrent.futures import ProcessPoolExecutor

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kdn_compile  # noqa: E402
from _helpers import launch_recorder, launcher_modules  # noqa: E402
from kdn_compile.ops import (  # noqa: E402
    checkpoints, decode, fp8, gdn, gdn_wy, kda, kdn, recurrent, slots,
)


def _type(value, float_type: str) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + {torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16",
                      torch.float16: "fp16",
                      torch.int32: "i32", torch.int64: "i64",
                      torch.float8_e4m3fn: "fp8e4nv", torch.bool: "i1"}[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32"
    if isinstance(value, float):
        return float_type
    raise TypeError(f"unexpected kernel argument {value!r}")


def compile_sm90(kernel, args, kwargs, aligned: bool = False, float_type: str = "fp64"):
    """Compile one recorded launch for sm_90.

    ``aligned`` marks tensor pointers and ints divisible by 16 as such
    (``tt.divisibility``), as Triton specializes them at run time. Python floats are
    typed ``float_type``: ``fp64`` is what Inductor's generated launcher declares,
    ``fp32`` what an eager launch passes.
    """
    names = kernel.arg_names
    # recorded under TRITON_INTERPRET=1: compiled as the GPU launches them (no interpreter
    # workarounds)
    kwargs = {n: False if n in _INTERPRETER_FLAGS else v for n, v in kwargs.items()}
    bound = dict(zip(names, args), **kwargs)
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(names):
        value = bound[name]
        if kernel.params[i].is_constexpr or value is None:
            signature[name], constexprs[name] = "constexpr", value
            continue
        signature[name] = _type(value, float_type)
        aligned_value = isinstance(value, torch.Tensor) or (
            signature[name] == "i32" and value % 16 == 0)
        if aligned and aligned_value:
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}
    if getattr(kernel, "debug", None):  # as its launches (and Inductor) compile it: device
        options.update(debug=True, sanitize_overflow=False)  # asserts in, no overflow checks
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _run_ops(B, T, H, K, dtypes):
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    for dtype in dtypes:
        q, k = (F.normalize(r(B, T, H, K), dim=-1).to(dtype).requires_grad_() for _ in "qk")
        v = r(B, T, H, K).to(dtype).requires_grad_()
        beta = torch.rand(B, T, H, generator=gen).to(dtype).requires_grad_()
        h0 = r(B, H, K, K).requires_grad_()
        for g in (-torch.rand(B, T, H, generator=gen), -torch.rand(B, T, H, K, generator=gen)):
            fn = kdn_compile.chunk_gdn if g.dim() == 3 else kdn_compile.chunk_kda
            for cu in (None, torch.tensor([0, T * 3 // 7, T])):
                b = 1 if cu is not None else B
                o, s = fn(q[:b], k[:b], v[:b], g[:b].to(dtype).requires_grad_(), beta[:b],
                          initial_state=h0[:b] if cu is None else h0[:1].expand(2, -1, -1, -1),
                          cu_seqlens=cu)
                torch.autograd.grad(o.sum() + s.sum(), [q, k, v])
        # FP8 state quantization: its recurrence and gradient variants, the standalone QDQ
        o, s = kdn_compile.chunk_gdn(q, k, v, -torch.rand(B, T, H, generator=gen).to(dtype),
                                     beta, initial_state=h0, state_qdq=True)
        torch.autograd.grad(o.sum() + s.sum(), [q, k, v])
        kdn_compile.state_fp8_qdq(h0.detach().to(dtype), 48)
        kdn_compile.state_fp8_qdq(r(B, H, 3 * K, K).to(dtype))
        # w_quantizer: the WY operands and the recurrence from them, with and without QDQ
        for state_qdq in (False, True):
            o, s = kdn_compile.chunk_gdn(q, k, v, -torch.rand(B, T, H, generator=gen).to(dtype),
                                         beta, initial_state=h0, state_qdq=state_qdq,
                                         w_quantizer=lambda w: 0.5 * w)
            torch.autograd.grad(o.sum() + s.sum(), [q, k, v])
        x = {n: r(B, T, H, K).to(dtype).requires_grad_() for n in ("q", "k", "v", "log_alpha",
                                                                   "omega")}
        with torch.no_grad():
            x["log_alpha"].copy_(-x["log_alpha"].abs())
        rr = torch.rand(B, T, H, generator=gen).to(dtype).requires_grad_()
        memory, precision = torch.zeros(B, H, K, K), torch.ones(B, H, K)
        out = kdn_compile.diag_kdn(x["q"], x["k"], x["v"], x["log_alpha"], x["omega"], rr,
                                   memory, precision, scale=0.125, info_scale=1.0)
        torch.autograd.grad(out[0].sum(), [x["q"], x["k"]])
        # packed: the chunk table of the gain and of the memory from cu_seqlens
        cu = torch.tensor([0, T * 3 // 7, T * 3 // 7, T])
        out = kdn_compile.diag_kdn(*(x[n][:1] for n in ("q", "k", "v", "log_alpha", "omega")),
                                   rr[:1], memory[:1].expand(3, -1, -1, -1).requires_grad_(),
                                   precision[:1].expand(3, -1, -1).requires_grad_(),
                                   scale=0.125, info_scale=1.0, cu_seqlens=cu)
        torch.autograd.grad(sum(o.sum() for o in out), [x["q"], x["k"], x["omega"]])
        _run_decode(B, H, K, dtype, gen)


def _run_decode(B, H, K, dtype, gen):
    """The token recurrence (fixed length and packed), the decode steps over every pool and
    the slot writes of the layers' caches. Recorded launches run nothing, so the index flag they would write is not asserted on."""
    with unittest.mock.patch("torch._assert_async"):
        _decode_calls(H, K, dtype, gen)


def _decode_calls(H, K, dtype, gen):
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = (r(2, 3, H, K).to(dtype) for _ in "qkv")
    beta = torch.rand(2, 3, H, generator=gen).to(dtype)
    for g in (-torch.rand(2, 3, H, generator=gen), -torch.rand(2, 3, H, K, generator=gen)):
        kdn_compile.recurrent_delta_rule(q, k, v, g, beta, initial_state=r(2, H, K, K))
        kdn_compile.recurrent_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1],
                                         cu_seqlens=torch.tensor([0, 1, 3]))
        slots = torch.tensor([1, -1])
        for pool_dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
            pool = torch.zeros(3, H, K, K).to(pool_dtype)
            scales = torch.ones(3, H, -(-K // 64)) if pool_dtype == torch.float8_e4m3fn else None
            inter = torch.zeros(2, 3, H, K, K)
            kdn_compile.delta_rule_decode(q, k, v, g, beta, pool, slots, pool_scales=scales,
                                          intermediate_states=inter)
    la, om = -torch.rand(2, 3, H, K, generator=gen), torch.rand(2, 3, H, K, generator=gen)
    kdn_compile.diag_kdn_decode(q, k, v, la, om, torch.rand(2, 3, H, generator=gen) + 0.1,
                                torch.zeros(3, H, K, K), torch.ones(3, H, K), slots,
                                scale=0.125, info_scale=1.0)
    # a prefill keeping prefix-cache checkpoints, GDN and KDA, packed
    cu = torch.tensor([0, 1, 3])
    for g in (-torch.rand(1, 3, H, generator=gen), -torch.rand(1, 3, H, K, generator=gen)):
        kdn_compile.chunk_checkpoints(q[:1], k[:1], v[:1], g, beta[:1], torch.zeros(3, H, K, K),
                                      torch.tensor([[0], [1]]), checkpoint_every=64,
                                      cu_seqlens=cu)
    # the layers' caches: rows into pool slots, padding rows skipped
    torch.ops.kdn.scatter_slots(torch.zeros(3, H, K), slots, r(2, H, K))


def record_launches(B=1, T=70, H=2, K=64, dtypes=(torch.bfloat16, torch.float32), sms=None,
                    every=False):
    """``{kernel name: (kernel, grid, args, kwargs)}``: the first launch of every kernel
    by GDN, KDA and Diag-KDN (fixed length and packed; forward and backward) on CPU
    tensors of ``B x T x H x K`` (``K = V``), with tiles chosen as for ``sms``
    multiprocessors when given; with ``every``, the list of all launches. Patches the
    launcher modules for good (a script's job)."""
    launches: list = []
    record = launch_recorder(launches)
    for module in launcher_modules():
        module.wrap_triton = record
        if hasattr(module, "_launch"):  # its eager launches, direct, recorded too
            module._launch = lambda kernel, grid, like: record(kernel)[grid]
        if sms is not None and hasattr(module, "sm_count"):
            module.sm_count = lambda device: sms
    for module in (gdn, gdn_wy, kda, kdn, recurrent, decode, slots, fp8, checkpoints):
        module.can_launch = lambda x: True
    # The kernels are real JIT functions by now; the gain's support check reads this
    # variable at call time to allow CPU tensors.
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        with kdn_compile.use_backend("triton"):
            _run_ops(B, T, H, K, dtypes)
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
    if every:
        return launches
    first = {}
    for kernel, grid, args, kwargs in launches:
        first.setdefault(kernel.fn.__name__, (kernel, grid, args, kwargs))
    return first


_INDEX_TENSORS = {"cu_seqlens", "offsets", "spans", "chunk_offsets", "indices"}


def written_indices(kernel, args, kwargs) -> set[str]:
    """Index tensors that torch's mutation analysis of ``wrap_triton`` sees ``kernel``
    write (it analyses the TTIR for sm_90; it must not fall back to "all written")."""
    import torch._higher_order_ops.triton_kernel_wrap as wrap

    bound = dict(zip(kernel.arg_names, args), **kwargs)
    bound = {k: v for k, v in bound.items() if k not in ("num_warps", "num_stages")}
    if hasattr(wrap, "identify_accessed_tensors"):
        writes = {dep.name for dep in wrap.identify_accessed_tensors(kernel, bound, {})
                  .read_writes.writes}
    else:  # torch < 2.12 (the GPU machine's 2.11): the same analysis, writes only
        writes = set(wrap.identify_mutated_tensors(kernel, bound, {}))
    if writes >= {k for k, v in bound.items() if isinstance(v, torch.Tensor)}:
        raise RuntimeError("mutation analysis failed: every tensor counted as written")
    return writes & _INDEX_TENSORS


# Constexpr flags that add code paths to a kernel (each a superset of the path without it).
_PATH_FLAGS = ("STATE_QDQ", "QBV", "WALK", "WY", "WITH_M", "WITH_AI", "CHECKPOINTS", "SLOTS",
               "INTER")
# constexprs true only in Triton's interpreter
_INTERPRETER_FLAGS = ("SOFT_CAST", "INTERPRETED")


def variant(kernel, kwargs) -> str:
    """A kernel's name, with the path flags it was launched with (and ``packed``)."""
    flags = [f"{f}={kwargs[f]}" for f in _PATH_FLAGS if f in kwargs]
    flags += ["packed"] if _packed(kwargs) else []
    return kernel.fn.__name__ + (f"[{','.join(flags)}]" if flags else "")


def _packed(kwargs) -> bool:
    """A launch specialized for packed sequences: ``IS_VARLEN`` (the token recurrence's
    ``VARLEN``). The two-key kernels read a chunk table either way."""
    return bool(kwargs.get("IS_VARLEN", kwargs.get("VARLEN", False)))


def _paths(kwargs) -> int:
    return sum(bool(kwargs[f]) for f in _PATH_FLAGS if f in kwargs)


def compiled_variants(launches) -> dict:
    """``{variant: (kernel, args, kwargs)}``: per kernel and sequence layout (fixed length,
    packed), the first launch with no path flag set (the common path) and the one with the
    most set (every other path's code)."""
    plain, fullest = {}, {}
    for kernel, _, args, kwargs in launches:
        name = (kernel.fn.__name__, _packed(kwargs))
        if _paths(kwargs) == 0:
            plain.setdefault(name, (kernel, args, kwargs))
        if name not in fullest or _paths(kwargs) > _paths(fullest[name][2]):
            fullest[name] = (kernel, args, kwargs)
    chosen = list(plain.values()) + list(fullest.values())
    return {variant(k, kw): (k, a, kw) for k, a, kw in chosen}


def _analysis_key(kernel, args, kwargs):
    """What the mutation analysis of a launch reads: the kernel, each tensor's dtype and
    16-byte alignment, every other value."""
    bound = dict(zip(kernel.arg_names, args), **kwargs)
    return kernel.fn, tuple(
        (k, (v.dtype, v.data_ptr() % 16) if isinstance(v, torch.Tensor) else repr(v))
        for k, v in bound.items())


# The work of the pool's processes, which fork from the one that recorded it.
_WORK: dict = {}


def _analyse(index) -> str | None:
    kernel, args, kwargs = _WORK["launches"][index]
    written = written_indices(kernel, args, kwargs)
    return f"{kernel.fn.__name__} {sorted(written)}" if written else None


def _compile(name) -> str:
    kernel, args, kwargs = _WORK["variant"][name]
    try:
        compile_sm90(kernel, args, kwargs)
        return f"ok {name}"
    except Exception as e:  # noqa: BLE001 - report every kernel
        return f"FAIL {name}: {type(e).__name__}: {str(e)[-2000:]}"


def main() -> int:
    launches = record_launches(every=True)
    first = compiled_variants(launches)
    # torch's analysis asks the active driver for the target: give it sm_90 without a GPU
    triton.runtime.driver.set_active(types.SimpleNamespace(
        get_current_target=lambda: GPUTarget("cuda", 90, 32)))
    # each distinct launch analysed once; analyses and compiles spread over the CPUs
    distinct = {_analysis_key(k, a, kw): (k, a, kw) for k, _, a, kw in launches}
    _WORK["launches"], _WORK["variant"] = list(distinct.values()), first
    workers = min(4, len(os.sched_getaffinity(0)))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        seen = {line for line in pool.map(_analyse, range(len(distinct))) if line}
        for line in sorted(seen):
            print(f"WRITES INDEX {line}")
        print(f"{len(seen)} kernels write index tensors")
        results = list(pool.map(_compile, sorted(first)))
    for line in results:
        print(line)
    failed = sum(line.startswith("FAIL") for line in results)
    print(f"{len(first)} kernels, {failed} failed")
    return 1 if failed or seen or not first else 0


if __name__ == "__main__":
    sys.exit(main())
