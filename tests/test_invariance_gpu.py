"""Batch invariance on CUDA: a row's decode outputs and pool slot, and a chunk-aligned
packed sequence's outputs and final state, are bit for bit what it gets alone, whatever
else is in the batch and however large the batch is. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import kdn_compile
from _inputs import delta_inputs, kdn_inputs
from kdn_compile.reference.fp8 import quantize_state_fp8

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn


def _pool(S, H, K, V, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    state = torch.randn(S, H, K, V, generator=gen).cuda()
    if dtype == FP8:
        return quantize_state_fp8(state)
    return state.to(dtype), None


def _rows(x, rows):
    return {n: t[rows] for n, t in x.items()}


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, FP8],
                         ids=["f32", "bf16", "fp8"])
@pytest.mark.parametrize("per_key", [False, True], ids=["gdn", "kda"])
def test_decode_row_does_not_depend_on_the_batch(T, pool_dtype, per_key, seed):
    # 64 rows x 16 heads and one row: the two sides of the token recurrence's launch tiers
    B, H, K, V = 64, 16, 128, 128
    x = delta_inputs(B, T, H, H, K, V, per_key=per_key, dtype=torch.bfloat16, seed=seed,
                     gate_scale=2.0, with_state=False, device="cuda")
    pool, scales = _pool(B, H, K, V, pool_dtype, seed)
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(seed)).cuda()
    idx = perm.to(torch.int32)
    solo_pool, solo_scales = pool.clone(), None if scales is None else scales.clone()
    o = kdn_compile.delta_rule_decode(*x.values(), pool, idx, pool_scales=scales)
    for row in (0, 37):
        o1 = kdn_compile.delta_rule_decode(*_rows(x, [row]).values(), solo_pool,
                                           idx[row:row + 1], pool_scales=solo_scales)
        slot = idx[row].item()
        assert torch.equal(o1[0], o[row]), (row, (o1[0] - o[row]).abs().max().item())
        assert torch.equal(solo_pool[slot].view(torch.uint8), pool[slot].view(torch.uint8))
        if scales is not None:
            assert torch.equal(solo_scales[slot], scales[slot])


@pytest.mark.parametrize("T", [1, 4])
def test_diag_kdn_decode_row_does_not_depend_on_the_batch(T, seed):
    B, H, K, V = 64, 16, 128, 128
    kd = kdn_inputs(B, T, H, K, V, seed=seed, dtype=torch.float32, device="cuda")
    names = ("q", "k", "v", "log_alpha", "omega", "r")
    x = {n: kd[n].to(torch.bfloat16) if n in ("q", "k", "v") else kd[n] for n in names}
    memory, precision = kd["memory"].clone(), kd["precision"].clone()
    idx = torch.randperm(B, generator=torch.Generator().manual_seed(seed)).cuda()
    solo_m, solo_p = memory.clone(), precision.clone()
    o = kdn_compile.diag_kdn_decode(*x.values(), memory, precision, idx, scale=K ** -0.5,
                                    info_scale=1.0)
    for row in (0, 37):
        o1 = kdn_compile.diag_kdn_decode(*_rows(x, [row]).values(), solo_m, solo_p,
                                         idx[row:row + 1], scale=K ** -0.5, info_scale=1.0)
        slot = idx[row].item()
        assert torch.equal(o1[0], o[row]), (row, (o1[0] - o[row]).abs().max().item())
        assert torch.equal(solo_m[slot], memory[slot])
        assert torch.equal(solo_p[slot], precision[slot])


@pytest.mark.parametrize("per_key", [False, True], ids=["gdn", "kda"])
def test_chunk_aligned_packed_sequence_does_not_depend_on_its_neighbours(per_key, seed):
    lengths, H, K, V = [128, 512, 64, 256], 16, 128, 128
    fn = kdn_compile.chunk_kda if per_key else kdn_compile.chunk_gdn
    total = sum(lengths)
    x = delta_inputs(1, total, H, H, K, V, per_key=per_key, dtype=torch.bfloat16, seed=seed,
                     with_state=False, device="cuda")
    h0 = torch.randn(len(lengths), H, K, V, generator=torch.Generator().manual_seed(seed)).cuda()
    bounds = torch.tensor([0] + lengths).cumsum(0)
    o, ht = fn(*x.values(), initial_state=h0, cu_seqlens=bounds.cuda())
    for i in range(len(lengths)):
        a, b = bounds[i].item(), bounds[i + 1].item()
        alone = {n: t[:, a:b] for n, t in x.items()}
        o1, h1 = fn(*alone.values(), initial_state=h0[i:i + 1])
        assert torch.equal(o1, o[:, a:b]), (i, (o1 - o[:, a:b]).abs().max().item())
        assert torch.equal(h1[0], ht[i]), (i, (h1[0] - ht[i]).abs().max().item())
    # the same sequence among equal-length rows of a batch
    same = {n: t[:, :256].repeat(4, *[1] * (t.dim() - 1)) for n, t in x.items()}
    same["v"][1:] = torch.randn_like(same["v"][1:])
    ob, hb = fn(*same.values(), initial_state=h0)
    o1, h1 = fn(*{n: t[:1] for n, t in same.items()}.values(), initial_state=h0[:1])
    assert torch.equal(ob[:1], o1) and torch.equal(hb[:1], h1)
