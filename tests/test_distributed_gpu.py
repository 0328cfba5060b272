"""Context and tensor parallelism on CUDA with the Triton kernels (skipped without CUDA).

* A one-rank group (NCCL, else gloo): kdn_compile.distributed's functions equal the
  plain ones, outputs, final states and gradients, eager and compiled (fullgraph).
* 2 and 4 ranks run rank by rank in one process (tests/_context_parallel.py): every
  rank's two kernel runs (from the known states and from the identity, packed
  sequences cut at the rank boundaries, empty pieces included) chained as the
  exchange ops chain them equal the plain kernel call on the whole sequence.
* A one-rank CUDA mesh: the kernel ops on head-sharded DTensors (their rules place
  the kernels' saved tensors) and the layers under tensor_parallel_plan, compiled
  with Inductor and fullgraph=True, equal the plain ones.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from _context_parallel import emulate_delta, emulate_kdn
from _helpers import assert_close
from _inputs import family_inputs

import kdn_compile
import kdn_compile.distributed as kd
from kdn_compile.layers import DiagKDN, GatedDeltaNet, KimiDeltaAttention

pytestmark = pytest.mark.gpu

KDN_OPTIONS = dict(scale=64 ** -0.5, info_scale=0.7)
# T = 512: an empty sequence, sequences across the boundaries of 2 and 4 ranks (256;
# 128, 256), one starting on a boundary of 4 (384), one shorter than a chunk
PACKED = [0, 40, 40, 200, 300, 384, 512]
# kernels against kernels over different chunk alignments: float32 rounding; bfloat16
# inputs keep the kernels' intermediates in bfloat16, the slice maps A included, and
# round the identity run's output u once more
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
# one rank runs the plain op's own kernel calls: equal but for the states' dtype casts
ONE_RANK = {torch.float32: 1e-6, torch.bfloat16: 1e-3}


def _slow_inputs(family, packed, dtype):
    """CUDA leaves of ``family_inputs`` at T = 512, K = V = 64, their decays slowed."""
    b, n = (1, len(PACKED) - 1) if packed else (2, None)
    x = family_inputs(family, b, 512, K=64, V=64, N=n, dtype=dtype)
    # decays slow enough (about e^-2.5 over 256 tokens) that each rank's state still
    # weighs on the next ranks' outputs
    gate = "log_alpha" if family == "kdn" else "g"
    x[gate] = x[gate] * 0.02
    return {name: t.cuda().requires_grad_() for name, t in x.items()}


def _call(module, family, x, packed, **extra):
    cu = torch.tensor(PACKED, device="cuda") if packed else None
    if family == "kdn":
        return module.diag_kdn(**x, **KDN_OPTIONS, cu_seqlens=cu, **extra)
    run = module.chunk_kda if family == "kda" else module.chunk_gdn
    return run(**x, cu_seqlens=cu, **extra)


def _grads(outputs, x, seed=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen, device="cuda")).sum()
               for o in outputs)
    names = [n for n, t in x.items() if t.requires_grad]
    return dict(zip(names, torch.autograd.grad(loss, [x[n] for n in names])))


@pytest.fixture(scope="module")
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    backend = "nccl" if dist.is_nccl_available() else "gloo"
    with tempfile.TemporaryDirectory() as folder:
        torch.cuda.set_device(0)
        dist.init_process_group(backend, init_method=f"file://{os.path.join(folder, 's')}",
                                rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("packed", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["fixed", "packed"])
@pytest.mark.parametrize("family", ["gdn", "kda", "kdn"])
def test_one_rank_equals_the_plain_function(one_rank_group, family, packed, dtype):
    x = _slow_inputs(family, packed, dtype)
    expected = _call(kdn_compile, family, x, packed)
    found = _call(kd, family, x, packed, group=one_rank_group)
    for i, (a, b) in enumerate(zip(found, expected)):
        assert_close(a, b, ONE_RANK[dtype], f"output {i}")
    expected_grads, found_grads = _grads(expected, x), _grads(found, x)
    for name, grad in expected_grads.items():
        assert_close(found_grads[name], grad, ONE_RANK[dtype], f"d{name}")


@pytest.mark.parametrize("family", ["gdn", "kdn"])
def test_one_rank_compiles_fullgraph(one_rank_group, family):
    x = _slow_inputs(family, True, torch.float32)
    expected = _grads(_call(kd, family, x, True, group=one_rank_group), x)
    torch._dynamo.reset()
    step = torch.compile(lambda leaves: _call(kd, family, leaves, True, group=one_rank_group),
                         fullgraph=True)
    found = _grads(step(x), x)
    for name, grad in expected.items():
        assert_close(found[name], grad, 1e-5, f"d{name}")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("packed", [False, True], ids=["fixed", "packed"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family", ["gdn", "kda", "kdn"])
def test_ranks_on_the_kernels_equal_one_call(family, world, packed, dtype):
    x = _slow_inputs(family, packed, dtype)
    cu = torch.tensor(PACKED, device="cuda") if packed else None
    expected = _call(kdn_compile, family, x, packed)
    if family == "kdn":
        o, *finals = emulate_kdn(world, **x, **KDN_OPTIONS, cu_seqlens=cu)
    else:
        run = kdn_compile.chunk_kda if family == "kda" else kdn_compile.chunk_gdn
        o, *finals = emulate_delta(run, world, **x, cu_seqlens=cu)
    tol = TOLERANCE[dtype]
    assert_close(o, expected[0], tol, "o")
    for i, per_rank in enumerate(finals):
        for rank, state in enumerate(per_rank):
            assert_close(state, expected[1 + i], tol, f"final {i} on rank {rank}")
    # every rank adds the final-state terms: once per rank in the one call
    gen = torch.Generator(device="cuda").manual_seed(1)
    weights = [torch.randn(t.shape, generator=gen, device="cuda") for t in expected]
    names = [n for n, t in x.items() if t.requires_grad]
    loss = (expected[0].float() * weights[0]).sum() + world * sum(
        (f * w).sum() for f, w in zip(expected[1:], weights[1:]))
    want = torch.autograd.grad(loss, [x[n] for n in names])
    loss = (o.float() * weights[0]).sum() + sum(
        (f * w).sum() for per_rank, w in zip(finals, weights[1:]) for f in per_rank)
    got = torch.autograd.grad(loss, [x[n] for n in names])
    for name, a, b in zip(names, got, want):
        assert_close(a, b, tol, f"d{name}")


# -- tensor parallelism over a one-rank CUDA mesh ------------------------------------------


def _head_sharded(x: dict, mesh) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def place(name):
        if name == "cu_seqlens":
            return [Replicate()]
        return [Shard(1 if name in ("initial_state", "memory", "precision") else 2)]

    return {n: distribute_tensor(t.detach(), mesh, place(n)).requires_grad_(t.requires_grad)
            for n, t in x.items()}


@pytest.mark.parametrize("dtype", [torch.float32,
                                   pytest.param(torch.bfloat16, marks=pytest.mark.slow)],
                         ids=["f32", "bf16"])
@pytest.mark.parametrize("family", ["gdn", "kda", "kdn"])
def test_kernel_ops_on_head_sharded_dtensors(one_rank_group, family, dtype):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (1,))
    x = _slow_inputs(family, False, dtype)
    expected = _call(kdn_compile, family, x, False)
    d = _head_sharded(x, mesh)
    found = _call(kdn_compile, family, d, False)
    for i, (a, b) in enumerate(zip(found, expected)):
        assert a.placements[0].is_shard(), f"output {i}: {a.placements}"
        assert_close(a.full_tensor(), b, ONE_RANK[dtype], f"output {i}")
    want = _grads(expected, x)
    got = _grads([o.full_tensor() for o in found], d)
    for name, grad in want.items():
        assert_close(got[name].full_tensor(), grad, ONE_RANK[dtype], f"d{name}")


@pytest.mark.slow
@pytest.mark.parametrize("cls", [GatedDeltaNet, KimiDeltaAttention, DiagKDN])
def test_tensor_parallel_layer_compiles_fullgraph(one_rank_group, cls):
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cuda", (1,))
    torch.manual_seed(0)
    layer = cls(256, 4, 64, chunk_size=64).cuda()
    single = copy.deepcopy(layer)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2, 128, 256, device="cuda", generator=gen)
    w = torch.randn(2, 128, 256, device="cuda", generator=gen)
    (single(x)[0] * w).sum().backward()
    parallelize_module(layer, mesh, kd.tensor_parallel_plan(layer))
    torch._dynamo.reset()
    step = torch.compile(lambda x: (layer(x)[0] * w).sum(), fullgraph=True)
    step(x).backward()
    for (name, p), (_, q) in zip(layer.named_parameters(), single.named_parameters()):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        assert_close(grad, q.grad, 1e-4, f"d{name}")
