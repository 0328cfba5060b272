"""``kdn::recurrent_delta_rule_reference``: the token recurrence (GDN or KDA by g's rank).

The decode path. There is no Triton kernel for it yet, so the op is the exact
reference, declared opaque with a shape-only fake.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kdn_compile import reference as ref
from kdn_compile.ops._registry import FamilyOps
from kdn_compile.ops._shapes import empty_state


def _signature(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    scale: float, state_v_first: bool,
) -> tuple[Tensor, Tensor]: ...


def _reference(q, k, v, g, beta, initial_state, cu_seqlens, scale, state_v_first):
    return ref.recurrent_delta_rule_reference(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        cu_seqlens=cu_seqlens, state_v_first=state_v_first,
    )


def _fake(q, k, v, g, beta, initial_state, cu_seqlens, scale, state_v_first):
    state = empty_state(q, cu_seqlens, v.shape[2], k.shape[3], v.shape[3], state_v_first)
    return v.new_empty(v.shape), state


RECURRENT_DELTA_RULE = FamilyOps(
    "recurrent_delta_rule", _signature, _reference, _fake,
    differentiable=("q", "k", "v", "g", "beta", "initial_state"),
)
