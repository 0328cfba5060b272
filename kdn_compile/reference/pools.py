"""Exact references of the serving path: decode steps over state pools, updated in place.

A serving engine keeps the state of every live sequence in one pool whose first
dimension is the slot; batch row ``b`` continues the sequence held in slot
``state_indices[b]`` and writes its state back there after its ``T`` tokens. A
negative index marks a padding row: its output is zeros and no slot is read or
written. These references gather the named slots, run the token recurrences of
:mod:`kdn_compile.reference.delta_rule` and :mod:`kdn_compile.reference.kdn`, and
scatter the new states back with tensor ops only (no host reads, no data-dependent
shapes), so Inductor compiles them on the CPU. They check the indices' values on the
device (``check_slot_values``) and nothing else: :func:`kdn_compile.delta_rule_decode`
and :func:`kdn_compile.diag_kdn_decode` validate the rest.
"""

from __future__ import annotations

import torch

from kdn_compile._checks import check_slot_values
from kdn_compile.reference._common import heads_first, state_key_first, work_dtype
from kdn_compile.reference.delta_rule import token_loop
from kdn_compile.reference.fp8 import dequantize_state_fp8, quantize_state_fp8
from kdn_compile.reference.kdn import diag_kdn_step

__all__ = [
    "POOL_BLOCK_V", "delta_rule_decode_reference", "diag_kdn_decode_reference",
    "gather_slots", "scatter_slots",
]

# Value columns per scale of a float8 pool: the tiling of ``state_fp8_qdq_reference``.
POOL_BLOCK_V = 64


def gather_slots(pool: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``pool[indices]`` with padding rows (negative indices) reading slot 0, and indices
    past the pool its last slot: a read never faults, so that an out-of-range index is
    reported by the check of the op that owns the indices (:func:`check_slot_values`, or
    the decode kernels' assert), with its message."""
    return pool[indices.clamp(0, pool.shape[0] - 1).long()]


def scatter_slots(pool: torch.Tensor, indices: torch.Tensor, rows: torch.Tensor) -> None:
    """``pool[indices[b]] = rows[b]`` in place for every ``indices[b] >= 0``.

    Padding rows are sent to a scratch row past the pool (a copy of the pool with one
    more row, then copied back): no data-dependent shapes, at ``O(S)`` cost.
    """
    if pool.dtype == torch.float8_e4m3fn:  # no float8 index_copy_: move the bytes
        pool, rows = pool.view(torch.uint8), rows.to(pool.dtype).view(torch.uint8)
    slots = pool.shape[0]
    spare = torch.cat((pool, pool[:1]))
    target = torch.where(indices >= 0, indices.long(), slots)
    spare.index_copy_(0, target, rows.to(pool.dtype))
    pool.copy_(spare[:slots])


def _pool_to_state(pool, scales, indices, state_v_first, dtype):
    state = gather_slots(pool, indices)
    state = state_key_first(state, state_v_first)
    if pool.dtype == torch.float8_e4m3fn:
        return dequantize_state_fp8(state, gather_slots(scales, indices), POOL_BLOCK_V, dtype)
    return state.to(dtype)


def _state_to_pool(state, pool, scales, indices, state_v_first):
    if pool.dtype == torch.float8_e4m3fn:
        values, new_scales = quantize_state_fp8(state.float(), POOL_BLOCK_V)
        scatter_slots(scales, indices, new_scales)
        state = values
    scatter_slots(pool, indices, state_key_first(state, state_v_first))


def delta_rule_decode_reference(
    q, k, v, g, beta, state_pool, state_indices, *, scale: float, state_v_first: bool = False,
    pool_scales=None, intermediate_states=None, update_state: bool = True,
) -> torch.Tensor:
    """One decode step of GDN (``g [B, T, Hv]``) or KDA (``g [B, T, Hv, K]``) over a pool.

    The arguments are those of :func:`kdn_compile.delta_rule_decode`. Mutates
    ``state_pool`` (and ``pool_scales`` for a float8 pool) at the named slots (unless
    ``update_state`` is False) and fills ``intermediate_states [B, T, Hv, K, V]`` (key-first, or value-major with
    ``state_v_first``) with the state after every token when given. The recurrence
    runs in ``promote_types(q.dtype, float32)`` from the dequantized slot; the new
    state is rounded to the pool's dtype once, after the ``T`` tokens (float8: one
    dynamic scale per ``[K, 64]`` tile, as :func:`quantize_state_fp8`).
    Returns ``o [B, T, Hv, V]`` in ``v``'s dtype, zeros on padding rows.
    """
    check_slot_values(state_indices, state_pool.shape[0])
    dtype = work_dtype(q.dtype)
    hv = v.shape[2]
    state = _pool_to_state(state_pool, pool_scales, state_indices, state_v_first, dtype)
    qh, kh, vh = (heads_first(x.to(dtype), hv) for x in (q, k, v))
    gate = heads_first((g if g.dim() == 4 else g[..., None]).to(dtype), hv)
    bh = heads_first(beta.to(dtype)[..., None], hv)[..., 0]
    states: list = []
    o, state = token_loop(qh, kh, vh, gate, bh, state, scale=scale, every_state=states)
    valid = state_indices >= 0
    o = torch.where(valid[:, None, None, None], o.transpose(1, 2), 0.0)
    if intermediate_states is not None:
        every = state_key_first(torch.stack(states, dim=1), state_v_first)
        every = every.to(intermediate_states.dtype)
        intermediate_states.copy_(
            torch.where(valid[:, None, None, None, None], every, intermediate_states)
        )
    if update_state:
        _state_to_pool(state, state_pool, pool_scales, state_indices, state_v_first)
    return o.to(v.dtype).contiguous()


def diag_kdn_decode_reference(
    q, k, v, log_alpha, omega, r, memory_pool, precision_pool, state_indices, *,
    scale: float, info_scale: float, intermediate_memory=None, intermediate_precision=None,
    update_state: bool = True,
) -> torch.Tensor:
    """One Diag-KDN decode step over ``(memory_pool [S, H, K, V], precision_pool [S, H, K])``.

    The arguments are those of :func:`kdn_compile.diag_kdn_decode`; the token
    recurrence is :func:`kdn_compile.reference.diag_kdn_step` in
    ``promote_types(q.dtype, float32)``. Mutates both pools at the named slots (the
    memory rounded to the pool's dtype once, after the ``T`` tokens) unless
    ``update_state`` is False, fills ``intermediate_memory [B, T, H, K, V]`` and
    ``intermediate_precision [B, T, H, K]`` with the state after every token when given
    (padding rows keep theirs), and returns ``o [B, T, H, V]`` in ``v``'s dtype, zeros on
    padding rows.
    """
    check_slot_values(state_indices, memory_pool.shape[0])
    dtype = work_dtype(q.dtype)
    memory = gather_slots(memory_pool, state_indices).to(dtype)
    precision = gather_slots(precision_pool, state_indices).to(dtype)
    outputs, memories, precisions = [], [], []
    for t in range(q.shape[1]):
        o, memory, precision = diag_kdn_step(
            *(x[:, t].to(dtype) for x in (q, k, v, log_alpha, omega, r)), memory, precision,
            scale=scale, info_scale=info_scale,
        )
        outputs.append(o)
        memories.append(memory)
        precisions.append(precision)
    valid = state_indices >= 0
    o = torch.where(valid[:, None, None, None], torch.stack(outputs, dim=1), 0.0)
    for every, into in ((memories, intermediate_memory), (precisions, intermediate_precision)):
        if into is not None:
            every = torch.stack(every, dim=1).to(into.dtype)
            into.copy_(torch.where(valid.view(-1, *[1] * (into.dim() - 1)), every, into))
    if update_state:
        scatter_slots(memory_pool, state_indices, memory)
        scatter_slots(precision_pool, state_indices, precision)
    return o.to(v.dtype).contiguous()
