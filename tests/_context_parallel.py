"""Context parallelism run rank by rank in one process: every rank's slice work, the
exchange as a stack of their maps, every rank's chaining by the math the exchange ops
run (:mod:`kdn_compile.reference.context`), without a process group."""

from __future__ import annotations

import torch

from kdn_compile.distributed._layout import SliceLayout
from kdn_compile.distributed.context import delta_rule_slice, kdn_carry_map, kdn_slice
from kdn_compile.reference._common import state_key_first
from kdn_compile.reference.context import (
    chain_states,
    continued_precision,
    corrected_output,
    incoming_covariance,
)


def _slices(tensors, world):
    length = tensors[0].shape[1] // world
    return [[t[:, r * length:(r + 1) * length] for t in tensors] for r in range(world)]


def _finish(part, rank, ends, carries, precision_ends=None):
    layout = part.layout
    chain = layout.chain()
    incoming, final = chain_states(ends, carries, rank, **chain)
    o = part.o if part.u is None else corrected_output(part.o, part.u, incoming, rank,
                                                       layout.carry_index)
    if precision_ends is None:
        return o, final
    return o, final, chain_states(precision_ends, None, rank, **chain)[1]


def emulate_delta(run, world, q, k, v, g, beta, *, initial_state=None, cu_seqlens=None,
                  state_v_first=False, **options):
    """``(o [B, T, ...], [final state of each rank])`` of ``world`` ranks."""
    state = None if initial_state is None else state_key_first(initial_state, state_v_first)
    parts = []
    for rank, (qs, ks, vs, gs, bs) in enumerate(_slices((q, k, v, g, beta), world)):
        layout = SliceLayout(qs, cu_seqlens, rank, world)
        parts.append(delta_rule_slice(run, layout, qs, ks, vs, gs, bs, state, **options))
    ends = torch.stack([p.end for p in parts])
    carries = torch.stack([p.carry for p in parts])
    done = [_finish(p, rank, ends, carries) for rank, p in enumerate(parts)]
    finals = [s.transpose(-1, -2) if state_v_first else s for _, s in done]
    return torch.cat([o for o, _ in done], dim=1), finals


def emulate_kdn(world, q, k, v, log_alpha, omega, r, memory, precision, *, scale, info_scale,
                cu_seqlens=None, chunk_size=64):
    """``(o, [memory of each rank], [precision of each rank])`` of ``world`` ranks."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    memory, precision = memory.to(dtype), precision.to(dtype)
    slices = _slices((q, k, v, log_alpha, omega, r), world)
    layouts = [SliceLayout(s[0], cu_seqlens, rank, world) for rank, s in enumerate(slices)]
    maps = torch.stack([
        kdn_carry_map(layout, s[1], s[3], s[4], s[5], precision, info_scale=info_scale)
        for layout, s in zip(layouts, slices)])
    parts = []
    for rank, (layout, s) in enumerate(zip(layouts, slices)):
        start = continued_precision(precision, incoming_covariance(maps, rank), rank,
                                    layout.carry_index, layout.continues)
        parts.append(kdn_slice(layout, *s, memory, start, scale=scale, info_scale=info_scale,
                               chunk_size=chunk_size))
    stacked = [torch.stack([getattr(p, n) for p in parts]) for n in ("end", "carry",
                                                                      "precision_end")]
    done = [_finish(p, rank, *stacked) for rank, p in enumerate(parts)]
    return (torch.cat([d[0] for d in done], dim=1), [d[1] for d in done],
            [d[2] for d in done])
