"""Prefix-cache checkpoints on CUDA: a float32 checkpoint slot holds bit for bit the state
that prefilling its prefix alone leaves, and a prompt resumed from it continues the whole
prompt bit for bit (outputs of the remaining tokens and the final state); Diag-KDN's
checkpoints against float64. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import kdn_compile
from _inputs import delta_inputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("per_key", [False, True], ids=["gdn", "kda"])
def test_resuming_from_a_checkpoint_is_bit_for_bit(per_key, dtype, seed):
    lengths, H, K, V, every = [320, 64, 1000, 256], 16, 128, 128, 128
    plain = kdn_compile.chunk_kda if per_key else kdn_compile.chunk_gdn
    x = delta_inputs(1, sum(lengths), H, H, K, V, per_key=per_key, dtype=dtype, seed=seed,
                     with_state=False, device="cuda")
    h0 = torch.randn(len(lengths), H, K, V, generator=torch.Generator().manual_seed(seed))
    h0 = h0.cuda()
    cu = torch.tensor([0] + lengths).cumsum(0)
    count = max(lengths) // every
    slots = torch.arange(len(lengths) * count).view(len(lengths), count)
    pool = torch.full((slots.numel(), H, K, V), float("nan"), device="cuda")
    with torch.no_grad():
        o, final = kdn_compile.chunk_checkpoints(
            *x.values(), pool, slots.cuda(), checkpoint_every=every, initial_state=h0,
            cu_seqlens=cu.cuda())
        for n, length in enumerate(lengths):
            a = cu[n].item()
            for c in range(length // every):
                m = (c + 1) * every
                slot = slots[n, c].item()
                head = {name: t[:, a:a + m] for name, t in x.items()}
                assert torch.equal(plain(*head.values(), initial_state=h0[n:n + 1])[1][0],
                                   pool[slot]), (n, c)
                rest = {name: t[:, a + m:a + length] for name, t in x.items()}
                o_rest, final_rest = plain(*rest.values(), initial_state=pool[slot:slot + 1])
                assert torch.equal(o_rest, o[:, a + m:a + length]), (n, c)
                assert torch.equal(final_rest[0], final[n]), (n, c)


def test_diag_kdn_checkpoints_against_float64(seed):
    from _inputs import kdn_inputs
    from kdn_compile.checkpoints import diag_kdn_prefill_states
    from kdn_compile.reference import diag_kdn_reference

    lengths, H, K, V, every = [320, 64, 200], 4, 128, 128, 64
    cu = torch.tensor([0] + lengths).cumsum(0)
    kd = kdn_inputs(B=1, T=sum(lengths), H=H, K=K, V=V, dtype=torch.float32, N=3, seed=seed,
                    device="cuda")
    names = ("q", "k", "v", "log_alpha", "omega", "r", "memory", "precision")
    args = [kd[n].to(torch.bfloat16) if n in ("q", "k", "v") else kd[n] for n in names]
    with torch.no_grad():
        out = diag_kdn_prefill_states(*args, checkpoint_every=every, checkpoints=5,
                                      scale=K ** -0.5, info_scale=1.0, cu_seqlens=cu.cuda())
    memories, precisions = out[3].view(3, 5, H, K, V), out[4].view(3, 5, H, K)
    for n, length in enumerate(lengths):
        for c in range(5):
            m = (c + 1) * every
            if m > length:
                assert not memories[n, c].any() and not precisions[n, c].any(), (n, c)
                continue
            a = cu[n].item()
            head = [t[:, a:a + m].double() for t in args[:6]]
            _, m64, p64 = diag_kdn_reference(*head, args[6][n:n + 1].double(),
                                             args[7][n:n + 1].double(), scale=K ** -0.5,
                                             info_scale=1.0)
            err_m = (memories[n, c].double() - m64[0]).norm() / m64[0].norm()
            err_p = (precisions[n, c].double() - p64[0]).norm() / p64[0].norm()
            assert err_m < 2e-2 and err_p < 1e-4, (n, c, err_m.item(), err_p.item())
