"""On CUDA: GDN's and KDA's kernels with hard resets against float64, their local memory, Diag-KDN's
kernels at extreme noise against float64, debug mode's device-side asserts, and the kernel
ops under autocast. Skipped without CUDA.

The CPU suite checks the same numerics in the Triton interpreter at small sizes
(``test_numerics.py``) and debug mode's messages on the CPU (``test_debug_mode.py``).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
import triton

import kdn_compile
from _helpers import assert_close
from kdn_compile import reference as ref

pytestmark = pytest.mark.gpu

GRADS = ("q", "k", "v", "g", "beta", "initial_state")


def _reset_inputs(B, T, H, K, V, seed):
    """Small gates with hard resets: isolated ones from -1e3 to -1e5, a -inf, and one chunk of
    each sequence full of them (every fifth token)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    g = -0.1 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    resets = torch.rand(B, T, H, generator=gen) < 0.02
    magnitude = 10.0 ** (3.0 + 2.0 * torch.rand(B, T, H, generator=gen, dtype=torch.float64))
    g = torch.where(resets, -magnitude, g)
    g[:, 64:128:5] = -1e4
    g[0, 200, 0] = -math.inf
    return {
        "q": F.normalize(r(B, T, H, K), dim=-1), "k": F.normalize(r(B, T, H, K), dim=-1),
        "v": r(B, T, H, V), "g": g, "beta": torch.rand(B, T, H, generator=gen, dtype=torch.float64),
        "initial_state": r(B, H, K, V),
    }


def _check_hard_resets(x, run, reference, dtype, tol, dg_tol, floor, seed):
    """``run`` (a kernel op) on ``x`` (float64, CUDA) in ``dtype`` against ``reference`` in
    float64: outputs, final state and every gradient within ``tol`` (``dg`` within
    ``dg_tol``); ``dg`` zero where the gate is below ``floor``."""
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64).cuda()
    dstate = torch.randn(x["initial_state"].shape, generator=gen, dtype=torch.float64).cuda()

    expected = {n: t.clone().requires_grad_() for n, t in x.items()}
    o64, s64 = reference(**expected)
    ((o64 * do).sum() + (s64 * dstate).sum()).backward()

    leaves = {n: t.to(torch.float32 if n == "initial_state" else dtype).requires_grad_()
              for n, t in x.items()}
    with kdn_compile.use_backend("triton"):
        o, state = run(**leaves)
    ((o * do.to(o.dtype)).sum() + (state * dstate.float()).sum()).backward()

    assert_close(o, o64, tol, f"o (seed {seed})")
    assert_close(state, s64, tol, f"final state (seed {seed})")
    for name in GRADS:
        within = dg_tol if name == "g" else tol
        assert_close(leaves[name].grad, expected[name].grad, within, f"d{name} (seed {seed})")
    assert (leaves["g"].grad[x["g"] < floor] == 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)],
                         ids=["fp32", "bf16"])
def test_gdn_kernels_hard_resets_against_float64(dtype, tol, seed):
    """B=2, T=512, H=4, K=V=128: outputs, final state and every gradient within ``tol`` of the
    float64 reference; ``dg`` zero below the floor."""
    x = {n: t.cuda() for n, t in _reset_inputs(2, 512, 4, 128, 128, seed).items()}
    _check_hard_resets(x, kdn_compile.chunk_gdn, ref.chunk_gdn_reference, dtype, tol, tol,
                       ref.GDN_GATE_FLOOR, seed)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)],
                         ids=["fp32", "bf16"])
def test_kda_kernels_hard_resets_against_float64(dtype, tol, seed):
    """KDA at B=2, T=512, H=4, K=V=128 with the same resets on half the key channels (the
    others keep small gates): within ``tol`` of the float64 chunked reference (itself the
    token loop's to 1e-12, ``test_numerics.py``), bf16 ``dg`` with gates at the floor within
    2e-2 (the limitations page); ``dg`` zero below the kernels' floor (-20)."""
    x = _reset_inputs(2, 512, 4, 128, 128, seed)
    gen = torch.Generator().manual_seed(seed + 2)
    small = -0.1 * torch.rand(*x["g"].shape, 128, generator=gen, dtype=torch.float64)
    x["g"] = torch.cat([x["g"][..., None].expand(-1, -1, -1, 64), small[..., 64:]], dim=-1)
    x = {n: t.cuda() for n, t in x.items()}
    dg_tol = tol if dtype == torch.float32 else 2 * tol
    _check_hard_resets(x, kdn_compile.chunk_kda, ref.chunk_kda_reference, dtype, tol, dg_tol,
                       -20, seed)


@pytest.mark.slow
@pytest.mark.skipif(not triton.__version__.startswith("3.6."),
                    reason="the bound is the local memory Triton 3.6 gives this kernel")
def test_gdn_grad_kernel_local_memory():
    """The backward's grad kernel keeps at most 32 B a thread in local memory (bf16, K = V =
    128, sm_90: the whole-key tile of ``grad_config``, faster than two 64-key tiles that keep
    none); the message lists every GDN kernel's registers and local memory (run with ``-s``
    to see them when it passes)."""
    from kdn_compile.lowering import chunk_gdn_bwd, chunk_gdn_fwd

    x = {n: t.cuda() for n, t in _reset_inputs(1, 256, 2, 128, 128, 0).items()}
    leaves = {n: t.to(torch.float32 if n == "initial_state" else torch.bfloat16)
              .requires_grad_() for n, t in x.items()}
    with kdn_compile.use_backend("triton"):
        o, state = kdn_compile.chunk_gdn(**leaves)
    (o.float().sum() + state.sum()).backward()
    torch.cuda.synchronize()
    found = {}
    kernels = [getattr(chunk_gdn_fwd, n) for n in ("_chunk_gdn_prepare_kernel",
                                                   "_chunk_gdn_fwd_kernel")]
    kernels += [getattr(chunk_gdn_bwd, n) for n in ("_chunk_gdn_bwd_state_kernel",
                                                    "_chunk_gdn_bwd_grad_kernel")]
    for kernel in kernels:
        for cache in kernel.device_caches.values():
            for compiled in cache[0].values():
                # Triton reports local memory in 4-byte words
                found[kernel.fn.__name__] = (compiled.n_regs, 4 * compiled.n_spills)
    report = ", ".join(f"{n}: {r} registers, {s} B local" for n, (r, s) in found.items())
    print(report)
    assert "_chunk_gdn_bwd_grad_kernel" in found, report
    assert found["_chunk_gdn_bwd_grad_kernel"][1] <= 32, report


KDN_NAMES = ("q", "k", "v", "log_alpha", "omega", "r", "memory", "precision")


@pytest.mark.slow
def test_diag_kdn_kernels_extreme_noise_against_float64():
    """B=2, T=512, H=4, K=V=128, float32, the gain and memory kernels: a tiny ``r`` on one
    head, subnormal ``r`` at a few tokens, a huge ``omega`` with a tiny ``r`` on another; the
    outputs, and every gradient of a loss on ``o``, within 1e-4 of the float64 token loop."""
    from _inputs import kdn_inputs

    torch.backends.cuda.matmul.allow_tf32 = False
    x = kdn_inputs(B=2, T=512, H=4, K=128, V=128)
    x["r"][:, :, 0] = 1e-25
    x["r"][:, 100:400:50, 1] = 1e-44
    x["r"][:, :, 2], x["omega"][:, :, 2] = 1e-25, 1e20
    x = {n: t.cuda() for n, t in x.items()}
    kwargs = {"scale": 128**-0.5, "info_scale": 1.0}
    do = torch.randn(x["v"].shape, generator=torch.Generator().manual_seed(1),
                     dtype=torch.float64).cuda()
    expected = {n: t.clone().requires_grad_() for n, t in x.items()}
    found64 = ref.diag_kdn_recurrent(*(expected[n] for n in KDN_NAMES), **kwargs)
    (found64[0] * do).sum().backward()
    leaves = {n: t.float().requires_grad_() for n, t in x.items()}
    with kdn_compile.use_backend("triton"):
        found = kdn_compile.diag_kdn(*(leaves[n] for n in KDN_NAMES), **kwargs)
    (found[0] * do.float()).sum().backward()
    for what, a, e in zip(("o", "memory", "precision"), found, found64):
        assert_close(a, e, 1e-4, what)
    for name in KDN_NAMES:
        assert_close(leaves[name].grad, expected[name].grad, 1e-4, f"d{name}")


_DEBUG_SCRIPT = textwrap.dedent("""
    import sys, torch, kdn_compile
    B, T, H, K = 1, 70, 2, 64
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1)
    v, beta = torch.randn(B, T, H, K, device="cuda"), torch.rand(B, T, H, device="cuda")
    g = -torch.rand(B, T, H, device="cuda")
    g[0, 33, 1] = 0.5
    fn = kdn_compile.chunk_gdn
    if sys.argv[1] == "compiled":
        fn = torch.compile(fn, fullgraph=True)
    fn(q, q, v, g, beta)
    torch.cuda.synchronize()
""")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_debug_mode_device_assert(mode):
    """With KDN_DEBUG=1 a positive gate fails the process with a device-side assert (no host
    sync at the call); compiled, the assert carries the message naming the argument."""
    env = dict(os.environ, KDN_DEBUG="1")
    done = subprocess.run([sys.executable, "-c", _DEBUG_SCRIPT, mode], env=env,
                          capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert "device-side assert" in output or "Assertion" in output, output[-3000:]
    if mode == "compiled":
        assert "chunk_gdn: g must be <= 0 and not NaN" in output, output[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["chunk_gdn", "chunk_kda", "diag_kdn"])
def test_kernels_under_autocast_compute_as_outside(name):
    """autocast(cuda, bfloat16) leaves the kernel ops alone: bfloat16 q, k, v with float32
    gates give the outputs and gradients (and dtypes) of outside it, eager and compiled."""
    from _inputs import delta_inputs, kdn_inputs

    if name == "diag_kdn":
        x = kdn_inputs(B=1, T=130, H=2, K=64, V=64)
        call = lambda **t: kdn_compile.diag_kdn(**t, scale=0.125, info_scale=0.8)  # noqa: E731
    else:
        x = delta_inputs(B=1, T=130, Hk=2, Hv=2, K=64, V=64, per_key=name == "chunk_kda")
        call = getattr(kdn_compile, name)
    half = ("q", "k", "v")
    x = {n: t.to("cuda", torch.bfloat16 if n in half else torch.float32).requires_grad_()
         for n, t in x.items()}
    compiled = torch.compile(call, fullgraph=True)
    for run in (call, compiled):
        expected = run(**x)
        expected_grads = torch.autograd.grad(sum(o.float().sum() for o in expected),
                                             list(x.values()))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got = run(**x)
        grads = torch.autograd.grad(sum(o.float().sum() for o in got), list(x.values()))
        for a, b in zip((*got, *grads), (*expected, *expected_grads)):
            assert a.dtype == b.dtype
            # loose: the kernels' atomics may reorder sums; autocast inside would be far off
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-3)
