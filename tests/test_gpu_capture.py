"""Capture on CUDA: layers compile with fullgraph and show our Triton kernels in
Inductor's code, run under CUDA graphs, and package with AOTInductor. Skips without CUDA."""

from __future__ import annotations

import pytest
import torch

import kdn_compile.layers as layers
from _helpers import assert_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LAYERS = {
    "gdn": (layers.GatedDeltaNet, ("_chunk_gdn_fwd_kernel", "_chunk_gdn_bwd_grad_kernel")),
    "kda": (layers.KimiDeltaAttention, ("_two_key_fwd_output_kernel", "_two_key_bwd_intra_kernel")),
    "kdn": (layers.DiagKDN, ("_kalman_gain_fwd_kernel", "_kalman_gain_bwd_kernel")),
}


def _layer(name):
    torch.manual_seed(0)
    return LAYERS[name][0](256, 2, 64).to("cuda", torch.bfloat16)


@pytest.mark.parametrize("name", list(LAYERS))
def test_fullgraph_training_step_matches_eager(name):
    layer = _layer(name)
    x = torch.randn(2, 200, 256, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: layer(t)[0], fullgraph=True)
    results = []
    for fn in (compiled, lambda t: layer(t)[0]):
        xi = x.clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        y = fn(xi)
        y.float().square().mean().backward()
        results.append((y.detach(), xi.grad, [p.grad.clone() for p in layer.parameters()]))
    (y_c, dx_c, dp_c), (y_e, dx_e, dp_e) = results
    assert_close(y_c, y_e, 2e-2, "compiled output vs eager")
    assert_close(dx_c, dx_e, 5e-2, "compiled dx vs eager")
    for i, (a, b) in enumerate(zip(dp_c, dp_e)):
        assert_close(a, b, 5e-2, f"compiled grad of parameter {i} vs eager")


@pytest.mark.parametrize("name", list(LAYERS))
def test_fullgraph_compile_shows_our_kernels(name):
    from torch._inductor.utils import run_and_get_code

    layer = _layer(name)
    x = torch.randn(2, 200, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(lambda t: layer(t)[0], fullgraph=True)

    def step():
        y = compiled(x)
        y.float().square().mean().backward()
        return y

    _, codes = run_and_get_code(step)
    code = "\n".join(codes)
    missing = [kernel for kernel in LAYERS[name][1] if kernel not in code]
    assert not missing, f"{missing} not in Inductor's code ({len(codes)} modules)"


@pytest.mark.parametrize("name", list(LAYERS))
def test_cuda_graphs_reduce_overhead(name):
    layer = _layer(name)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: layer(t)[0], mode="reduce-overhead", fullgraph=True)
    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):
            y = compiled(x).clone()
        assert_close(y, layer(x)[0], 2e-2, "CUDA graphs vs eager")


@pytest.mark.parametrize("name", list(LAYERS))
def test_aoti_package_matches_eager(name, tmp_path):
    layer = _layer(name).eval()

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return self.layer(x)[0]

    x = torch.randn(1, 192, 256, device="cuda", dtype=torch.bfloat16)
    seq = torch.export.Dim("seq", min=2, max=4096)
    with torch.no_grad():
        program = torch.export.export(Wrapped(), (x,), dynamic_shapes={"x": {1: seq}})
        path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / f"{name}.pt2"))
        loaded = torch._inductor.aoti_load_package(path)
        x2 = torch.randn(1, 300, 256, device="cuda", dtype=torch.bfloat16)
        assert_close(loaded(x2), layer(x2)[0], 2e-2, "AOTInductor package vs eager")
