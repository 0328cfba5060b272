"""``kdn`` ops of the serving path: decode steps that update state pools in place.

* ``kdn::delta_rule_decode`` (triton_op) and ``kdn::delta_rule_decode_reference``:
  GDN / KDA over a pool ``[S, Hv, K, V]`` (float32, bfloat16 or float8 E4M3 with
  scales), slots named per batch row.
* ``kdn::diag_kdn_decode`` (triton_op) and ``kdn::diag_kdn_decode_reference``: Diag-KDN
  over a memory pool and a precision pool.

Both declare their pools (and the optional intermediate states) in ``mutates_args``,
so functionalization, ``torch.compile`` and CUDA graphs see the writes. The triton_ops
launch the kernels of ``lowering/recurrent.py`` where they cover the inputs and call
the reference ops elsewhere (CPU, float64, while tracing on the CPU). Neither is
differentiable: decoding runs under ``torch.no_grad``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kdn_compile._checks import SLOT_ERROR
from kdn_compile.ops._dispatch import TRITON, can_launch, interpreted_ok
from kdn_compile.reference.kdn import LOG_MEMORY_ALPHA_FLOOR
from kdn_compile.reference.pools import delta_rule_decode_reference, diag_kdn_decode_reference

if TRITON:  # else every op takes its reference (see _dispatch.TRITON)
    from kdn_compile.lowering.recurrent import (
        recurrent_delta_fwd,
        recurrent_kdn_fwd,
        recurrent_kernel_supports,
    )

_DELTA_MUTATES = ("state_pool", "pool_scales", "intermediate_states")


@torch.library.custom_op("kdn::delta_rule_decode_reference", mutates_args=_DELTA_MUTATES)
def delta_rule_decode_reference_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor,
    state_indices: Tensor, scale: float, state_v_first: bool,
    pool_scales: Optional[Tensor], intermediate_states: Optional[Tensor],
    update_state: bool = True,
) -> Tensor:
    """The exact reference (:func:`kdn_compile.reference.pools.delta_rule_decode_reference`)."""
    return delta_rule_decode_reference(
        q, k, v, g, beta, state_pool, state_indices, scale=scale, state_v_first=state_v_first,
        pool_scales=pool_scales, intermediate_states=intermediate_states,
        update_state=update_state,
    ).clone(memory_format=torch.contiguous_format)  # the fake's layout


@delta_rule_decode_reference_op.register_fake
def _delta_fake(q, k, v, g, beta, state_pool, state_indices, scale, state_v_first,
                pool_scales, intermediate_states, update_state=True):
    return v.new_empty(v.shape)


def _delta_kernels(q, v, state_pool, intermediate_states) -> bool:
    states = (state_pool.dtype,) + (
        () if intermediate_states is None else (intermediate_states.dtype,)
    )
    return can_launch(q) and recurrent_kernel_supports(q, v, states) and interpreted_ok(q, states)



def delta_rule_decode_body(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor,
    state_indices: Tensor, scale: float, state_v_first: bool,
    pool_scales: Optional[Tensor], intermediate_states: Optional[Tensor],
    update_state: bool = True,
) -> Tensor:
    """GDN / KDA decode step over a pool; Triton where it can, else the reference op.
    Without ``update_state`` the pool (and its scales) is read, not written."""
    if not _delta_kernels(q, v, state_pool, intermediate_states):
        return torch.ops.kdn.delta_rule_decode_reference(
            q, k, v, g, beta, state_pool, state_indices, scale, state_v_first, pool_scales,
            intermediate_states, update_state,
        )
    o, slots_ok = recurrent_delta_fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
        scale=scale, state_in=state_pool, state_out=state_pool if update_state else None,
        scales=pool_scales,
        indices=state_indices.contiguous(), intermediate=intermediate_states,
        state_v_first=state_v_first,
    )
    if slots_ok is not None:  # where the kernel's own device assert is not compiled in
        torch._assert_async(slots_ok, SLOT_ERROR)
    return o


delta_rule_decode_op = torch.library.triton_op(
    "kdn::delta_rule_decode", delta_rule_decode_body, mutates_args=_DELTA_MUTATES)

_KDN_MUTATES = ("memory_pool", "precision_pool", "intermediate_memory",
                "intermediate_precision")


@torch.library.custom_op("kdn::diag_kdn_decode_reference", mutates_args=_KDN_MUTATES)
def diag_kdn_decode_reference_op(
    q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, omega: Tensor, r: Tensor,
    memory_pool: Tensor, precision_pool: Tensor, state_indices: Tensor, scale: float,
    info_scale: float, intermediate_memory: Optional[Tensor],
    intermediate_precision: Optional[Tensor], update_state: bool = True,
) -> Tensor:
    """The exact reference (:func:`kdn_compile.reference.pools.diag_kdn_decode_reference`)."""
    return diag_kdn_decode_reference(
        q, k, v, log_alpha, omega, r, memory_pool, precision_pool, state_indices,
        scale=scale, info_scale=info_scale, intermediate_memory=intermediate_memory,
        intermediate_precision=intermediate_precision, update_state=update_state,
    ).clone(memory_format=torch.contiguous_format)  # the fake's layout


@diag_kdn_decode_reference_op.register_fake
def _kdn_fake(q, k, v, log_alpha, omega, r, memory_pool, precision_pool, state_indices,
              scale, info_scale, intermediate_memory, intermediate_precision,
              update_state=True):
    return v.new_empty(v.shape)


def _kdn_kernels(q, v, memory_pool, precision_pool, intermediate_memory,
                 intermediate_precision) -> bool:
    states = (memory_pool.dtype,) + (
        () if intermediate_memory is None else (intermediate_memory.dtype,))
    return (
        can_launch(q) and precision_pool.dtype == torch.float32
        and memory_pool.dtype != torch.float8_e4m3fn
        and (intermediate_precision is None or intermediate_precision.dtype == torch.float32)
        and recurrent_kernel_supports(q, v, states) and interpreted_ok(q, states)
    )


def diag_kdn_decode_body(
    q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, omega: Tensor, r: Tensor,
    memory_pool: Tensor, precision_pool: Tensor, state_indices: Tensor, scale: float,
    info_scale: float, intermediate_memory: Optional[Tensor],
    intermediate_precision: Optional[Tensor], update_state: bool = True,
) -> Tensor:
    """Diag-KDN decode step over pools; Triton where it can, else the reference op.
    Without ``update_state`` the pools are read, not written."""
    if not _kdn_kernels(q, v, memory_pool, precision_pool, intermediate_memory,
                        intermediate_precision):
        return torch.ops.kdn.diag_kdn_decode_reference(
            q, k, v, log_alpha, omega, r, memory_pool, precision_pool, state_indices, scale,
            info_scale, intermediate_memory, intermediate_precision, update_state,
        )
    o, slots_ok = recurrent_kdn_fwd(
        *(x.contiguous() for x in (q, k, v, log_alpha, omega, r)), memory_pool,
        precision_pool, state_indices.contiguous(), scale=scale, info_scale=info_scale,
        log_alpha_floor=LOG_MEMORY_ALPHA_FLOOR, intermediate_memory=intermediate_memory,
        intermediate_precision=intermediate_precision, update_state=update_state,
    )
    if slots_ok is not None:  # where the kernel's own device assert is not compiled in
        torch._assert_async(slots_ok, SLOT_ERROR)
    return o


diag_kdn_decode_op = torch.library.triton_op(
    "kdn::diag_kdn_decode", diag_kdn_decode_body, mutates_args=_KDN_MUTATES)

