"""``kdn::state_fp8_qdq_reference``: FP8 E4M3 fake quantization of a key-first state.

Its gradient is the identity (straight-through), which the generic reference
backward recovers from the reference itself.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kdn_compile import reference as ref
from kdn_compile.ops._registry import FamilyOps


def _signature(state: Tensor, block_v: int) -> Tensor: ...


def _reference(state, block_v):
    return ref.state_fp8_qdq_reference(state, block_v)


def _fake(state, block_v):
    return state.new_empty(state.shape)


STATE_FP8_QDQ = FamilyOps(
    "state_fp8_qdq", _signature, _reference, _fake, differentiable=("state",)
)
