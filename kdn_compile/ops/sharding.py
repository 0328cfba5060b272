"""DTensor sharding rules of every ``torch.ops.kdn`` op: heads are independent.

Registered with :func:`torch.distributed.tensor.experimental.register_sharding` when
the ops are (``import kdn_compile``). For each op call on DTensors a rule offers two
strategies: everything replicated, and every head-carrying tensor sharded on its head
dimension (``q, k, v, g, beta`` and outputs ``[B, T, H, ...]`` on dim 2, states
``[N, H, K, V]`` on dim 1; a grouped value head stays on the rank of its key head
because ``Hk`` and ``Hv`` split into the same number of contiguous blocks). DTensor
takes the one that moves no data: sharded in, sharded out, no communication;
replicated in, replicated out. Boundaries (``cu_seqlens``), slot indices and the
kernels' chunk tables are replicated.

Refused with a ValueError naming the op and the argument: a tensor sharded on any
other dimension or partial (reduce it first), and heads that do not split evenly
over the mesh. Ops that write into an argument (the decode ops, ``scatter_slots``)
run with that argument's own placement, so the write lands in its shards.

The kernel ops return tensors that only their backward reads: sharded on their head
dimension where the kernels run (a placeholder among them too), replicated placeholders
where the reference runs (decided as the op decides, from shapes, dtypes and the mesh's
device); a flat per-chunk buffer (the Kalman gain's chunk covariances, the exchange ops'
gathered maps) is ``Shard(0)``, whose local size is its per-rank size. DTensor takes the
global metadata of an op's outputs from the op run on fake tensors, which torch 2.11
builds on the CPU whatever the mesh's device: the op then takes its reference branch,
and a saved output carries a placeholder's metadata while the ranks hold the kernels'
tensors. The placeholders (empty ``[H, H, H, 0]``) take every placement the saved
tensors take, and the backward ops, run on such fake tensors, return their gradients'
metadata without reading them (:func:`~kdn_compile.ops._dispatch.metadata_only`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.experimental import register_sharding

from kdn_compile.ops import gdn, gdn_wy, kda, kdn
from kdn_compile.ops._registry import FLAT

_ops = torch.ops.kdn

# head dims of the inputs of each family (arguments not named: replicated; FLAT: Shard(0));
# the kernel ops' saved tensors: their families' declarations (gdn.SAVED, kda.SAVED, ...)
DELTA = {"q": 2, "k": 2, "v": 2, "g": 2, "beta": 2, "initial_state": 1}
DIAG_KDN = {"q": 2, "k": 2, "v": 2, "log_alpha": 2, "omega": 2, "r": 2, "memory": 1,
            "precision": 1}
GRADS = {"grad_0": 2, "grad_o": 2, "grad_output": 2, "grad_state": 1, "grad_memory": 1}


class _Meta:
    """The shape, dtype and device of a DTensor argument: what the ops' kernel
    predicates read."""

    def __init__(self, spec: DTensorSpec):
        self.shape, self.dtype = spec.shape, spec.tensor_meta.dtype
        self.device = torch.device(spec.mesh.device_type)

    def dim(self) -> int:
        return len(self.shape)


def _bind(op, args, kwargs) -> dict:
    """The op's arguments by name, defaults included."""
    defaults = {a.name: a.default_value for a in op._schema.arguments if a.has_default_value()}
    names = [a.name for a in op._schema.arguments]
    return {**defaults, **dict(zip(names, args)), **kwargs}


def _meta(bound: dict, *names):
    return [None if bound[n] is None else _Meta(bound[n]) if isinstance(bound[n], DTensorSpec)
            else bound[n] for n in names]


def _head_dim(placement_dim: int, ndim: int) -> int:
    return placement_dim % ndim


def _check(op_name: str, bound: dict, heads: dict) -> tuple[bool, int]:
    """``(any input head-sharded, shards)``; raises for any other placement."""
    sharded, mesh = False, None
    for name, spec in bound.items():
        if not isinstance(spec, DTensorSpec):
            continue
        mesh = spec.mesh
        dim = heads.get(name)
        for placement in spec.placements:
            if placement.is_replicate():
                continue
            if placement.is_shard() and dim is not None and (
                    dim == FLAT or _head_dim(placement.dim, spec.ndim) == dim):
                sharded = True
                continue
            allowed = "Replicate" if dim is None else "Shard(0) or Replicate" if dim == FLAT else (
                f"Shard({dim}) (its heads) or Replicate")
            raise ValueError(
                f"kdn::{op_name}: {name} has placements {tuple(spec.placements)}; it must be "
                f"{allowed} on every mesh dimension (heads are independent; redistribute "
                f"it first)")
    shards = 1
    if sharded:
        for i, placements in enumerate(zip(*(s.placements for s in bound.values()
                                              if isinstance(s, DTensorSpec)))):
            if any(p.is_shard() for p in placements):
                shards *= mesh.size(i)
        for name, spec in bound.items():
            dim = heads.get(name)
            if isinstance(spec, DTensorSpec) and isinstance(dim, int) and spec.shape[dim] % shards:
                raise ValueError(
                    f"kdn::{op_name}: {name} has {spec.shape[dim]} heads (dim {dim} of "
                    f"{tuple(spec.shape)}), which do not split evenly into {shards} shards")
    return sharded, shards


def _strategy(op, bound: dict, heads: dict, outputs: list, shard: bool) -> tuple[list, list]:
    """``(output placements, input placements)``: the head-sharded or the replicated one."""
    def place(dim):
        if not shard or dim is None:
            return Replicate()
        return Shard(0) if dim == FLAT else Shard(dim)

    inputs = [None if not isinstance(bound[a.name], DTensorSpec) else place(heads.get(a.name))
              for a in op._schema.arguments]
    return [place(d) for d in outputs], inputs


def _rule(op, heads: dict, outputs: list | Callable, mutated: tuple = ()):
    """Register the two strategies of ``op`` (or the one of its ``mutated`` argument's
    placement). ``outputs``: each output's head dim (None: replicated), or a function of
    the bound arguments returning them."""
    name = op._schema.name.split("::")[1]

    def rule(*args, **kwargs):
        bound = _bind(op, args, kwargs)
        sharded, _ = _check(name, bound, heads)
        dims = outputs(bound) if callable(outputs) else outputs
        if mutated:
            return [_strategy(op, bound, heads, dims, _written_sharded(name, bound, mutated))]
        return [_strategy(op, bound, heads, dims, False)] + (
            [_strategy(op, bound, heads, dims, True)] if sharded else [])

    register_sharding(op)(rule)


def _written_sharded(op_name: str, bound: dict, mutated: tuple) -> bool:
    """Whether the arguments the op writes are head-sharded (all alike on every mesh
    dimension: the op cannot move them)."""
    kinds = {p.is_shard() for n in mutated if isinstance(bound.get(n), DTensorSpec)
             for p in bound[n].placements}
    if len(kinds) > 1:
        raise ValueError(f"kdn::{op_name} writes into {', '.join(mutated)}: give them one "
                         f"placement on every mesh dimension, all Shard or all Replicate")
    return kinds == {True}


def _optional(dim: int, bound: dict, name: str):
    """``dim`` when the optional argument ``name`` is present, else None (an empty tensor)."""
    return None if bound[name] is None else dim


def _delta_grads(bound, initial="initial_state", count=5):
    return [2] * count + [_optional(1, bound, initial)]


def _saved(run: bool, saved: dict) -> list:
    """The head dims of a kernel op's saved outputs (``saved``: its family's declaration):
    the declared ones where the kernels run (placeholders among them too; None for the
    kernels' chunk tables, the same on every rank), else None (the reference's
    placeholders)."""
    return [dim if run else None for dim in saved.values()]


def gdn_outputs(bound: dict) -> list:
    """The head dims of ``kdn::chunk_gdn``'s outputs (None: replicated), its saved tensors'
    where the kernels run."""
    run = gdn._gdn_kernels(*_meta(bound, "q", "k", "v", "g", "beta", "initial_state",
                                  "cu_seqlens"), bound["chunk_size"], bound["state_qdq"],
                           bound["state_qdq_block_v"])
    return [2, 1] + _saved(run, gdn.SAVED)


def _register_delta_rule():
    for op in (_ops.chunk_gdn_reference, _ops.chunk_kda_reference,
               _ops.recurrent_delta_rule_reference, _ops.recurrent_delta_rule):
        _rule(op.default, DELTA, [2, 1])
    for op in (_ops.chunk_gdn_reference_bwd, _ops.chunk_kda_reference_bwd,
               _ops.recurrent_delta_rule_reference_bwd):
        _rule(op.default, {**DELTA, "grad_0": 2, "grad_1": 1}, _delta_grads)

    _rule(_ops.chunk_gdn.default, DELTA, gdn_outputs)
    _rule(_ops.chunk_gdn_bwd.default, {**DELTA, **gdn.SAVED, **GRADS}, _delta_grads)

    def kda_outputs(b):
        run = kda._kda_kernels(*_meta(b, "q", "v"), b["chunk_size"])
        return [2, 1] + _saved(run, kda.SAVED)

    _rule(_ops.chunk_kda.default, DELTA, kda_outputs)
    _rule(_ops.chunk_kda_bwd.default, {**DELTA, **kda.SAVED, **GRADS}, _delta_grads)

    wy_operands = {"k": 2, "v": 2, "g": 2, "beta": 2, **gdn_wy.OPERANDS_SAVED, "grad_w": 2,
                   "grad_u": 2}
    _rule(_ops.gdn_wy_operands_reference.default, wy_operands, [2, 2])
    _rule(_ops.gdn_wy_operands_reference_bwd.default, {**wy_operands, "grad_1": 2, **GRADS},
          [2, 2, 2, 2])
    wy_recurrence = {"q": 2, "k": 2, "w": 2, "u": 2, "g": 2, "initial_state": 1}
    _rule(_ops.gdn_wy_recurrence_reference.default, wy_recurrence, [2, 1])
    _rule(_ops.gdn_wy_recurrence_reference_bwd.default,
          {**wy_recurrence, "grad_0": 2, "grad_1": 1}, _delta_grads)

    def wy_operands_outputs(b):
        run = gdn_wy._operand_kernels(*_meta(b, "k", "v", "g", "beta", "cu_seqlens"),
                                      b["chunk_size"])
        return [2, 2] + _saved(run, gdn_wy.OPERANDS_SAVED)

    def wy_recurrence_outputs(b):
        run = gdn_wy._recurrence_kernels(
            *_meta(b, "q", "k", "w", "u", "g", "initial_state", "cu_seqlens"),
            b["chunk_size"], b["state_qdq"], b["state_qdq_block_v"])
        return [2, 1] + _saved(run, gdn_wy.RECURRENCE_SAVED)

    _rule(_ops.gdn_wy_operands.default, wy_operands, wy_operands_outputs)
    _rule(_ops.gdn_wy_operands_bwd.default, wy_operands, [2, 2, 2, 2])
    _rule(_ops.gdn_wy_recurrence.default, wy_recurrence, wy_recurrence_outputs)
    _rule(_ops.gdn_wy_recurrence_bwd.default,
          {**wy_recurrence, **gdn_wy.RECURRENCE_SAVED, **GRADS},
          lambda b: [2] * 5 + [_optional(1, b, "initial_state")])


def _register_diag_kdn():
    _rule(_ops.diag_kdn_reference.default, DIAG_KDN, [2, 1, 1])
    _rule(_ops.diag_kdn_reference_bwd.default,
          {**DIAG_KDN, "grad_0": 2, "grad_1": 1, "grad_2": 1}, [2] * 6 + [1, 1])

    def diag_kdn_outputs(b):
        q, k, v, log_alpha, omega, r, precision, cu = _meta(
            b, "q", "k", "v", "log_alpha", "omega", "r", "precision", "cu_seqlens")
        gains = kdn._gain_kernels(q, k, log_alpha, omega, r, precision, cu)
        memory = gains and kdn._memory_kernels(q, v, b["chunk_size"])
        return [2, 1, 1] + _saved(gains, kdn.GAIN_SAVED) + _saved(memory, kdn.TWO_KEY_SAVED)

    _rule(_ops.diag_kdn.default, DIAG_KDN, diag_kdn_outputs)
    _rule(_ops.diag_kdn_memory_bwd.default,
          {"q": 2, "k": 2, "v": 2, "log_alpha": 2, "gain": 2, "memory": 1, **kdn.TWO_KEY_SAVED,
           **GRADS}, [2] * 5 + [1])
    _rule(_ops.kalman_gain_bwd.default,
          {"k": 2, "log_alpha": 2, "omega": 2, "r": 2, "precision": 1, **kdn.GAIN_SAVED,
           "dgain": 2, "dprecision": 1, "dk_add": 2, "dlog_alpha_add": 2},
          [2, 2, 2, 2, 1])
    _rule(_ops.mobius_product_reference.default, {"maps": 2}, [1])
    _rule(_ops.mobius_product_reference_bwd.default, {"maps": 2, "grad_0": 1}, [2])


def _register_serving():
    decode = {**DELTA, "state_pool": 1, "pool_scales": 1, "intermediate_states": 2}
    for op in (_ops.delta_rule_decode, _ops.delta_rule_decode_reference):
        _rule(op.default, decode, [2], mutated=("state_pool", "pool_scales",
                                                "intermediate_states"))
    pools = {**DIAG_KDN, "memory_pool": 1, "precision_pool": 1, "intermediate_memory": 2,
             "intermediate_precision": 2}
    for op in (_ops.diag_kdn_decode, _ops.diag_kdn_decode_reference):
        _rule(op.default, pools, [2], mutated=("memory_pool", "precision_pool",
                                               "intermediate_memory", "intermediate_precision"))
    for op in (_ops.chunk_checkpoints, _ops.chunk_checkpoints_reference):
        _rule(op.default, DELTA, [2, 1, 2])  # o, final state, states [N, C, Hv, K, V]
    for op in (_ops.diag_kdn_checkpoints, _ops.diag_kdn_checkpoints_reference):
        _rule(op.default, DIAG_KDN, [2, 1, 1, 2, 2])  # and memories, precisions [N, C, H, ...]
    for op in (_ops.scatter_slots, _ops.scatter_slots_reference):
        register_sharding(op.default)(_scatter_rule(op.default))
    for op in (_ops.state_fp8_qdq, _ops.state_fp8_qdq_reference,
               _ops.state_fp8_qdq_reference_bwd):
        register_sharding(op.default)(_leading_dims_rule(op.default))


def _scatter_rule(op):
    """``pool[indices] = rows``: pool and rows alike (any dim but the slots), the pool's own
    placement."""
    def rule(pool, indices, rows):
        placements = set(pool.placements) | set(rows.placements)
        if len(placements) > 1 or any(p.is_partial() or (p.is_shard() and p.dim % pool.ndim == 0)
                                      for p in placements):
            raise ValueError(
                f"kdn::scatter_slots: pool {tuple(pool.placements)} and rows "
                f"{tuple(rows.placements)} must share one placement, Replicate or Shard on a "
                f"dim after the slots")
        (placement,) = placements
        return [([], [placement, Replicate(), placement])]
    return rule


def _leading_dims_rule(op):
    """The FP8 state QDQ: tiles of ``[K, block_v]``, so any dim before the last two."""
    def rule(state, block_v, *grad):
        for spec in (state, *grad):
            for p in spec.placements:
                if p.is_partial() or (p.is_shard() and p.dim % spec.ndim >= spec.ndim - 2):
                    raise ValueError(
                        f"kdn::{op._schema.name.split('::')[1]}: the state has placements "
                        f"{tuple(spec.placements)}; shard it on a dim before [K, V] or "
                        f"replicate it")
        placements = set(state.placements)
        strategies = [([Replicate()], [Replicate(), None] + [Replicate()] * len(grad))]
        for p in placements:
            if p.is_shard():
                strategies.append(([p], [p, None] + [p] * len(grad)))
        return strategies
    return rule


def _register_exchange():
    state = {"o": 2, "u": 2, "end": 1, "carry": 1, "precision_end": 1, "gathered": FLAT,
             "grad_o": 2, "grad_final": 1, "grad_precision": 1}
    _rule(_ops.context_state_exchange.default, state,
          lambda b: [2, 1, _optional(1, b, "precision_end"), FLAT])
    _rule(_ops.context_state_exchange_bwd.default, state,
          lambda b: [2, _optional(2, b, "u"), 1, 1, _optional(1, b, "precision_end")])
    covariance = {"carry_map": 1, "precision": 1, "gathered": FLAT, "grad_start": 1}
    _rule(_ops.context_covariance_exchange.default, covariance, [1, FLAT])
    _rule(_ops.context_covariance_exchange_bwd.default, covariance, [1, 1])


_register_delta_rule()
_register_diag_kdn()
_register_serving()
_register_exchange()
