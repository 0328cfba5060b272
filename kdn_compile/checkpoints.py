"""Prefix-cache checkpoints: a prompt's prefill that also keeps its states in pool slots.

A recurrent model's prefix cache needs the state after the first ``m`` tokens of a prompt
(a shared system prompt, a conversation's earlier turns), which a plain prefill passes
through without keeping. :func:`chunk_checkpoints` runs the chunked GDN or KDA prefill of
packed or batched prompts and writes the state after every ``checkpoint_every`` tokens of
each sequence into pool slots named per sequence. A later prompt that starts with the
same ``m`` tokens copies that slot into its own and prefills only the rest
(``initial_state``), with the outputs and final state of the whole prompt: bit for bit
on CUDA with a float32 pool (``m`` is a multiple of the chunk size, so the chunks start at
the same tokens), within the pool's rounding for bfloat16 and float8 pools.
"""

from __future__ import annotations

import torch

import kdn_compile.ops  # noqa: F401  (registers torch.ops.kdn)
from kdn_compile.api import _scale
from kdn_compile._checks import (
    check_delta_inputs, check_no_tangents, check_pool, check_slot_values, dims, fail,
    num_sequences, shown, type_name,
)
from kdn_compile.debug import check_values
from kdn_compile.ops._dispatch import serving_op
from kdn_compile.ops.checkpoints import (
    CHUNK, chunk_checkpoints_body, diag_kdn_checkpoints_body,
)
from kdn_compile.serving import _POOL_DTYPES, _check_inference, check_pool_scales, write_states

__all__ = ["chunk_checkpoints"]

_ops = torch.ops.kdn


def _check_every(checkpoint_every) -> int:
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int):
        fail(TypeError, f"checkpoint_every must be an int, got {type_name(checkpoint_every)}")
    if checkpoint_every < CHUNK or checkpoint_every % CHUNK or checkpoint_every >= 2**31:
        fail(ValueError, f"checkpoint_every must be a positive multiple of the chunk size "
                         f"{CHUNK} below 2**31, got {shown(checkpoint_every)}")
    return checkpoint_every


def _check_indices(checkpoint_indices, rows: int, device) -> int:
    if not isinstance(checkpoint_indices, torch.Tensor):
        fail(TypeError, f"checkpoint_indices must be a torch.Tensor, got "
                        f"{type_name(checkpoint_indices)}")
    if checkpoint_indices.dtype not in (torch.int32, torch.int64):
        fail(TypeError, f"checkpoint_indices must be int32 or int64, got "
                        f"{checkpoint_indices.dtype}")
    if checkpoint_indices.dim() != 2 or checkpoint_indices.shape[0] != rows:
        fail(ValueError, f"checkpoint_indices must be [N, C] with N = {rows} sequences, got "
                         f"{dims(checkpoint_indices.shape)}")
    if checkpoint_indices.device != device:
        fail(ValueError, f"checkpoint_indices is on {checkpoint_indices.device} but q is on "
                         f"{device}")
    return checkpoint_indices.shape[1]


def kept_slots(checkpoint_indices: torch.Tensor, checkpoint_every: int,
                cu_seqlens: torch.Tensor | None, batch: int, length: int) -> torch.Tensor:
    """``checkpoint_indices [N, C]`` flattened, -1 where checkpoint ``c`` of sequence ``n``
    does not exist (the sequence has fewer than ``(c + 1) * checkpoint_every`` tokens);
    computed on the device, no host sync."""
    # from the arguments' own tensors (DTensors under tensor parallelism stay DTensors)
    ends = torch.ones_like(checkpoint_indices, dtype=torch.int64).cumsum(1) * checkpoint_every
    if cu_seqlens is None:  # (from a sum: a C of 0 has no column to take the shape of)
        lengths = torch.full_like(ends.sum(1), length)
    else:
        lengths = cu_seqlens[1:].to(torch.int64) - cu_seqlens[:-1].to(torch.int64)
    exists = ends <= lengths[:, None]
    return torch.where(exists, checkpoint_indices, -1).flatten()


def check_checkpoints(checkpoint_indices, checkpoint_every, rows: int, device) -> int:
    """Validate the checkpoint arguments (see :func:`chunk_checkpoints`); returns ``C``."""
    _check_every(checkpoint_every)
    return _check_indices(checkpoint_indices, rows, device)


def prefill_states(q, k, v, g, beta, *, checkpoint_every: int, checkpoints: int,
                   scale: float | None, initial_state, cu_seqlens):
    """The prefill of :func:`chunk_checkpoints` without the pool write, for arguments
    already checked: ``(o, final_state, states [N * C, Hv, K, V])`` (the slots:
    :func:`kept_slots`)."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    op = serving_op(q, _ops.chunk_checkpoints, _ops.chunk_checkpoints_reference,
                    chunk_checkpoints_body)
    o, final_state, states = op(q, k, v, g, beta, initial_state, cu_seqlens, scale,
                                checkpoint_every, checkpoints)
    return o, final_state, states.flatten(0, 1)


def diag_kdn_prefill_states(q, k, v, log_alpha, omega, r, memory, precision, *,
                            checkpoint_every: int, checkpoints: int, scale: float,
                            info_scale: float, cu_seqlens):
    """Diag-KDN's prefill with its states at checkpoints, for arguments already checked:
    ``(output, memory, precision, memories [N * C, H, K, V], precisions [N * C, H, K])``
    (the slots: :func:`kept_slots`). Resuming from such a state continues the prompt
    within rounding (the gain scan composes its chunks in another order)."""
    op = serving_op(q, _ops.diag_kdn_checkpoints, _ops.diag_kdn_checkpoints_reference,
                    diag_kdn_checkpoints_body)
    output, memory, precision, memories, precisions = op(
        q, k, v, log_alpha, omega, r, memory, precision, cu_seqlens, scale, info_scale,
        checkpoint_every, checkpoints)
    return output, memory, precision, memories.flatten(0, 1), precisions.flatten(0, 1)


def chunk_checkpoints(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    checkpoint_indices: torch.Tensor,
    *,
    checkpoint_every: int,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    pool_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked GDN or KDA prefill that writes each sequence's state after every
    ``checkpoint_every`` tokens into the pool slots ``checkpoint_indices`` name.

    The outputs and final state are those of :func:`kdn_compile.chunk_gdn` (scalar gates
    ``g [B, T, Hv]``) or :func:`kdn_compile.chunk_kda` (per-key gates ``g [B, T, Hv, K]``)
    over the same inputs, bit for bit on the same device. In place, slot
    ``checkpoint_indices[n, c]`` receives the state of sequence ``n`` after its first
    ``(c + 1) * checkpoint_every`` tokens, rounded to the pool's dtype (float8: quantized
    with one scale per ``[K, 64]`` tile into ``pool_scales``, as the decode kernels
    quantize). Negative indices, and checkpoints past a
    sequence's end, write nothing. Nothing synchronizes with the host: the call compiles
    with ``fullgraph=True`` and replays in a CUDA graph. Inference only.

    Resuming: a prompt whose first ``m = (c + 1) * checkpoint_every`` tokens are those of
    sequence ``n`` runs its remaining tokens with ``initial_state`` the slot's state (a
    float8 slot dequantized first:
    ``kdn_compile.reference.fp8.dequantize_state_fp8(pool[s:s + 1], pool_scales[s:s + 1])``)
    and gets the outputs of those tokens and the final state of the whole prompt: bit for
    bit on CUDA with a float32 pool (the chunks start at the same tokens), on the CPU
    within float32 rounding, and within the pool's rounding for bfloat16 and float8 pools.
    The layers' ``step`` does all of this for a whole cache (Diag-KDN included).

    Args:
        q, k: ``[B, T, Hk, K]`` unit-norm keys; v: ``[B, T, Hv, V]``; g: natural-log
            decays ``[B, T, Hv]`` (GDN) or ``[B, T, Hv, K]`` (KDA); beta: ``[B, T, Hv]``.
        state_pool: ``[S, Hv, K, V]`` float32, bfloat16, float8_e4m3fn or float64
            (float64 inputs), contiguous, key-first.
        checkpoint_indices: ``[N, C]`` int32/int64 slots on ``q``'s device, ``N`` the
            sequences (``B``, or ``len(cu_seqlens) - 1``); those of kept checkpoints
            distinct and ``< S`` (checked on the device).
        checkpoint_every: tokens between checkpoints, a positive multiple of the chunk
            size 64.
        scale: output scale (default ``K ** -0.5``).
        initial_state: ``[N, Hv, K, V]`` key-first, or None for zeros.
        cu_seqlens: ``[N + 1]`` packed-sequence boundaries (``B == 1``), or None.
        pool_scales: ``[S, Hv, ceil(V / 64)]`` float32 with a float8 pool, else None.

    Returns:
        ``(o, final_state)``: ``o [B, T, Hv, V]`` like ``v``; ``final_state [N, Hv, K, V]``
        (float32; float64 for float64 inputs).

    Raises:
        ValueError, TypeError: naming the argument: inputs as :func:`kdn_compile.chunk_gdn`
            refuses them, ``checkpoint_every`` not a positive multiple of 64,
            ``checkpoint_indices`` not ``[N, C]`` int32/int64 on ``q``'s device,
            ``state_pool`` not ``[S, Hv, K, V]`` of those dtypes on ``q``'s device and
            contiguous, ``pool_scales`` missing for a float8 pool (or given for another).
        RuntimeError: inputs that require grad while grad mode is on; on the CPU, bad
            slot indices.

    Source: the chunked recurrences of the GDN and KDA specifications
    (:func:`kdn_compile.reference.checkpoints.chunk_checkpoints_reference`).
    """
    gate = "per_key" if isinstance(g, torch.Tensor) and g.dim() == 4 else "scalar"
    check_delta_inputs(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                       gate=gate, chunk_size=CHUNK)
    check_checkpoints(checkpoint_indices, checkpoint_every, num_sequences(q.shape[0], cu_seqlens),
                      q.device)
    hv, dk, dv = v.shape[2], k.shape[3], v.shape[3]
    dtypes = (torch.float64,) if q.dtype == torch.float64 else _POOL_DTYPES
    slots = check_pool("state_pool", state_pool, "[S, Hv, K, V]", (hv, dk, dv), dtypes,
                       q.device)
    check_pool_scales(state_pool, pool_scales, False, slots, q.device, beside="state_pool")
    scale = _scale(scale, q)
    _check_inference("prefills that keep checkpoints", q=q, k=k, v=v, g=g, beta=beta,
                     initial_state=initial_state, state_pool=state_pool)
    check_values("chunk_checkpoints", q=q, k=k, v=v, g=g, beta=beta)
    check_no_tangents("chunk_checkpoints", q=q, k=k, v=v, g=g, beta=beta)
    kept = kept_slots(checkpoint_indices, checkpoint_every, cu_seqlens, q.shape[0], q.shape[1])
    check_slot_values(kept, slots, name="checkpoint_indices")
    o, final_state, states = prefill_states(
        q, k, v, g, beta, checkpoint_every=checkpoint_every,
        checkpoints=checkpoint_indices.shape[1], scale=scale, initial_state=initial_state,
        cu_seqlens=cu_seqlens)
    with torch.no_grad():
        write_states(state_pool, pool_scales, kept, states)
    return o, final_state
