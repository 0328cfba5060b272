"""Decode steps over state pools: the serving path's public functions.

A serving engine keeps the recurrent state of every live sequence in one pool whose
first dimension is the slot (``[S, Hv, K, V]``), and names each batch row's slot with
``state_indices``. A step reads the named slots, advances them by the row's ``T``
tokens and writes them back in place; slots not named are untouched. A negative index
marks a padding row (a batch padded to a size captured in a CUDA graph): its output is
zeros and no slot is read or written. Nothing here synchronizes with the host, so a
step can be captured in a CUDA graph (``torch.compile(..., mode="reduce-overhead")``).

Each function validates its arguments, then calls one ``torch.ops.kdn`` op whose
schema declares the mutated pools: the Triton kernel op on CUDA (backend ``"auto"``),
the exact reference op elsewhere (CPU, float64, backend ``"reference"``). Called eagerly
on plain CUDA tensors, the kernel op's body runs directly (the same code, without the
dispatcher's host time).
"""

from __future__ import annotations

import torch

import kdn_compile.ops  # noqa: F401  (registers torch.ops.kdn)
from kdn_compile._backend import prefer_kernels
from kdn_compile._checks import check_delta_inputs, check_float, check_flag, check_kdn_inputs
from kdn_compile._checks import (
    check_no_tangents, check_pool, check_slot_indices, check_slot_values, check_tensor, dims,
    fail, shown,
)
from kdn_compile.debug import check_values
from kdn_compile.ops._dispatch import serving_op
from kdn_compile.ops.decode import delta_rule_decode_body, diag_kdn_decode_body
from kdn_compile.reference._common import work_dtype
from kdn_compile.reference.fp8 import quantize_state_fp8
from kdn_compile.reference.pools import POOL_BLOCK_V

__all__ = ["MAX_DECODE_TOKENS", "commit_diag_kdn_states", "commit_states", "delta_rule_decode",
           "diag_kdn_decode"]

_ops = torch.ops.kdn

MAX_DECODE_TOKENS = 8
"""Most tokens per row in one decode step (``T > 1``: speculative-decoding verification)."""

_POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float64)
_INTERMEDIATE_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
# Diag-KDN's memory pools (its precision pools: the working dtype of the memory's)
KDN_MEMORY_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def write_slots(pool: torch.Tensor, indices: torch.Tensor, rows: torch.Tensor) -> None:
    """``pool[indices[b]] = rows[b]`` (cast to the pool's dtype) where ``indices[b] >= 0``."""
    op = torch.ops.kdn.scatter_slots if prefer_kernels(pool.device.type) else (
        torch.ops.kdn.scatter_slots_reference)
    op(pool, indices.contiguous(), rows.to(pool.dtype).contiguous())


def write_states(pool: torch.Tensor, scales: torch.Tensor | None, indices: torch.Tensor,
                 states: torch.Tensor, state_v_first: bool = False) -> None:
    """``states [N, ...]`` (in the pool's layout) into the slots ``indices`` of ``pool``
    (negative: skipped), rounded to its dtype; into a float8 pool quantized as the decode
    kernels quantize (:func:`kdn_compile.reference.fp8.quantize_state_fp8`, one scale per
    ``[K, 64]`` tile of the key-first state, into ``scales``)."""
    if pool.dtype == torch.float8_e4m3fn:
        key_first = states.transpose(-1, -2) if state_v_first else states
        values, tile_scales = quantize_state_fp8(key_first.float(), POOL_BLOCK_V)
        write_slots(scales, indices, tile_scales)
        states = values.transpose(-1, -2) if state_v_first else values
    write_slots(pool, indices, states)


def _check_inference(what: str = "decode steps", **tensors) -> None:
    """Decode steps (or ``what``) have no autograd: refuse inputs that would need it, before
    any pool is written (rather than an error at ``backward``)."""
    if torch.is_grad_enabled():
        needing = [n for n, t in tensors.items() if t is not None and t.requires_grad]
        if needing:
            fail(RuntimeError,
                 f"{what} are inference only, but {', '.join(needing)} require grad: call "
                 "under torch.no_grad() (or detach them); train with chunk_gdn / chunk_kda / "
                 "diag_kdn or recurrent_delta_rule")


def _check_tokens(q: torch.Tensor) -> None:
    if not 1 <= q.shape[1] <= MAX_DECODE_TOKENS:
        fail(ValueError,
             f"a decode step takes 1 <= T <= {MAX_DECODE_TOKENS} tokens per row, got T = "
             f"{shown(q.shape[1])} (q {dims(q.shape)}); prefill with chunk_gdn / chunk_kda / "
             "diag_kdn")


def delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    scale: float | None = None,
    state_v_first: bool = False,
    pool_scales: torch.Tensor | None = None,
    intermediate_states: torch.Tensor | None = None,
    update_state: bool = True,
) -> torch.Tensor:
    """One decode step of Gated DeltaNet (``g [B, T, Hv]``) or KDA (``g [B, T, Hv, K]``)
    over a state pool, updated in place.

    Per row ``b`` and value head, from the state ``S`` in slot ``state_indices[b]``:
    ``S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``,
    ``o_t = scale * S_t^T q_t`` for its ``T`` tokens, then ``S_T`` goes back to the slot.

    Args:
        q, k: ``[B, T, Hk, K]`` (L2-normalized), float16/bfloat16/float32 (float64 runs
            the reference), ``1 <= T <= 8``.
        v: ``[B, T, Hv, V]``, q's dtype; value head ``h`` reads key head ``h // (Hv // Hk)``.
        g: natural-log decays (``<= 0``, ``-inf`` a hard reset; checked in debug mode
            only, :mod:`kdn_compile.debug`), ``[B, T, Hv]`` (GDN) or ``[B, T, Hv, K]`` (KDA).
        beta: ``[B, T, Hv]`` write strengths.
        state_pool: ``[S, Hv, K, V]`` (``[S, Hv, V, K]`` with ``state_v_first``),
            contiguous, float32, bfloat16 or float8_e4m3fn (float64: reference only),
            on q's device. The recurrence runs in float32 from the slot's state; the
            new state is rounded to the pool's dtype once per step.
        state_indices: ``[B]`` int32/int64 slots on q's device; negative: padding row.
            Non-negative indices must be distinct and ``< S``: checked on the device
            (a device-side assert, no host sync; on the CPU a RuntimeError).
        scale: output scale, default ``K ** -0.5``.
        state_v_first: the pool (and ``intermediate_states``) are value-major.
        pool_scales: required with a float8 pool, else None: ``[S, Hv, ceil(V / 64)]``
            float32, one scale per ``[K, 64]`` tile of the key-first state (the tiling of
            :func:`kdn_compile.reference.state_fp8_qdq_reference`); updated in place. The
            kernels dequantize on load and quantize on store exactly as
            :func:`kdn_compile.reference.fp8.quantize_state_fp8` (bit for bit on the same
            float32 state): a tile whose ``amax * (1 / 448)`` falls below ``2^-126`` (a
            state decayed to almost nothing) is stored as zeros with scale 1, as a fresh
            slot is.
        intermediate_states: optional ``[B, T, Hv, K, V]`` (value-major with
            ``state_v_first``) float32, bfloat16 or float64 (a float64 pool takes
            float64 only; float64 runs the exact reference), contiguous: receives the
            state after every token, so a verifier can roll back to the last accepted
            token. Padding rows leave theirs untouched.
        update_state: False leaves ``state_pool`` and ``pool_scales`` as they are (a
            speculative-decoding verification: the states go to
            ``intermediate_states``, and :func:`commit_states` then writes each row's
            state after its accepted tokens, or none; without ``intermediate_states`` the
            step computes outputs only).

    Returns:
        ``o [B, T, Hv, V]`` in ``v``'s dtype, zeros on padding rows.

    Raises:
        ValueError, TypeError: naming the argument, before any kernel runs: inputs as
            :func:`kdn_compile.recurrent_delta_rule`; ``T`` outside ``1..8``; a pool of
            another shape, dtype or device, or not contiguous; indices of the wrong
            dtype, shape or device; a float8 pool without ``pool_scales`` (or scales with
            another pool); ``intermediate_states`` of another shape or dtype.
        RuntimeError: an input requires grad while grad mode is on (decode is inference
            only); on the CPU, indices repeating a slot or past the pool.

    Source: the token recurrence of :func:`kdn_compile.reference.recurrent_delta_rule_reference`;
    :func:`kdn_compile.reference.pools.delta_rule_decode_reference` is the exact oracle.
    """
    check_delta_inputs(q, k, v, g, beta, gate="any")
    _check_tokens(q)
    _check_inference(q=q, k=k, v=v, g=g, beta=beta, state_pool=state_pool,
                     pool_scales=pool_scales, intermediate_states=intermediate_states)
    check_flag("state_v_first", state_v_first)
    check_flag("update_state", update_state)
    b, t, _, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    layout = "[S, Hv, V, K]" if state_v_first else "[S, Hv, K, V]"
    state_shape = (hv, dv, dk) if state_v_first else (hv, dk, dv)
    slots = check_pool("state_pool", state_pool, layout, state_shape, _POOL_DTYPES, q.device)
    float8 = state_pool.dtype == torch.float8_e4m3fn
    if float8 and pool_scales is None:
        fail(ValueError, "a float8_e4m3fn state_pool needs pool_scales [S, Hv, ceil(V / 64)] "
                         "float32, got None")
    if not float8 and pool_scales is not None:
        fail(ValueError,
             f"pool_scales go with a float8_e4m3fn state_pool, got a {state_pool.dtype} pool")
    if pool_scales is not None:
        tiles = -(-dv // POOL_BLOCK_V)
        check_pool("pool_scales", pool_scales, "[S, Hv, ceil(V / 64)]", (hv, tiles),
                   (torch.float32,), q.device, slots=slots)
    if intermediate_states is not None:
        allowed = (torch.float64,) if state_pool.dtype == torch.float64 else _INTERMEDIATE_DTYPES
        check_pool("intermediate_states", intermediate_states,
                   "[B, T, Hv, V, K]" if state_v_first else "[B, T, Hv, K, V]",
                   (t,) + state_shape, allowed, q.device, slots=b)
    check_slot_indices(state_indices, b, slots, q.device)
    check_values("delta_rule_decode", resets=True, q=q, k=k, v=v, g=g, beta=beta)
    check_no_tangents("delta_rule_decode", q=q, k=k, v=v, g=g, beta=beta)
    op = serving_op(q, _ops.delta_rule_decode, _ops.delta_rule_decode_reference,
                    delta_rule_decode_body)
    scale = dk**-0.5 if scale is None else check_float("scale", scale)
    return op(q, k, v, g, beta, state_pool, state_indices, scale, state_v_first, pool_scales,
              intermediate_states, update_state)


def commit_states(
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    intermediate_states: torch.Tensor,
    accepted: torch.Tensor,
    *,
    pool_scales: torch.Tensor | None = None,
    state_v_first: bool = False,
) -> None:
    """Commit a speculative-decoding verification: each row's state after its accepted
    tokens goes into its slot, in place.

    After ``delta_rule_decode(..., intermediate_states=states, update_state=False)`` over
    ``T`` draft tokens per row, row ``b`` with ``accepted[b] = a``: for ``a >= 1`` slot
    ``state_indices[b]`` gets ``states[b, a - 1]`` (the state after its first ``a``
    tokens), rounded to the pool's dtype (float8: quantized with one scale per ``[K, 64]``
    tile, as :func:`kdn_compile.reference.fp8.quantize_state_fp8`, into ``pool_scales``);
    for ``a = 0`` the slot keeps the state from before the verification. Padding rows
    (negative indices) write nothing. With a float32 pool, float32 intermediate states and
    inputs in float32 or half precision, verifying ``T`` tokens and committing ``a`` leaves
    the slot where ``a`` one-token steps would have left it, bit for bit on the CPU (the
    references and the kernels in Triton's interpreter) and on CUDA (the kernel rounds the
    same products whether it updates the pool or keeps intermediate states). Nothing
    synchronizes with the host: a commit replays in a CUDA graph.

    Args:
        state_pool: ``[S, Hv, K, V]`` (``[S, Hv, V, K]`` with ``state_v_first``),
            float32, bfloat16, float8_e4m3fn or float64, contiguous.
        state_indices: ``[B]`` int32/int64 slots on the pool's device, as
            :func:`delta_rule_decode` (non-negative ones distinct and ``< S``: checked
            on the device).
        intermediate_states: ``[B, T, Hv, K, V]`` (value-major with ``state_v_first``),
            float32, bfloat16 or float64, as :func:`delta_rule_decode` filled it.
        accepted: ``[B]`` int32/int64 on the pool's device, each in ``0..T``: checked
            on the device (a device-side assert on CUDA, a RuntimeError on the CPU).
        pool_scales: ``[S, Hv, ceil(V / 64)]`` float32 with a float8 pool, else None.
        state_v_first: the layout of the pool and the intermediate states.

    Raises:
        ValueError, TypeError: naming the argument: a pool, intermediate states, indices
            or ``accepted`` of another shape, dtype or device; a float8 pool without
            ``pool_scales`` (or scales with another pool).
        RuntimeError: on the CPU, ``accepted`` outside ``0..T`` or bad indices.

    Source: the token recurrence's states (:func:`delta_rule_decode`); the commit is a copy.
    """
    check_flag("state_v_first", state_v_first)
    b, t, slots = _check_intermediates(
        "intermediate_states", intermediate_states, "state_pool", state_pool,
        "[Hv, V, K]" if state_v_first else "[Hv, K, V]", _POOL_DTYPES)
    device = intermediate_states.device
    check_pool_scales(state_pool, pool_scales, state_v_first, slots, device,
                      beside="intermediate_states")
    check_slot_indices(state_indices, b, slots, device, beside="intermediate_states")
    check_slot_indices(accepted, b, slots, device, name="accepted",
                       beside="intermediate_states")
    _check_inference(state_pool=state_pool, intermediate_states=intermediate_states,
                     pool_scales=pool_scales)
    chosen, rows = _accepted_rows(state_indices, slots, accepted, intermediate_states)
    with torch.no_grad():
        write_states(state_pool, pool_scales, chosen, rows, state_v_first)


def _check_intermediates(name: str, intermediate, pool_name: str, pool, state: str,
                         pool_dtypes) -> tuple[int, int, int]:
    """``intermediate [B, T, *state]`` and ``pool [S, *state]`` alike (a float64 pool takes
    float64 intermediates only); returns ``(B, T, S)``."""
    check_tensor(name, intermediate, floating=False)
    if intermediate.dim() != 5:
        fail(ValueError, f"{name} must be [B, T, {state[1:-1]}] (5 dims), got shape "
                         f"{dims(intermediate.shape)}")
    b, t = intermediate.shape[:2]
    if t < 1:
        fail(ValueError, f"{name} must hold T >= 1 tokens, got shape {dims(intermediate.shape)}")
    slots = check_pool(pool_name, pool, "[S, " + state[1:], tuple(intermediate.shape[2:]),
                       pool_dtypes, intermediate.device, beside=name)
    allowed = (torch.float64,) if pool.dtype == torch.float64 else _INTERMEDIATE_DTYPES
    check_pool(name, intermediate, "[B, T, " + state[1:], (t,) + tuple(pool.shape[1:]), allowed,
               intermediate.device, slots=b, beside=name, written=False)
    return b, t, slots


def check_pool_scales(state_pool, pool_scales, state_v_first: bool, slots, device, *,
                      beside: str) -> bool:
    """``pool_scales`` given exactly with a float8 ``state_pool`` (``[S, Hv, ceil(V /
    64)]`` float32 on ``device``, the device of the argument ``beside``); returns whether
    the pool is float8."""
    float8 = state_pool.dtype == torch.float8_e4m3fn
    if float8 != (pool_scales is not None):
        fail(ValueError, "pool_scales go with a float8_e4m3fn state_pool (and it needs them), "
                         f"got a {state_pool.dtype} pool and pool_scales "
                         f"{'given' if pool_scales is not None else 'None'}")
    if float8:
        hv, dv = state_pool.shape[1], state_pool.shape[2 if state_v_first else 3]
        check_pool("pool_scales", pool_scales, "[S, Hv, ceil(V / 64)]",
                   (hv, -(-dv // POOL_BLOCK_V)), (torch.float32,), device, slots=slots,
                   beside=beside)
    return float8


def _accepted_rows(state_indices, slots: int, accepted, *intermediates: torch.Tensor):
    """``(chosen, *rows)``: each row's slot where it accepted any token (else -1), and from
    each of ``intermediates [B, T, ...]`` its state after its accepted tokens; the indices
    and ``accepted`` checked on the device."""
    b, t = intermediates[0].shape[:2]
    device = intermediates[0].device
    check_slot_values(state_indices, slots)
    if device.type != "meta":
        # T stays out of the message: formatting a symbolic T would specialize it
        torch._assert_async(((accepted >= 0) & (accepted <= t)).all(),
                            "accepted must be in 0..T, T the tokens of the intermediate states")
    rows, last = torch.arange(b, device=device), (accepted - 1).clamp_min(0)
    return (torch.where(accepted > 0, state_indices, -1),
            *(intermediate[rows, last] for intermediate in intermediates))


def commit_diag_kdn_states(
    memory_pool: torch.Tensor,
    precision_pool: torch.Tensor,
    state_indices: torch.Tensor,
    intermediate_memory: torch.Tensor,
    intermediate_precision: torch.Tensor,
    accepted: torch.Tensor,
) -> None:
    """Commit a Diag-KDN speculative-decoding verification, in place: as
    :func:`commit_states`, for the memory and the precision.

    After ``diag_kdn_decode(..., intermediate_memory=m, intermediate_precision=p,
    update_state=False)`` over ``T`` tokens, row ``b`` with ``a = accepted[b] >= 1``
    writes ``m[b, a - 1]`` (rounded to the memory pool's dtype) and ``p[b, a - 1]`` into
    slot ``state_indices[b]``; ``a = 0`` and padding rows write nothing. With a float32
    memory pool and float32 intermediates the slot is bit for bit what ``a`` one-token
    steps leave.

    Args:
        memory_pool: ``[S, H, K, V]`` float32, bfloat16 or float64; precision_pool
            ``[S, H, K]`` as :func:`diag_kdn_decode` takes them.
        state_indices: ``[B]`` int32/int64 slots (negative: padding), checked on the device.
        intermediate_memory: ``[B, T, H, K, V]``; intermediate_precision ``[B, T, H, K]``,
            as :func:`diag_kdn_decode` filled them.
        accepted: ``[B]`` int32/int64 in ``0..T``, checked on the device (a device-side
            assert on CUDA, a RuntimeError on the CPU).

    Raises:
        ValueError, TypeError: naming the argument: pools, intermediates, indices or
            ``accepted`` of another shape, dtype or device.
    """
    b, t, slots = _check_intermediates("intermediate_memory", intermediate_memory,
                                       "memory_pool", memory_pool, "[H, K, V]", KDN_MEMORY_DTYPES)
    device = intermediate_memory.device
    precision_dtype = work_dtype(memory_pool.dtype)
    check_pool("precision_pool", precision_pool, "[S, H, K]", tuple(memory_pool.shape[1:3]),
               (precision_dtype,), device, slots=slots, beside="intermediate_memory")
    check_pool("intermediate_precision", intermediate_precision, "[B, T, H, K]",
               (t,) + tuple(memory_pool.shape[1:3]), (precision_dtype,), device, slots=b,
               beside="intermediate_memory", written=False)
    check_slot_indices(state_indices, b, slots, device, beside="intermediate_memory")
    check_slot_indices(accepted, b, slots, device, name="accepted", beside="intermediate_memory")
    _check_inference(memory_pool=memory_pool, precision_pool=precision_pool,
                     intermediate_memory=intermediate_memory,
                     intermediate_precision=intermediate_precision)
    chosen, memory, precision = _accepted_rows(state_indices, slots, accepted,
                                               intermediate_memory, intermediate_precision)
    with torch.no_grad():
        write_slots(memory_pool, chosen, memory)
        write_slots(precision_pool, chosen, precision)


def diag_kdn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_alpha: torch.Tensor,
    omega: torch.Tensor,
    r: torch.Tensor,
    memory_pool: torch.Tensor,
    precision_pool: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    scale: float,
    info_scale: float,
    intermediate_memory: torch.Tensor | None = None,
    intermediate_precision: torch.Tensor | None = None,
    update_state: bool = True,
) -> torch.Tensor:
    """One Diagonal Kalman Delta Network decode step over pools, updated in place.

    Per row and head, from slot ``state_indices[b]`` of both pools, the spec's token
    step (:func:`kdn_compile.reference.diag_kdn_step`) for each of the ``T`` tokens:
    ``p_hat = alpha^2 p + omega`` (raw ``alpha``), the gain
    ``kappa = p_hat k / (r + sum p_hat k^2)``, ``1/p = 1/p_hat + info_scale k^2 / r``,
    then ``S = (I - kappa k^T) diag(alpha) S + kappa v^T`` with ``log alpha`` floored at
    ``LOG_MEMORY_ALPHA_FLOOR = log(1e-6)``, and ``o = scale S^T q``.

    Args:
        q, k: ``[B, T, H, K]`` (normalized), float16/bfloat16/float32 (float64 runs the
            reference), ``1 <= T <= 8``; v ``[B, T, H, V]`` in q's dtype.
        log_alpha, omega: ``[B, T, H, K]`` natural-log retention and process noise (``>= 0``).
        r: ``[B, T, H]`` observation noise (``> 0``; values are checked in debug mode only,
            :mod:`kdn_compile.debug`).
        memory_pool: ``[S, H, K, V]`` float32 or bfloat16 (float64: reference only),
            contiguous; the memory is rounded to its dtype once per step.
        precision_pool: ``[S, H, K]`` float32 (float64 with a float64 memory pool),
            contiguous: the precision ``1 / p`` (``> 0``; a fresh slot holds the layer's
            prior, see :meth:`kdn_compile.layers.DiagKDN.reset_cache`).
        state_indices: ``[B]`` int32/int64 slots, as :func:`delta_rule_decode`.
        scale: output scale (the layer passes ``K ** -0.5``).
        info_scale: weight of the information update.
        intermediate_memory: optional ``[B, T, H, K, V]`` float32, bfloat16 or float64
            (float64 only with a float64 pool), contiguous: receives the memory after every
            token (padding rows leave theirs untouched).
        intermediate_precision: optional ``[B, T, H, K]`` in the precision pool's dtype,
            contiguous: receives the precision after every token.
        update_state: False leaves both pools as they are (a speculative-decoding
            verification, committed by :func:`commit_diag_kdn_states`).

    Returns:
        ``o [B, T, H, V]`` in ``v``'s dtype, zeros on padding rows.

    Raises:
        ValueError, TypeError: naming the argument: inputs as :func:`kdn_compile.diag_kdn`;
            ``T`` outside ``1..8``; pools or intermediate states of another shape, dtype or
            device, or not contiguous; indices of the wrong dtype, shape or device.

    Source: the Diagonal KDN specification; :func:`kdn_compile.reference.pools.diag_kdn_decode_reference`
    is the exact oracle.
    """
    check_kdn_inputs(q, k, v, log_alpha, omega, r, None, None, pools=True)
    _check_tokens(q)
    _check_inference(q=q, k=k, v=v, log_alpha=log_alpha, omega=omega, r=r,
                     memory_pool=memory_pool, precision_pool=precision_pool,
                     intermediate_memory=intermediate_memory,
                     intermediate_precision=intermediate_precision)
    check_flag("update_state", update_state)
    b, t, h, dk = q.shape
    dv = v.shape[3]
    slots = check_pool("memory_pool", memory_pool, "[S, H, K, V]", (h, dk, dv), KDN_MEMORY_DTYPES,
                       q.device)
    precision_dtype = work_dtype(memory_pool.dtype)
    check_pool("precision_pool", precision_pool, "[S, H, K]", (h, dk), (precision_dtype,),
               q.device, slots=slots)
    if intermediate_memory is not None:
        allowed = (torch.float64,) if memory_pool.dtype == torch.float64 else _INTERMEDIATE_DTYPES
        check_pool("intermediate_memory", intermediate_memory, "[B, T, H, K, V]",
                   (t, h, dk, dv), allowed, q.device, slots=b)
    if intermediate_precision is not None:
        check_pool("intermediate_precision", intermediate_precision, "[B, T, H, K]",
                   (t, h, dk), (precision_dtype,), q.device, slots=b)
    check_slot_indices(state_indices, b, slots, q.device)
    scale, info_scale = check_float("scale", scale), check_float("info_scale", info_scale)
    check_values("diag_kdn_decode", q=q, k=k, v=v, log_alpha=log_alpha, omega=omega, r=r)
    check_no_tangents("diag_kdn_decode", q=q, k=k, v=v, log_alpha=log_alpha, omega=omega, r=r)
    op = serving_op(q, _ops.diag_kdn_decode, _ops.diag_kdn_decode_reference,
                    diag_kdn_decode_body)
    return op(q, k, v, log_alpha, omega, r, memory_pool, precision_pool, state_indices, scale,
              info_scale, intermediate_memory, intermediate_precision, update_state)
