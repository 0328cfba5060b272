"""``kdn`` ops that share context-parallel state maps across a process group.

* ``kdn::context_state_exchange(o, u, end, carry, precision_end, carry_index, continues,
  ended, group_name) -> (o, final_state, final_precision, gathered)``: all-gathers every
  rank's memory maps (``end``, ``carry``, and Diag-KDN's ``precision_end``) in one
  collective, chains them (:func:`kdn_compile.reference.context.chain_states`), corrects
  this rank's output with the state entering it and returns the global final state
  (and final precision; an empty tensor without ``precision_end``).
* ``kdn::context_covariance_exchange(carry_map, precision, carry_index, continues,
  group_name) -> (precision_start, gathered)``: all-gathers every rank's Diag-KDN
  covariance map and returns the precision each sequence enters this rank's slice with.

``gathered`` (every rank's maps, flat) is kept for the backward only. The backward ops
(``*_bwd``) differentiate the chaining with :func:`torch.autograd.grad` and
reduce-scatter (sum) the gradients of the gathered maps back to the ranks that sent
them. The collectives are PyTorch's functional collective ops
(``_c10d_functional.all_gather_into_tensor`` / ``reduce_scatter_tensor``), run inside
these ops: each op's output feeds the rank's own tokens (its output, or the precision
its slice starts from), so every rank reaches every backward collective, in the same
order, whatever its loss reads. The group is named by ``group_name``
(``ProcessGroup.group_name``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from kdn_compile.ops._registry import _recording_autograd
from kdn_compile.reference.context import (
    chain_states,
    continued_precision,
    corrected_output,
    incoming_covariance,
)


def _rank_and_size(group_name: str) -> tuple[int, int]:
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    return dist.get_rank(group), dist.get_world_size(group)


def _all_gather(flat: Tensor, world: int, group_name: str) -> Tensor:
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_gather_into_tensor(flat.contiguous(), world, group_name))


def _reduce_scatter(flat: Tensor, world: int, group_name: str) -> Tensor:
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(flat.contiguous(), "sum", world, group_name))


def _fresh(t: Tensor) -> Tensor:
    """A new contiguous tensor: the layout every fake promises, aliasing no input or output."""
    return t.clone(memory_format=torch.contiguous_format)


def _flat(tensors) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors if t is not None])


def _split(rows: Tensor, like) -> list:
    """``rows [R, size]`` cut into ``[R, *t.shape]`` for each ``t`` of ``like`` (None kept)."""
    present = [t for t in like if t is not None]
    parts = iter(part.reshape(rows.shape[0], *t.shape)
                 for part, t in zip(rows.split([t.numel() for t in present], dim=1), present))
    return [None if t is None else next(parts) for t in like]


def _gathered_size(world: int, tensors) -> int:
    return world * sum(t.numel() for t in tensors if t is not None)


# -- the memory maps ----------------------------------------------------------------------


@torch.library.custom_op("kdn::context_state_exchange", mutates_args=())
def context_state_exchange(
    o: Tensor, u: Optional[Tensor], end: Tensor, carry: Tensor, precision_end: Optional[Tensor],
    carry_index: Optional[Tensor], continues: Optional[Tensor], ended: Optional[Tensor],
    group_name: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Share, chain and apply the memory maps (see the module docstring).

    Args: ``o [B, L, H, V]`` and ``u [B, L, H, K]`` (None on rank 0) this rank's
    value-run and identity-run outputs; ``end [N, H, K, V]`` and ``carry [B, H, K, K]``
    its maps; ``precision_end [N, H, K]`` its final precisions (Diag-KDN) or None; the
    packed-sequence description of :mod:`kdn_compile.reference.context` (None at fixed
    length).
    """
    rank, world = _rank_and_size(group_name)
    gathered = _all_gather(_flat((end, carry, precision_end)), world, group_name)
    ends, carries, precisions = _split(gathered.view(world, -1), (end, carry, precision_end))
    incoming, final = chain_states(ends, carries, rank, carry_index, continues, ended)
    final_precision = o.new_empty(0, dtype=end.dtype)
    if precisions is not None:
        _, final_precision = chain_states(precisions, None, rank, carry_index, continues, ended)
    if u is not None:
        o = corrected_output(o, u, incoming, rank, carry_index)
    return _fresh(o), _fresh(final), _fresh(final_precision), gathered


@context_state_exchange.register_fake
def _(o, u, end, carry, precision_end, carry_index, continues, ended, group_name):
    _, world = _rank_and_size(group_name)
    final_precision = (o.new_empty(0, dtype=end.dtype) if precision_end is None
                       else precision_end.new_empty(precision_end.shape))
    gathered = end.new_empty(_gathered_size(world, (end, carry, precision_end)))
    return o.new_empty(o.shape), end.new_empty(end.shape), final_precision, gathered


@torch.library.custom_op("kdn::context_state_exchange_bwd", mutates_args=())
def context_state_exchange_bwd(
    o: Tensor, u: Optional[Tensor], end: Tensor, carry: Tensor, precision_end: Optional[Tensor],
    carry_index: Optional[Tensor], continues: Optional[Tensor], ended: Optional[Tensor],
    group_name: str, gathered: Tensor, grad_o: Tensor, grad_final: Tensor,
    grad_precision: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(do, du, dend, dcarry, dprecision_end)`` of
    ``kdn::context_state_exchange``; empty tensors for the absent ``u``, ``precision_end``."""
    rank, world = _rank_and_size(group_name)
    with _recording_autograd(), torch.enable_grad():
        maps = gathered.detach().requires_grad_()
        ends, carries, precisions = _split(maps.view(world, -1), (end, carry, precision_end))
        incoming, final = chain_states(ends, carries, rank, carry_index, continues, ended)
        outputs, grads, wrt = [final], [grad_final], [maps]
        if precisions is not None:
            _, final_precision = chain_states(precisions, None, rank, carry_index, continues,
                                              ended)
            outputs.append(final_precision)
            grads.append(grad_precision)
        if u is not None:
            u_leaf = u.detach().requires_grad_()
            outputs.append(corrected_output(o.detach(), u_leaf, incoming, rank, carry_index))
            grads.append(grad_o)
            wrt.append(u_leaf)
        found = torch.autograd.grad(outputs, wrt, grads, allow_unused=True)
    dmaps = torch.zeros_like(maps) if found[0] is None else found[0]
    local = _reduce_scatter(dmaps, world, group_name).view(1, -1)
    dend, dcarry, dprecision = (None if t is None else t[0]
                                for t in _split(local, (end, carry, precision_end)))
    if u is None:
        du = o.new_empty(0)
    else:
        du = (torch.zeros_like(u) if found[-1] is None else found[-1]).to(u.dtype)
    return (_fresh(grad_o.to(o.dtype)), _fresh(du), _fresh(dend), _fresh(dcarry),
            o.new_empty(0) if dprecision is None else _fresh(dprecision))


@context_state_exchange_bwd.register_fake
def _(o, u, end, carry, precision_end, carry_index, continues, ended, group_name, gathered,
      grad_o, grad_final, grad_precision):
    return (o.new_empty(o.shape), o.new_empty(0) if u is None else u.new_empty(u.shape),
            end.new_empty(end.shape), carry.new_empty(carry.shape),
            o.new_empty(0) if precision_end is None
            else precision_end.new_empty(precision_end.shape))


_STATE_INPUTS = ("o", "u", "end", "carry", "precision_end", "carry_index", "continues", "ended",
                 "group_name")


def _state_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:-1], output[3])
    ctx.group_name = inputs[-1]
    ctx.mark_non_differentiable(output[3])


def _state_backward(ctx, grad_o, grad_final, grad_precision, _):
    *inputs, gathered = ctx.saved_tensors
    found = context_state_exchange_bwd(*inputs, ctx.group_name, gathered, grad_o, grad_final,
                                       grad_precision)
    absent = {"u": inputs[1] is None, "precision_end": inputs[4] is None}
    named = dict(zip(("o", "u", "end", "carry", "precision_end"), found))
    return tuple(None if absent.get(n) or n not in named else named[n] for n in _STATE_INPUTS)


context_state_exchange.register_autograd(_state_backward, setup_context=_state_setup)


# -- the Diag-KDN covariance maps ---------------------------------------------------------


@torch.library.custom_op("kdn::context_covariance_exchange", mutates_args=())
def context_covariance_exchange(
    carry_map: Tensor, precision: Tensor, carry_index: Optional[Tensor],
    continues: Optional[Tensor], group_name: str,
) -> tuple[Tensor, Tensor]:
    """Share the covariance carry maps ``carry_map [B, H, K, 4]`` and return the precision
    ``[N, H, K]`` each sequence enters this rank with (``precision`` where it starts
    here), with the gathered maps."""
    rank, world = _rank_and_size(group_name)
    gathered = _all_gather(carry_map.reshape(-1), world, group_name)
    incoming = incoming_covariance(gathered.view(world, *carry_map.shape), rank)
    start = continued_precision(precision, incoming, rank, carry_index, continues)
    return _fresh(start), gathered


@context_covariance_exchange.register_fake
def _(carry_map, precision, carry_index, continues, group_name):
    _, world = _rank_and_size(group_name)
    return precision.new_empty(precision.shape), carry_map.new_empty(world * carry_map.numel())


@torch.library.custom_op("kdn::context_covariance_exchange_bwd", mutates_args=())
def context_covariance_exchange_bwd(
    carry_map: Tensor, precision: Tensor, carry_index: Optional[Tensor],
    continues: Optional[Tensor], group_name: str, gathered: Tensor, grad_start: Tensor,
) -> tuple[Tensor, Tensor]:
    """Gradients ``(dcarry_map, dprecision)`` of ``kdn::context_covariance_exchange``."""
    rank, world = _rank_and_size(group_name)
    with _recording_autograd(), torch.enable_grad():
        maps = gathered.detach().requires_grad_()
        start = precision.detach().requires_grad_()
        incoming = incoming_covariance(maps.view(world, *carry_map.shape), rank)
        out = continued_precision(start, incoming, rank, carry_index, continues)
        dmaps, dprecision = torch.autograd.grad(out, (maps, start), grad_start, allow_unused=True)
    dmaps = torch.zeros_like(maps) if dmaps is None else dmaps
    dprecision = torch.zeros_like(precision) if dprecision is None else dprecision
    local = _reduce_scatter(dmaps, world, group_name)
    return _fresh(local.view(carry_map.shape)), _fresh(dprecision)


@context_covariance_exchange_bwd.register_fake
def _(carry_map, precision, carry_index, continues, group_name, gathered, grad_start):
    return carry_map.new_empty(carry_map.shape), precision.new_empty(precision.shape)


def _covariance_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:-1], output[1])
    ctx.group_name = inputs[-1]
    ctx.mark_non_differentiable(output[1])


def _covariance_backward(ctx, grad_start, _):
    carry_map, precision, carry_index, continues, gathered = ctx.saved_tensors
    dmap, dprecision = context_covariance_exchange_bwd(
        carry_map, precision, carry_index, continues, ctx.group_name, gathered, grad_start)
    return dmap, dprecision, None, None, None


context_covariance_exchange.register_autograd(_covariance_backward,
                                              setup_context=_covariance_setup)
