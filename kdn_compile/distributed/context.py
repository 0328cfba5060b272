"""Context parallelism: the time axis split over the ranks of a process group.

Rank ``r`` of a group of ``R`` holds tokens ``[r L, (r + 1) L)`` of the same batch
(``T = R L``). Each rank runs its slice through the ordinary op twice before any
communication: once with its values from the initial state it knows (zeros where a
sequence continues from an earlier rank) and once with zero values from the identity,
whose final state is the slice's state map ``A`` (``S_end = A S_in + B``, ``A`` ``[K, K]``
per head) and whose output ``u_t`` is what the true incoming state adds to
``o_t`` (``S_in^T u_t``). One all-gather shares every rank's ``(B, A)``; each rank chains
them in rank order for the state entering its slice and the global final state, then
corrects its output. Diag-KDN first shares each rank's covariance map (a product of
2x2 Mobius maps) the same way, so that its gains, and with them ``A`` and ``B``, are the
true ones. Layout bookkeeping: :mod:`kdn_compile.distributed._layout`.

The exchanges are ``kdn`` ops with registered autograd
(:mod:`kdn_compile.ops.exchange`: PyTorch's functional all-gather forward,
reduce-scatter backward) and the rest is ordinary ``kdn`` ops and tensor algebra, so a
training step through these functions compiles with ``torch.compile(fullgraph=True)``.
The cost per rank is in :doc:`/distributed`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from kdn_compile import api
from kdn_compile._checks import (
    check_delta_inputs, check_flag, check_float, check_kdn_inputs, fail, type_name,
)
from kdn_compile.distributed._layout import SliceLayout
from kdn_compile.reference._common import state_key_first, work_dtype
from kdn_compile.reference.kdn import DEFAULT_CHUNK_SIZE, covariance_step_maps

__all__ = ["chunk_gdn", "chunk_kda", "diag_kdn"]

_ops = torch.ops.kdn


def group_rank_and_size(group) -> tuple:
    """``(group name, rank, size)`` of ``group`` (None: the default group).

    Raises:
        RuntimeError: torch.distributed is not available or not initialized.
        TypeError: ``group`` is not a ProcessGroup.
    """
    if not dist.is_available() or not dist.is_initialized():
        fail(RuntimeError, "context parallelism needs an initialized process group: call "
                           "torch.distributed.init_process_group first")
    if group is None:
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        fail(TypeError, f"group must be a torch.distributed.ProcessGroup or None, "
                        f"got {type_name(group)}")
    return group.group_name, dist.get_rank(group), dist.get_world_size(group)


# -- GDN and KDA ------------------------------------------------------------------------


class DeltaSlice(NamedTuple):
    """One rank's work before the exchange: its layout, the value run's ``o`` and final
    state ``end``, the identity run's output ``u`` (None on rank 0) and ``carry`` (``A``)."""

    layout: SliceLayout
    o: torch.Tensor
    u: torch.Tensor | None
    end: torch.Tensor
    carry: torch.Tensor


def delta_rule_slice(run: Callable, layout: SliceLayout, q, k, v, g, beta, initial_state,
                     **options) -> DeltaSlice:
    """Both runs of one rank's slice through ``run`` (``kdn_compile.chunk_gdn`` or
    ``chunk_kda``); ``initial_state`` key-first or None; ``options`` go to ``run``."""
    heads, key_dim = v.shape[2], q.shape[3]
    o, end = run(q, k, v, g, beta, initial_state=layout.known_starts(initial_state),
                 cu_seqlens=layout.local_cu, **options)
    if layout.rank == 0:
        return DeltaSlice(layout, o, None, end, end.new_zeros(layout.carry_shape(heads, key_dim)))
    zeros = v.new_zeros(v.shape[:3] + (key_dim,))
    u, carry = run(q, k, zeros, g, beta, initial_state=layout.identity_starts(heads, key_dim, end),
                   cu_seqlens=layout.local_cu, **options)
    return DeltaSlice(layout, o, u, end, layout.carry_rows(carry))


def _delta_rule(run, gate, q, k, v, g, beta, group, chunk_size, scale, initial_state,
                cu_seqlens, state_v_first):
    group_name, rank, world = group_rank_and_size(group)
    layout = SliceLayout(q, cu_seqlens, rank, world)
    check_delta_inputs(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=layout.local_cu,
                       state_v_first=state_v_first, gate=gate, chunk_size=chunk_size)
    check_flag("state_v_first", state_v_first)
    state = None if initial_state is None else state_key_first(initial_state, state_v_first)
    part = delta_rule_slice(run, layout, q, k, v, g, beta, state, chunk_size=chunk_size,
                            scale=scale)
    o, final, _, _ = _ops.context_state_exchange(
        part.o, part.u, part.end, part.carry, None, **layout.chain(), group_name=group_name)
    return o, (final.transpose(-1, -2).contiguous() if state_v_first else final)


_SHARED_DOC = """
    Every rank calls it with its own slice of the time axis: rank ``r`` of
    ``R = group.size()`` passes tokens ``[r L, (r + 1) L)`` of the same batch, ``L`` the
    same on every rank (the global length is ``T = R L``), and the same ``cu_seqlens``
    and initial states as every other rank. That contract is not checked across ranks:
    comparing them would take a collective and a host sync on every call.

    Args:
        group: the ``torch.distributed`` process group whose ranks share the sequence
            (None: the default group). It must be initialized.
        cu_seqlens: ``[N + 1]`` boundaries of packed sequences on the global axis
            ``[0, T]`` (``B == 1``); a sequence may span ranks, and a rank may hold
            pieces of several. Every rank must pass the same cu_seqlens (the same ``N``
            and the same values). Each rank checks its own (int32/int64, start at 0,
            never decrease, end at ``T``), but the ranks' tensors are not compared:
            ranks whose boundaries differ chain their slices by different sequences and
            return wrong outputs, and final states that differ from rank to rank,
            without an error; a different ``N`` gives the exchange's all-gather tensors
            of different sizes, which the backend may answer with an error, an abort of
            the process (gloo) or a hang.
        initial_state, memory, precision: the states of the ``N`` sequences at their
            starts (``initial_state`` for GDN and KDA, ``memory`` and ``precision`` for
            Diag-KDN), the same on every rank (not compared across ranks either).
        q, k, v, g, beta, log_alpha, omega, r: this rank's tokens, shaped as for the
            single-device function (with ``L`` for ``T``); the remaining arguments as
            there.

    Returns:
        As the single-device function: ``o`` for this rank's tokens; the final
        state(s) global (the state after each sequence's last token, wherever it
        lies), the same on every rank.

    Gradients are those of the sum of every rank's loss (the exchange's backward
    reduce-scatters the maps' gradients): each rank's slice inputs get their full
    gradient, as on one device. A replicated input (the initial state) gets on each rank the part that
    flows through that rank's work; the sum over the group is its full gradient (a
    data-parallel gradient reduction over the group sums it). A loss term on the
    replicated final state counts once per rank that adds it.

    Cost per rank: the slice's op twice, once with value width ``V`` and, on ranks
    after the first, once with value width ``K`` (zero values, identity initial
    state); one all-gather of ``[B, H, K, V + K]`` values per rank at fixed length
    (``[N, H, K, V]`` plus ``[1, H, K, K]`` with ``cu_seqlens``) in the states' dtype;
    then ``R`` small matrix products and one ``[L, K] x [K, V]`` product per head.
    See :doc:`/distributed`."""


def chunk_gdn(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
              group: dist.ProcessGroup | None = None, chunk_size: int = 64,
              scale: float | None = None, initial_state: Tensor | None = None,
              cu_seqlens: Tensor | None = None, state_v_first: bool = False,
              state_qdq: bool = False, state_qdq_block_v: int = 64,
              w_quantizer: Callable | None = None) -> tuple[Tensor, Tensor]:
    """:func:`kdn_compile.chunk_gdn` over a sequence split across the ranks of ``group``.
    {shared}

    ``state_qdq`` and ``w_quantizer`` are refused: a quantized state is not an affine
    map of the state before it.

    Raises:
        ValueError, TypeError: as :func:`kdn_compile.chunk_gdn`, with ``cu_seqlens``
            checked against ``T = R L`` on each rank (not against the other ranks');
            ValueError for ``state_qdq=True`` or a ``w_quantizer``; TypeError for a
            ``group`` that is not a ProcessGroup.
        RuntimeError: no initialized process group.

    Source: the gated delta rule is affine in its state (:doc:`/math`), so the
    slices' maps compose; :doc:`/distributed`.

    Example (on each of 2 ranks, after ``init_process_group``)::

        o, state = kdn_compile.distributed.chunk_gdn(q, k, v, g, beta)  # [B, T/2, ...] each
    """
    check_flag("state_qdq", state_qdq)
    if state_qdq or w_quantizer is not None:
        fail(ValueError, "context-parallel chunk_gdn does not take state_qdq=True or a "
                         "w_quantizer: a quantized state is not an affine map of the state "
                         "before it, so the ranks' slices cannot be chained")
    del state_qdq_block_v  # meaningful with state_qdq only
    return _delta_rule(api.chunk_gdn, "scalar", q, k, v, g, beta, group, chunk_size,
                       scale, initial_state, cu_seqlens, state_v_first)


def chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
              group: dist.ProcessGroup | None = None, chunk_size: int = 64,
              scale: float | None = None, initial_state: Tensor | None = None,
              cu_seqlens: Tensor | None = None,
              state_v_first: bool = False) -> tuple[Tensor, Tensor]:
    """:func:`kdn_compile.chunk_kda` over a sequence split across the ranks of ``group``.
    {shared}

    Raises:
        ValueError, TypeError: as :func:`kdn_compile.chunk_kda`, with ``cu_seqlens``
            checked against ``T = R L`` on each rank (not against the other ranks');
            TypeError for a ``group`` that is not a ProcessGroup.
        RuntimeError: no initialized process group.

    Source: as :func:`chunk_gdn`, with per-key decays (``A`` is a full ``[K, K]`` map).
    """
    return _delta_rule(api.chunk_kda, "per_key", q, k, v, g, beta, group, chunk_size,
                       scale, initial_state, cu_seqlens, state_v_first)


# -- Diag-KDN ---------------------------------------------------------------------------


def kdn_carry_map(layout: SliceLayout, k, log_alpha, omega, r, precision, *, info_scale):
    """This rank's covariance carry map ``[B, H, K, 4]``: the product of its tokens'
    Mobius maps, constant where its last sequence starts here."""
    dtype = precision.dtype
    maps = covariance_step_maps(*(x.to(dtype) for x in (k, log_alpha, omega, r)),
                                info_scale=info_scale)
    maps = layout.restart_maps(maps, precision.reciprocal())
    return torch.ops.kdn.mobius_product_reference(torch.stack(maps, dim=-1))


class KdnSlice(NamedTuple):
    """One rank's Diag-KDN work before the memory exchange (see :class:`DeltaSlice`);
    ``precision_end`` is the value run's final precision."""

    layout: SliceLayout
    o: torch.Tensor
    u: torch.Tensor | None
    end: torch.Tensor
    carry: torch.Tensor
    precision_end: torch.Tensor


def kdn_slice(layout: SliceLayout, q, k, v, log_alpha, omega, r, memory, precision,
              **options) -> KdnSlice:
    """Both runs of one rank's slice through :func:`kdn_compile.diag_kdn`; ``precision``
    ``[N, H, K]`` the precision each sequence enters the slice with."""
    heads, key_dim = v.shape[2], q.shape[3]
    o, end, precision_end = api.diag_kdn(
        q, k, v, log_alpha, omega, r, layout.known_starts(memory), precision,
        cu_seqlens=layout.local_cu, **options)
    if layout.rank == 0:
        carry = end.new_zeros(layout.carry_shape(heads, key_dim))
        return KdnSlice(layout, o, None, end, carry, precision_end)
    zeros = v.new_zeros(v.shape[:3] + (key_dim,))
    u, carry, _ = api.diag_kdn(
        q, k, zeros, log_alpha, omega, r, layout.identity_starts(heads, key_dim, end), precision,
        cu_seqlens=layout.local_cu, **options)
    return KdnSlice(layout, o, u, end, layout.carry_rows(carry), precision_end)


def diag_kdn(q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, omega: Tensor, r: Tensor,
             memory: Tensor, precision: Tensor, *, scale: float, info_scale: float,
             chunk_size: int = DEFAULT_CHUNK_SIZE, cu_seqlens: Tensor | None = None,
             group: dist.ProcessGroup | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`kdn_compile.diag_kdn` over a sequence split across the ranks of ``group``.
    {shared}

    Diag-KDN exchanges twice: first each rank's covariance map (the product of its
    tokens' 2x2 Mobius maps, ``[B, H, K, 4]``), from which each rank knows the
    precision entering its slice and so its true Kalman gains; then the memory maps as
    for GDN, with each rank's final precision (``[N, H, K]``).

    Raises:
        ValueError, TypeError: as :func:`kdn_compile.diag_kdn`, with ``cu_seqlens``
            checked against ``T = R L`` on each rank (not against the other ranks');
            TypeError for a ``group`` that is not a ProcessGroup.
        RuntimeError: no initialized process group.

    Source: the Diagonal KDN specification (:mod:`kdn_compile.reference.kdn`): the
    covariance step is a Mobius map and the memory is affine in its state.
    """
    group_name, rank, world = group_rank_and_size(group)
    layout = SliceLayout(q, cu_seqlens, rank, world)
    check_kdn_inputs(q, k, v, log_alpha, omega, r, memory, precision,
                     cu_seqlens=layout.local_cu, chunk_size=chunk_size)
    options = dict(scale=check_float("scale", scale),
                   info_scale=check_float("info_scale", info_scale), chunk_size=chunk_size)
    dtype = work_dtype(q.dtype)
    memory, precision = memory.to(dtype), precision.to(dtype)
    carry_map = kdn_carry_map(layout, k, log_alpha, omega, r, precision,
                              info_scale=options["info_scale"])
    start, _ = _ops.context_covariance_exchange(
        carry_map, precision, layout.carry_index, layout.continues, group_name)
    part = kdn_slice(layout, q, k, v, log_alpha, omega, r, memory, start, **options)
    o, memory, precision, _ = _ops.context_state_exchange(
        part.o, part.u, part.end, part.carry, part.precision_end, **layout.chain(),
        group_name=group_name)
    return o, memory, precision


for _function in (chunk_gdn, chunk_kda, diag_kdn):
    _function.__doc__ = _function.__doc__.replace("{shared}", _SHARED_DOC)
