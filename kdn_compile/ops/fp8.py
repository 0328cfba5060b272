"""``kdn`` ops of FP8 E4M3 fake quantization of a key-first state.

* ``kdn::state_fp8_qdq`` (triton_op): the kernel of ``lowering/fp8.py`` where it can
  launch (CUDA; the CPU interpreter) on a float16 / bfloat16 / float32 state, bit for bit
  the reference; elsewhere (float64, tracing on the CPU) ``kdn::state_fp8_qdq_reference``.
* ``kdn::state_fp8_qdq_reference``: :func:`kdn_compile.reference.state_fp8_qdq_reference`.

Both have the identity (straight-through) gradient: the kernel op's backward passes the
gradient on, the reference op's recovers it from the reference itself.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kdn_compile import reference as ref
from kdn_compile.ops._dispatch import TRITON, can_launch, interpreted_ok
from kdn_compile.ops._registry import FamilyOps

if TRITON:  # else the op takes its reference (see _dispatch.TRITON)
    from kdn_compile.lowering.fp8 import state_fp8_qdq_fwd, state_qdq_kernel_supports


def _signature(state: Tensor, block_v: int) -> Tensor: ...


def _reference(state, block_v):
    return ref.state_fp8_qdq_reference(state, block_v)


def _fake(state, block_v):
    return state.new_empty(state.shape)


STATE_FP8_QDQ = FamilyOps(
    "state_fp8_qdq", _signature, _reference, _fake, differentiable=("state",)
)


@torch.library.triton_op("kdn::state_fp8_qdq", mutates_args=())
def state_fp8_qdq_op(state: Tensor, block_v: int) -> Tensor:
    """E4M3 QDQ of ``state [..., K, V]``; Triton where it can, else the reference op."""
    if (can_launch(state) and state_qdq_kernel_supports(state)
            and interpreted_ok(state, (state.dtype,))):
        return state_fp8_qdq_fwd(state, block_v)
    return torch.ops.kdn.state_fp8_qdq_reference(state, block_v)


def _straight_through(inputs: dict, grads: list) -> dict:
    return {"state": grads[0].to(inputs["state"].dtype)}


STATE_FP8_QDQ.attach_autograd(state_fp8_qdq_op, _straight_through)
