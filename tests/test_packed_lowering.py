"""Packed sequences: every token-to-sequence search lowers with Inductor's CUDA rules.

The packed paths find each token's sequence with ``torch.searchsorted`` over
``cu_seqlens``. On CUDA, Inductor's ``searchsorted`` lowering in torch 2.11 asks its
boundaries for their strides, which a slice of a computed tensor (``bounds[1:]`` of
``cu_seqlens.to(torch.long)``) does not have while it lowers: the compile fails with
``NotImplementedError: SliceView``. Inductor on the CPU runs ``searchsorted`` through
ATen and torch 2.13 lowers views there, so neither shows it. These tests trace each
packed path to ATen as ``torch.compile`` does (AOTAutograd, forward and backward graphs)
and check that no ``searchsorted`` searches a view.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from kdn_compile.distributed._layout import SliceLayout
from kdn_compile.integrations.transformers import causal_conv1d
from kdn_compile.layers import GatedDeltaNet
from kdn_compile.layers._serving import padding_mask

CU = [0, 5, 5, 12, 20]  # an empty sequence included


def searched_views(fn, *args, dynamic=False) -> list[str]:
    """Compile ``fn`` (fullgraph) down to ATen, run it on ``args`` and return each
    ``searchsorted`` of its graphs whose boundaries are a view, with that view."""
    found: list[str] = []

    def inspect(gm, example_inputs):
        for node in gm.graph.find_nodes(op="call_function",
                                        target=torch.ops.aten.searchsorted.Tensor):
            bounds = node.args[0]
            if isinstance(bounds.target, torch._ops.OpOverload) and bounds.target.is_view:
                found.append(f"{node.format_node()}  <-  {bounds.format_node()}")
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=inspect, bw_compiler=inspect)
    out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*args)
    if isinstance(out, torch.Tensor) and out.requires_grad:
        out.sum().backward()
    return found


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_layer_convolution(dtype, dynamic):
    torch.manual_seed(0)
    layer = GatedDeltaNet(32, 2, 16)
    x = torch.randn(1, CU[-1], 32, requires_grad=True)
    found = searched_views(lambda x, cu: layer(x, cu_seqlens=cu)[0], x,
                           torch.tensor(CU, dtype=dtype), dynamic=dynamic)
    assert not found, found


def test_serving_padding_mask():
    x = torch.randn(1, CU[-1], 8)
    found = searched_views(lambda indices, x, cu: padding_mask(indices, x, cu),
                           torch.tensor([0, -1, 2, 1]), x, torch.tensor(CU, dtype=torch.int32))
    assert not found, found


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_transformers_convolution(dynamic):
    hidden = torch.randn(1, 6, CU[-1], requires_grad=True)
    weight = torch.randn(6, 4)
    found = searched_views(
        lambda h, w, cu: causal_conv1d(h, w, activation="silu", cu_seq_lens_q=cu),
        hidden, weight, torch.tensor(CU, dtype=torch.int32), dynamic=dynamic)
    assert not found, found


@pytest.mark.parametrize("rank", [0, 1])
def test_context_parallel_layout(rank):
    q = torch.randn(1, CU[-1] // 2, 2, 4)
    covariance = torch.rand(len(CU) - 1, 2, 4) + 0.5
    maps = tuple(torch.randn(1, q.shape[1], 2, 4) for _ in range(4))

    def layout(q, cu, covariance, *maps):
        sliced = SliceLayout(q, cu, rank, 2)
        return sliced.carry_index, *sliced.restart_maps(maps, covariance)

    found = searched_views(layout, q, torch.tensor(CU), covariance, *maps)
    assert not found, found
