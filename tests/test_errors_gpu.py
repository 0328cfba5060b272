"""Argument errors and the double-backward error on CUDA, where the kernel ops run (torch 2.11
on the GPU machine): compiled with Inductor, the layer's state check, and the NotImplementedError
of a backward through the kernels' gradients. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import kdn_compile
from _inputs import delta_inputs, kdn_inputs
from kdn_compile.layers import GatedDeltaNet, KimiDeltaAttention

pytestmark = pytest.mark.gpu


def _cuda(x, dtype=torch.bfloat16):
    return {n: t.to("cuda", dtype) for n, t in x.items()}


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_errors_on_cuda(dynamic):
    compiled = torch.compile(kdn_compile.chunk_gdn, fullgraph=True, dynamic=dynamic)
    x = _cuda(delta_inputs(B=2, T=128, Hk=2, Hv=4, K=64, V=64))
    compiled(**x)  # compiles: the kernel op
    with pytest.raises(ValueError, match=r"g must have shape \(2, 128, 4\), got \(2, 128, 4, 64\)"):
        compiled(**dict(x, g=x["g"][..., None].expand(-1, -1, -1, 64)))
    with pytest.raises(ValueError, match=r"initial_state is on cpu but q is on cuda:0"):
        compiled(**dict(x, initial_state=x["initial_state"].cpu()))


def test_layer_state_of_another_layer_type_on_cuda():
    torch.manual_seed(0)
    gdn = GatedDeltaNet(128, 2, 64).cuda()
    kda = torch.compile(KimiDeltaAttention(128, 2, 64).cuda(), fullgraph=True)
    x = torch.randn(1, 64, 128, device="cuda")
    _, state = gdn(x)
    with pytest.raises(ValueError, match=r"state was made by GatedDeltaNet\(hidden_size=128, "):
        kda(x, state)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["chunk_gdn", "chunk_kda", "diag_kdn"])
def test_double_backward_of_the_kernels_names_the_op(name):
    if name == "diag_kdn":
        x = _cuda(kdn_inputs(B=1, T=128, H=2, K=64, V=64), torch.float32)
        extra = {"scale": 0.125, "info_scale": 1.0}
    else:
        per_key = name == "chunk_kda"
        x = _cuda(delta_inputs(B=1, T=128, Hk=2, Hv=2, K=64, V=64, per_key=per_key),
                  torch.float32)
        extra = {}
    x = {n: t.requires_grad_() for n, t in x.items()}
    o = getattr(kdn_compile, name)(**x, **extra)[0]
    (dv,) = torch.autograd.grad(o.square().sum(), x["v"], create_graph=True)
    with pytest.raises(NotImplementedError, match=rf"kdn::{name} has no double backward"):
        dv.sum().backward()
