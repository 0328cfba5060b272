"""Public functions: validate, fill defaults, call one ``torch.ops.kdn`` op.

Each is a drop-in for its reference in :mod:`kdn_compile.reference` (same
arguments, same results) and traces under ``torch.compile(fullgraph=True)`` and
``torch.export`` without graph breaks. Which op runs is chosen by the backend
switch (:func:`kdn_compile.set_backend`): the Triton kernel op (``kdn::<name>``)
or the exact reference op (``kdn::<name>_reference``); ``chunk_gdn(...,
w_quantizer=...)`` calls two of each, with the callable between them.

Bad arguments raise ``ValueError`` / ``TypeError`` naming the argument, the expected
and the received (:class:`~kdn_compile.ArgumentValueError`,
:class:`~kdn_compile.ArgumentTypeError`), eagerly and out of ``torch.compile`` alike
(see :doc:`/capture`). Gradients are first order: a backward through the gradients
(``create_graph=True``, then ``backward``) raises ``NotImplementedError`` naming the op,
and so does forward-mode AD (``torch.func.jvp``), whose tangent PyTorch would drop;
the references in :mod:`kdn_compile.reference` are plain PyTorch and differentiate to
any order. Under ``torch.autocast`` the ops take their inputs' dtypes as given and compute
as they do outside it.
"""

from __future__ import annotations

from typing import Callable

import torch

import kdn_compile.ops  # noqa: F401  (registers torch.ops.kdn)
from kdn_compile._backend import prefer_kernels
from kdn_compile._checks import (
    check_callable,
    check_delta_inputs,
    check_flag,
    check_no_tangents,
    check_float,
    check_kdn_inputs,
    check_tensor,
    dims,
    fail,
    shown,
    type_name,
)
from kdn_compile.debug import check_values
from kdn_compile.ops._dispatch import eager_cuda
from kdn_compile.ops.recurrent import recurrent_delta_rule_body
from kdn_compile.reference.kdn import DEFAULT_CHUNK_SIZE

__all__ = ["chunk_gdn", "chunk_kda", "recurrent_delta_rule", "diag_kdn", "state_fp8_qdq"]

_ops = torch.ops.kdn


def _scale(scale, q: torch.Tensor) -> float:
    if scale is None:
        return q.shape[-1] ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        fail(TypeError, f"scale must be a float or None, got {type_name(scale)}")
    return check_float("scale", scale)  # finite


def _contiguous(cu_seqlens: torch.Tensor | None) -> torch.Tensor | None:
    """Kernels index ``cu_seqlens`` as a dense vector."""
    return None if cu_seqlens is None else cu_seqlens.contiguous()


def _check_w(w, expected: torch.Tensor) -> None:
    """``w_quantizer`` must hand back a float tensor of ``W``'s shape and device, and
    keep ``W``'s gradient (a detached result would silently drop every gradient that
    flows through ``W``)."""
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        fail(TypeError, f"w_quantizer must return a float tensor, got {type_name(w)}"
                        + (f" of {w.dtype}" if isinstance(w, torch.Tensor) else ""))
    if w.shape != expected.shape or w.device != expected.device:
        fail(ValueError, f"w_quantizer must return W's shape {dims(expected.shape)} = "
                         f"[B, T, Hv, K] on {expected.device}, got {dims(w.shape)} on {w.device}")
    if expected.requires_grad and not w.requires_grad:
        fail(ValueError, "w_quantizer must keep W's gradient: W requires grad, its result does "
                         "not (detached, or made under torch.no_grad); pass the gradient "
                         "through, e.g. w + (qdq(w) - w).detach() as "
                         "kdn_compile.quantization.fp8_row_qdq does")


def _block_v(block_v, name: str = "state_qdq_block_v") -> int:
    if isinstance(block_v, bool) or not isinstance(block_v, int):
        fail(TypeError, f"{name} must be a positive int, got {type_name(block_v)}")
    if block_v < 1:
        fail(ValueError, f"{name} must be a positive int, got {shown(block_v)}")
    if block_v >= 2**63:  # the ops take int64
        fail(ValueError, f"{name} must be below 2**63, got {shown(block_v)}")
    return block_v


def chunk_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = 64,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
    state_qdq: bool = False,
    state_qdq_block_v: int = 64,
    w_quantizer: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked Gated DeltaNet (scalar decay): ``o_t = scale * S_t^T q_t`` with
    ``S_t = (I - beta_t k_t k_t^T) exp(g_t) S_{t-1} + beta_t k_t v_t^T``.

    Args:
        q, k: ``[B, T, Hk, K]`` float16/bfloat16/float32/float64, already
            L2-normalized (k) and activated.
        v: ``[B, T, Hv, V]``, same dtype; ``Hv`` a multiple of ``Hk`` (value
            head ``h`` reads key head ``h // (Hv // Hk)``).
        g: ``[B, T, Hv]`` natural-log decay per token and value head, ``<= 0`` and not
            NaN (checked in debug mode only, :mod:`kdn_compile.debug`: a positive or
            NaN gate can make its whole chunk NaN, earlier tokens included). Each gate is
            floored at ``GDN_GATE_FLOOR = -128``, where its decay is zero in float32 anyway
            (zero ``dg`` below it), so any ``g <= 0`` is an exact hard reset (``-inf`` as
            well). In float32 the kernels' ``dg`` of heads decaying by ``e^-8``
            per token or faster loses relative accuracy (``3e-2`` near ``-10``; the
            reference keeps it; see the limitations page).
        beta: ``[B, T, Hv]`` write strengths, usually in ``(0, 1)``.
        chunk_size: tokens per chunk, positive int (64 for the kernels).
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[N, Hv, K, V]`` (``[N, Hv, V, K]`` with
            ``state_v_first``), any float dtype; zeros when ``None``.
        cu_seqlens: ``[N + 1]`` int32/int64 boundaries of packed sequences,
            on q's device, starting at 0, non-decreasing, ending at ``T``;
            requires ``B == 1``. Checked on the host for CPU tensors, by a
            device-side assert (no sync) on CUDA and while tracing.
        state_v_first: states are value-major.
        state_qdq: fake-quantize the state to FP8 E4M3 (initial state and each
            chunk's final state, after its readout), one scale per
            ``[K, state_qdq_block_v]`` tile (as :func:`state_fp8_qdq`: a tile decayed
            below amax ~5.3e-36 becomes zeros), straight-through gradient.
        state_qdq_block_v: value columns per FP8 scale.
        w_quantizer: callable applied once to the whole WY operand
            ``W [B, T, Hv, K]`` (float32; float64 for float64 inputs); with it the
            computation runs as two ops with the callable traced between them (e.g.
            :func:`kdn_compile.quantization.fp8_row_qdq`); debug mode checks that its
            result is finite.

    Kernels (CUDA): FP8 state QDQ runs inside the recurrence kernels (one program per
    ``[K, state_qdq_block_v]`` scale tile; the backward reads the forward's float8 chunk
    states), and both ops of the ``w_quantizer`` path have kernels forward and backward;
    the shapes they cover: the limitations page.

    Returns:
        ``(o, final_state)``: ``o`` like ``v`` (``v``'s dtype); ``final_state``
        ``[N, Hv, K, V]`` (or value-major) in float32 (float64 for float64 inputs).

    Raises:
        ValueError: mismatched batch/length/heads, no heads or ``K == 0``, ``Hv``
            not a multiple of ``Hk``, ``g`` not ``[B, T, Hv]``, ``cu_seqlens``
            with ``B != 1`` or bad values, ``initial_state`` of the wrong shape,
            a ``chunk_size`` below 1 or not integral, a ``state_qdq_block_v`` that
            is not a positive int, mixed devices, a ``w_quantizer`` result not of
            ``W``'s shape, a ``w_quantizer`` result that does not require grad where
            ``W`` does (a detached one), a NaN or infinite ``scale``.
        TypeError: a tensor argument that is not a tensor (an ``initial_state`` given
            as a list, say), non-float inputs, mixed q/k/v dtypes, non-integer
            ``cu_seqlens``, a non-numeric ``chunk_size``, non-bool flags, a ``scale``
            that is not a number (an int is taken as a float), a ``w_quantizer``
            result that is not a float tensor.
        RuntimeError: in debug mode, a non-finite input (a gate of ``-inf`` aside) or a
            gate above 0 (on CUDA a device-side assert, see :mod:`kdn_compile.debug`).
        NotImplementedError: at a backward through the gradients (double backward), or
            given a forward-mode AD tangent (``torch.func.jvp``, a dual tensor).

    Source: the chunked WY form of the gated delta rule (Yang et al., Gated Delta
    Networks, 2024), as specified by :func:`kdn_compile.reference.chunk_gdn_reference`.

    Example:
        >>> B, T, H, K = 1, 16, 2, 8
        >>> q = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
        >>> k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
        >>> v, g, beta = torch.randn(B, T, H, K), -torch.rand(B, T, H), torch.rand(B, T, H)
        >>> o, state = chunk_gdn(q, k, v, g, beta)
        >>> tuple(o.shape), tuple(state.shape)
        ((1, 16, 2, 8), (1, 2, 8, 8))
    """
    check_delta_inputs(
        q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
        state_v_first=state_v_first, gate="scalar", chunk_size=chunk_size,
    )
    check_flag("state_v_first", state_v_first)
    check_flag("state_qdq", state_qdq)
    check_callable("w_quantizer", w_quantizer)
    check_values("chunk_gdn", resets=True, q=q, k=k, v=v, g=g, beta=beta,
                 initial_state=initial_state)
    check_no_tangents("chunk_gdn", q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    scale, block_v, chunk_size = _scale(scale, q), _block_v(state_qdq_block_v), int(chunk_size)
    cu_seqlens = _contiguous(cu_seqlens)
    kernels = prefer_kernels(q.device.type)
    if w_quantizer is not None:
        # The kernel ops append the tensors their backward reuses: not for the caller.
        operands = _ops.gdn_wy_operands if kernels else _ops.gdn_wy_operands_reference
        w, u, *_ = operands(k, v, g, beta, cu_seqlens, chunk_size)
        quantized = w_quantizer(w)
        _check_w(quantized, w)
        check_values("chunk_gdn", **{"w_quantizer(W)": quantized})
        recurrence = _ops.gdn_wy_recurrence if kernels else _ops.gdn_wy_recurrence_reference
        o, final_state, *_ = recurrence(
            q, k, quantized, u, g, initial_state, cu_seqlens, chunk_size, scale,
            state_v_first, state_qdq, block_v,
        )
        return o, final_state
    op = _ops.chunk_gdn if kernels else _ops.chunk_gdn_reference
    # kdn::chunk_gdn appends the tensors its backward reuses: not for the caller.
    o, final_state, *_ = op(
        q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, scale,
        state_v_first, state_qdq, block_v,
    )
    return o, final_state


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = 64,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked Kimi Delta Attention (per-key decay):
    ``S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``.

    Args:
        q, k, v, beta, chunk_size, scale, initial_state, cu_seqlens, state_v_first:
            as :func:`chunk_gdn`.
        g: ``[B, T, Hv, K]`` natural-log decay per token, value head and key channel,
            ``<= 0``; ``-inf`` is a hard reset of that channel. The Triton kernels floor
            it at ``-20`` per token (a state decayed by ``e^-20`` keeps under ``2e-9`` of
            itself, below float32 resolution; ``-inf`` is floored too); the chunked
            reference floors it at ``GDN_GATE_FLOOR = -128`` and differences its in-chunk
            sums in float64, so any gate ``<= 0`` is an exact hard reset there. Checked in
            debug mode only (:mod:`kdn_compile.debug`): positive gates summing past about ``+80``
            within a chunk overflow the kernels' factoring (NaN gradients). Float32
            limits, measured in the interpreter against float64: ``dg`` of channels
            decaying by ``e^-8`` per token or faster loses relative accuracy in the
            kernels (``4e-2`` near ``-10``; the reference keeps ``3e-7``; see the
            limitations page); gates jumping from the floor to near zero within a
            chunk give errors up to ``~6e-4`` (the in-chunk cumulative decay rounds at
            ``|c| ~ 300``).

    Returns:
        ``(o, final_state)`` as :func:`chunk_gdn`.

    Raises:
        ValueError, TypeError, RuntimeError: as :func:`chunk_gdn`; ``g`` must be
            ``[B, T, Hv, K]``.

    Source: Kimi Linear (Moonshot AI, 2025), KDA; as specified by
    :func:`kdn_compile.reference.recurrent_delta_rule_reference` with a per-key gate.
    """
    check_delta_inputs(
        q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
        state_v_first=state_v_first, gate="per_key", chunk_size=chunk_size,
    )
    check_flag("state_v_first", state_v_first)
    check_values("chunk_kda", resets=True, q=q, k=k, v=v, g=g, beta=beta,
                 initial_state=initial_state)
    check_no_tangents("chunk_kda", q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    cu_seqlens = _contiguous(cu_seqlens)
    op = _ops.chunk_kda if prefer_kernels(q.device.type) else _ops.chunk_kda_reference
    # kdn::chunk_kda appends the tensors its backward reuses: not for the caller.
    o, final_state, *_ = op(
        q, k, v, g, beta, initial_state, cu_seqlens, int(chunk_size), _scale(scale, q),
        state_v_first,
    )
    return o, final_state


def recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule (the decode path): GDN when ``g`` is
    ``[B, T, Hv]``, KDA when ``g`` is ``[B, T, Hv, K]``.

    On CUDA (backend ``"auto"``) the Triton token-recurrence kernel runs: one program
    per sequence, value head and value tile, the state on chip across the ``T``
    tokens (any ``T``; meant for short steps: training runs :func:`chunk_gdn` /
    :func:`chunk_kda`). Gradients come from the exact reference token loop on every
    backend. float64 inputs and the ``"reference"`` backend run
    ``kdn::recurrent_delta_rule_reference``. State pools updated in place:
    :func:`delta_rule_decode`.

    Args:
        q, k: ``[B, T, Hk, K]``; v: ``[B, T, Hv, V]``; beta: ``[B, T, Hv]``;
            dtypes as :func:`chunk_gdn`.
        g: natural-log decay (``<= 0``; ``-inf`` is a hard reset), ``[B, T, Hv]`` (GDN) or
            ``[B, T, Hv, K]`` (KDA); taken as is (the token loop needs no floor).
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[N, Hv, K, V]`` (value-major with ``state_v_first``),
            any float dtype; zeros when ``None``.
        cu_seqlens: ``[N + 1]`` packed-sequence boundaries, ``B == 1``.
        state_v_first: states are ``[N, Hv, V, K]``.

    Returns:
        ``(o, final_state)`` as :func:`chunk_gdn`.

    Raises:
        ValueError, TypeError, RuntimeError: as :func:`chunk_gdn`; ``g`` of another shape.

    Source: :func:`kdn_compile.reference.recurrent_delta_rule_reference`.
    """
    check_delta_inputs(
        q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
        state_v_first=state_v_first, gate="any",
    )
    check_flag("state_v_first", state_v_first)
    check_values("recurrent_delta_rule", resets=True, q=q, k=k, v=v, g=g, beta=beta,
                 initial_state=initial_state)
    check_no_tangents("recurrent_delta_rule", q=q, k=k, v=v, g=g, beta=beta,
                      initial_state=initial_state)
    op = (_ops.recurrent_delta_rule if prefer_kernels(q.device.type)
          else _ops.recurrent_delta_rule_reference)
    tensors = (q, k, v, g, beta, initial_state)
    if (op is _ops.recurrent_delta_rule and eager_cuda(q) and not (
            torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))):
        op = recurrent_delta_rule_body  # no gradient: the op's own body, without the dispatcher
    return op(
        q, k, v, g, beta, initial_state, _contiguous(cu_seqlens), _scale(scale, q), state_v_first
    )


def diag_kdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_alpha: torch.Tensor,
    omega: torch.Tensor,
    r: torch.Tensor,
    memory: torch.Tensor,
    precision: torch.Tensor,
    *,
    scale: float,
    info_scale: float,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Diagonal Kalman Delta Network: Kalman gains by a Mobius scan, then the
    two-key delta-rule memory ``S_t = (I - kappa_t k_t^T) diag(alpha_t) S_{t-1} + kappa_t v_t^T``.

    Unlike the delta-rule functions there are no grouped heads (keys and values
    share ``H``), and ``scale`` and ``info_scale`` have no defaults.

    Args:
        q, k: ``[B, T, H, K]`` float16/bfloat16/float32/float64 (normalized, e.g. by
            :func:`kdn_compile.reference.normalize_query_key`).
        v: ``[B, T, H, V]``, q's dtype. The other tensors may be any float dtype.
        log_alpha: ``[B, T, H, K]`` natural-log retention (``<= 0``); the covariance
            uses it as is, the memory floors it at ``LOG_MEMORY_ALPHA_FLOOR = log(1e-6)``.
        omega: ``[B, T, H, K]`` process noise (``>= 0``).
        r: ``[B, T, H]`` observation noise (``> 0``; ``r = 0`` gives non-finite outputs).
            Values of every input are checked in debug mode only
            (:mod:`kdn_compile.debug`): finite, and the domains given here.
        memory: ``[N, H, K, V]`` memory carried in (see
            :func:`kdn_compile.reference.initial_state`).
        precision: ``[N, H, K]`` precision ``1 / p`` (``> 0``) carried in.
        scale: output scale (the layer passes ``K ** -0.5``).
        info_scale: weight of the information update ``info_scale * k**2 / r``.
        chunk_size: tokens per chunk (64 for the kernels).
        cu_seqlens: ``[N + 1]`` int32/int64 packed-sequence boundaries, ``B == 1``.

    Returns:
        ``(o [B, T, H, V] in v's dtype, memory [N, H, K, V], precision [N, H, K])``,
        the states in float32 (float64 for float64 inputs).

    Precision: with float16/bfloat16 inputs on CUDA the kernels keep the gains
    ``kappa = p_hat k / (r + sum_K p_hat k**2)`` (computed in float32) and their
    other stored intermediates in the inputs' dtype, as KDA's kernels do. float16's
    range (65504) then bounds them: ``|kappa| <= sqrt(p_hat / r) / 2`` needs ``p_hat / r``
    below about ``1.7e10``, and in training the float16 gradients ``dq``, ``dk``, ``dv``
    overflow far earlier (from ``p_hat / r`` near ``1e6``, the reference's too), after
    which the kernels' other gradients are NaN as well. Prefer bfloat16 where the
    covariance can grow large.

    Raises:
        ValueError, TypeError: on inconsistent shapes, dtypes or devices, as
            :func:`chunk_gdn`; ValueError for a NaN or infinite ``scale`` or
            ``info_scale``.
        RuntimeError: in debug mode, an input that is not finite or outside its domain.

    Source: the Diagonal KDN specification (:mod:`kdn_compile.reference.kdn`).
    """
    check_kdn_inputs(
        q, k, v, log_alpha, omega, r, memory, precision, cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )
    scale, info_scale = check_float("scale", scale), check_float("info_scale", info_scale)
    check_values("diag_kdn", q=q, k=k, v=v, log_alpha=log_alpha, omega=omega, r=r,
                 memory=memory, precision=precision)
    check_no_tangents("diag_kdn", q=q, k=k, v=v, log_alpha=log_alpha, omega=omega, r=r,
                      memory=memory, precision=precision)
    op = _ops.diag_kdn if prefer_kernels(q.device.type) else _ops.diag_kdn_reference
    # kdn::diag_kdn appends the tensors its backward reuses: not for the caller.
    output, memory, precision, *_ = op(
        q, k, v, log_alpha, omega, r, memory, precision, _contiguous(cu_seqlens), scale,
        info_scale, int(chunk_size),
    )
    return output, memory, precision


def state_fp8_qdq(state: torch.Tensor, block_v: int = 64) -> torch.Tensor:
    """FP8 E4M3 quantize-dequantize of a key-first state ``[..., K, V]``.

    One dynamic scale per ``[K, block_v]`` tile, the last tile may be partial:
    ``amax * (1 / 448)`` in ``promote_types(state.dtype, float32)``, or 1 where that is
    below ``2^-126`` (amax below ~5.3e-36: an all-zero, subnormal or tiny tile, which
    comes back as zeros, off by at most its amax, never NaN); identity
    (straight-through) gradient. Returns a tensor like ``state`` (same shape and
    dtype). On CUDA (backend ``"auto"``) a Triton kernel for float16, bfloat16 and float32
    states, equal to the reference bit for bit; float64 and the ``"reference"`` backend run
    ``kdn::state_fp8_qdq_reference``.

    Raises:
        TypeError: ``state`` is not a float tensor.
        ValueError: ``state`` has fewer than 2 dims, or ``block_v`` is not a positive int.

    Source: :func:`kdn_compile.reference.state_fp8_qdq_reference`.
    """
    check_tensor("state", state)
    check_no_tangents("state_fp8_qdq", state=state)
    if state.dim() < 2:
        fail(ValueError, f"state must be [..., K, V], got shape {dims(state.shape)}")
    op = _ops.state_fp8_qdq if prefer_kernels(state.device.type) else _ops.state_fp8_qdq_reference
    return op(state, _block_v(block_v, "block_v"))
