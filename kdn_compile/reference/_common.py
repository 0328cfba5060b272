"""Helpers shared by the reference recurrences: working dtype, heads, sequences."""

from __future__ import annotations

import torch


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The working dtype of ``dtype`` inputs, ``promote_types(dtype, float32)``: float32 for
    half and float32 inputs, float64 for float64. The references accumulate in it, and the
    recurrent states (the ops' and the layers') are kept in it."""
    return torch.promote_types(dtype, torch.float32)


def to_work(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in its :func:`work_dtype`."""
    return tensor.to(work_dtype(tensor.dtype))


def heads_first(tensor: torch.Tensor, value_heads: int) -> torch.Tensor:
    """``[B, T, H, ...]`` -> ``[B, Hv, T, ...]``, repeating grouped key heads.

    Value head ``h`` reads key head ``h // (Hv // Hk)``.
    """
    heads = tensor.shape[2]
    if heads != value_heads:
        tensor = tensor.repeat_interleave(value_heads // heads, dim=2)
    return tensor.transpose(1, 2)


def segments(
    cu_seqlens: torch.Tensor | None, batch: int, length: int
) -> list[tuple[slice, slice]]:
    """``(state rows, time slice)`` of each independent run of the recurrence.

    Fixed-length batches are one run over every row; packed sequences
    (``cu_seqlens``, read on the CPU) are one run each, with batch size one.
    """
    if cu_seqlens is None:
        return [(slice(0, batch), slice(0, length))]
    bounds = [int(x) for x in cu_seqlens.detach().cpu().tolist()]
    return [
        (slice(n, n + 1), slice(bounds[n], bounds[n + 1]))
        for n in range(len(bounds) - 1)
    ]


def state_key_first(state: torch.Tensor, state_v_first: bool) -> torch.Tensor:
    """View a state as ``[N, H, K, V]`` whatever layout it arrived in."""
    return state.transpose(-1, -2) if state_v_first else state


def causal_mask(size: int, device: torch.device, *, strict: bool) -> torch.Tensor:
    """Lower-triangular boolean mask, diagonal excluded when ``strict``."""
    return torch.ones(size, size, dtype=torch.bool, device=device).tril(
        -1 if strict else 0
    )


def decay_between(cumulative: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``exp(c_t - c_s)`` where ``mask[t, s]``, else 0; ``cumulative`` is ``[..., L]``."""
    difference = cumulative[..., :, None] - cumulative[..., None, :]
    return torch.where(mask, difference, float("-inf")).exp()
