"""``kdn::recurrent_delta_rule``: the token recurrence of any length (GDN or KDA by g's rank).

* ``kdn::recurrent_delta_rule`` (triton_op): where the token-recurrence kernel of
  ``lowering/recurrent.py`` covers the inputs it launches it (one program per
  sequence, value head and value tile, the state on chip across the tokens);
  elsewhere it calls ``kdn::recurrent_delta_rule_reference``.
* Gradients, on either branch, come from the reference (``kdn::recurrent_delta_rule_reference_bwd``,
  which differentiates the exact token loop): correct at any length, and as slow as
  that loop. Training runs the chunked ops.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kdn_compile import reference as ref
from kdn_compile.ops._dispatch import TRITON, can_launch, interpreted_ok
from kdn_compile.ops._registry import FamilyOps
from kdn_compile.ops._shapes import empty_state

if TRITON:  # else every op takes its reference (see _dispatch.TRITON)
    from kdn_compile.lowering.recurrent import recurrent_delta_fwd, recurrent_kernel_supports


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


def _recurrent_kernels(q, v, initial_state) -> bool:
    """Kernels: a device that can launch them and the dtypes and sizes of
    :func:`~kdn_compile.lowering.recurrent.recurrent_kernel_supports`."""
    states = () if initial_state is None else (initial_state.dtype,)
    return (can_launch(q) and recurrent_kernel_supports(q, v, states)
            and interpreted_ok(q, states))


def recurrent_delta_rule_body(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    scale: float, state_v_first: bool,
) -> tuple[Tensor, Tensor]:
    """Token recurrence; launches Triton where it can, else the reference op.

    Returns ``(o, final_state)``, the final state in float32 (as the reference for
    half and float32 inputs).
    """
    if not _recurrent_kernels(q, v, initial_state):
        return torch.ops.kdn.recurrent_delta_rule_reference(
            q, k, v, g, beta, initial_state, cu_seqlens, scale, state_v_first
        )
    final_state = empty_state(q, cu_seqlens, v.shape[2], k.shape[3], v.shape[3], state_v_first)
    o, _ = recurrent_delta_fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
        scale=scale, state_in=None if initial_state is None else initial_state.contiguous(),
        state_out=final_state, cu_seqlens=cu_seqlens, state_v_first=state_v_first,
    )
    return o, final_state


recurrent_delta_rule_op = torch.library.triton_op(
    "kdn::recurrent_delta_rule", recurrent_delta_rule_body, mutates_args=())

RECURRENT_DELTA_RULE.attach_autograd(
    recurrent_delta_rule_op, RECURRENT_DELTA_RULE.reference_backward
)
