"""FLA's calling conventions on kdn ops.

Drop-ins for flash-linear-attention (fla-core 0.6.0)'s ``chunk_gated_delta_rule``,
``fused_recurrent_gated_delta_rule``, ``chunk_kda`` and ``fused_recurrent_kda``:
the same parameter names, positions and defaults, the same preprocessing, and
``(o, final_state)`` with ``final_state = None`` unless ``output_final_state=True``.
Unlike FLA's functions they trace under ``torch.compile(fullgraph=True)`` and
``torch.export``.

What FLA fuses into its kernels runs here as traced PyTorch before one kdn op
(Inductor fuses it), computed in float32 (float64 for float64 inputs):

- ``use_qk_l2norm_in_kernel``: ``x / sqrt(sum(x**2) + 1e-6)`` along ``K``, cast
  back to q's dtype (FLA's ``l2norm`` with its ``eps = 1e-6``).
- ``use_beta_sigmoid_in_kernel``: ``beta = sigmoid(beta)``, times 2 with
  ``allow_neg_eigval=True`` (beta in ``(0, 2)``), kept in float32 as FLA keeps it.
- ``use_gate_in_kernel``: the natural-log decay ``g = -exp(A_log) * softplus(g + dt_bias)``;
  for KDA with ``lower_bound``, ``g = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``
  (``lower_bound * sigmoid(g + dt_bias)`` when ``A_log`` is ``None``).

Arguments that only steer how FLA's kernels tile, save or find their work
(``chunk_size``, ``safe_gate``, ``disable_recompute``, ``cu_seqlens_cpu``,
``chunk_indices``) are validated as FLA validates them and change nothing: the
math is the same and the kdn ops choose their own tiling. Arguments whose
non-default value would change the result or the return value and that kdn
ops do not implement (``gv``, ``return_intermediate_states``, ``cp_context``,
``use_graph``, ``max_num_seqs``, ``head_first``, FLA's deprecated
``transpose_state_layout`` (use ``state_v_first``), the serving keywords of FLA's
``fused_recurrent_kda_fwd``, any other keyword) raise ``TypeError`` naming them; FLA's
per-value ``beta [B, T, HV, V]`` raises ``ValueError``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kdn_compile._checks import check_flag, check_float, check_tensor, dims, fail, shown
from kdn_compile.api import chunk_gdn as _chunk_gdn
from kdn_compile.api import chunk_kda as _chunk_kda
from kdn_compile.api import recurrent_delta_rule as _recurrent_delta_rule
from kdn_compile.layers._common import l2_normalize
from kdn_compile.reference._common import work_dtype

__all__ = [
    "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda",
    "fused_recurrent_kda", "l2norm", "gdn_gate", "kda_gate", "L2NORM_EPS",
]

L2NORM_EPS = 1e-6
"""FLA's ``l2norm`` epsilon: ``x / sqrt(sum(x**2) + L2NORM_EPS)``."""

_KEYWORD_HINTS = {
    "head_first": "inputs are token-major [B, T, H, K]; transpose head-first tensors first",
    "transpose_state_layout": "FLA's deprecated name of state_v_first: use state_v_first",
    "return_intermediate_states": "the chunk states stay inside the kdn ops; "
                                  "output_final_state gives the last one",
    **dict.fromkeys(("ssm_state_indices", "num_accepted_tokens", "inplace_final_state"),
                    "state pools updated in place are kdn_compile.delta_rule_decode's"),
}
# Keywords of older FLA releases accepted at the value that asks for what kdn ops do.
_ACCEPTED = {"head_first": False}


def _reject(function: str, **unsupported) -> None:
    """TypeError naming every argument given a value kdn ops do not implement (a keyword
    of :data:`_ACCEPTED` at its value passes)."""
    unsupported = {name: value for name, value in unsupported.items()
                   if not (name in _ACCEPTED and value is _ACCEPTED[name])}
    if unsupported:
        hints = "; ".join(f"{name}: {_KEYWORD_HINTS[name]}" for name in unsupported
                          if name in _KEYWORD_HINTS)
        fail(TypeError,
             f"kdn_compile.fla.{function} does not support "
             + ", ".join(f"{name}={shown(value)}" for name, value in unsupported.items())
             + (f" ({hints})" if hints else ""))


def _check_gate_shape(name: str, g, q, v, *, per_key: bool) -> None:
    """``g`` (or ``gk``) of FLA's shape, ``[B, T, HV]`` or, ``per_key``, ``[B, T, HV, K]``,
    checked before any gate math reads its sizes."""
    check_tensor("q", q, layout="BTHK")
    check_tensor("v", v, layout="BTHV")
    check_tensor(name, g)
    expected = tuple(v.shape[:3]) + ((q.shape[3],) if per_key else ())
    if tuple(g.shape) != expected:
        fail(ValueError, f"{name} must be [B, T, HV{', K' if per_key else ''}] = "
                         f"{dims(expected)}, got {dims(g.shape)}")


def _check_beta_per_head(beta, v) -> None:
    """FLA's fused recurrent kernels also take a per-value ``beta [B, T, HV, V]``; kdn
    ops take ``[B, T, HV]`` only."""
    if isinstance(beta, torch.Tensor) and beta.dim() == 4:
        fail(ValueError, f"beta must be [B, T, HV] = {dims(v.shape[:3])}: FLA's per-value "
                         f"beta [B, T, HV, V] is not supported, got {dims(beta.shape)}")


def _non_default(**given) -> dict:
    """The ``name: value`` pairs of ``given`` (``name=(value, default)``) off their default."""
    return {name: value for name, (value, default) in given.items() if value is not default}


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """FLA's L2 normalization along the last dim, ``x / sqrt(sum(x**2) + 1e-6)``, in
    float32 (float64 for float64 ``x``), returned in ``x``'s dtype (the layers' own).

    Raises:
        TypeError: ``x`` not a float16, bfloat16, float32 or float64 tensor.

    Source: FLA's ``fla.modules.l2norm`` (``eps = 1e-6``)."""
    check_tensor("x", x)
    return l2_normalize(x, L2NORM_EPS)


def _prepare_qk_beta(q, k, beta, output_final_state, use_qk_l2norm_in_kernel,
                     use_beta_sigmoid_in_kernel, allow_neg_eigval):
    """Validate the flags, then FLA's in-kernel q/k normalization and beta sigmoid."""
    for name, t in (("q", q), ("k", k), ("beta", beta)):
        check_tensor(name, t)
    check_flag("output_final_state", output_final_state)
    check_flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    check_flag("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel)
    check_flag("allow_neg_eigval", allow_neg_eigval)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        fail(ValueError, "allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_beta_sigmoid_in_kernel:  # float32 beta, as FLA's (float64 for float64 logits)
        beta = torch.sigmoid(beta.to(work_dtype(beta.dtype)))
        if allow_neg_eigval:
            beta = 2 * beta
    return q, k, beta


def _head_params(name: str, x, size: int, shape: str, g: torch.Tensor) -> torch.Tensor | None:
    """``A_log`` / ``dt_bias``: a float tensor of ``size`` elements on ``g``'s device."""
    if x is None:
        return None
    check_tensor(name, x)
    if x.numel() != size or x.device != g.device:
        fail(ValueError, f"{name} must have {shown(size)} elements ({shape}) on {g.device}, "
                         f"got shape {dims(x.shape)} on {x.device}")
    return x.to(work_dtype(g.dtype))


def gdn_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None):
    """GDN's decay from raw gate inputs ``g [B, T, Hv]``:
    ``-exp(A_log) * softplus(g + dt_bias)`` with ``A_log, dt_bias [Hv]``, natural log,
    in float32 (float64 for float64 ``g``).

    Raises:
        TypeError, ValueError: ``g`` not a float tensor of 3 dims; ``A_log`` missing, or
            ``A_log`` / ``dt_bias`` not float tensors of ``Hv`` elements on ``g``'s device.

    Source: FLA's in-kernel gate of ``chunk_gated_delta_rule(use_gate_in_kernel=True)``."""
    check_tensor("g", g, layout="BTH")
    if A_log is None:
        fail(TypeError, "A_log must be a torch.Tensor of Hv elements, got None")
    hv = g.shape[-1]
    A_log = _head_params("A_log", A_log, hv, "[Hv]", g)
    dt_bias = _head_params("dt_bias", dt_bias, hv, "[Hv]", g)
    x = g.to(work_dtype(g.dtype))
    if dt_bias is not None:
        x = x + dt_bias.reshape(hv)
    return -A_log.reshape(hv).exp() * F.softplus(x)


def kda_gate(g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None = None,
             lower_bound: float | None = None):
    """KDA's decay from raw gate inputs ``g [B, T, Hv, K]``, natural log, in float32
    (float64 for float64 ``g``), with ``A_log [Hv]`` and ``dt_bias [Hv * K]``:
    ``-exp(A_log) * softplus(g + dt_bias)``, or with ``lower_bound``
    ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (``A_log`` may then be ``None``:
    ``lower_bound * sigmoid(g + dt_bias)``).

    Raises:
        TypeError, ValueError: ``g`` not a float tensor of 4 dims; ``lower_bound`` not a
            finite float; ``A_log`` missing without ``lower_bound``, or ``A_log`` (``Hv``
            elements) or ``dt_bias`` (``Hv * K``) not float tensors of that size on
            ``g``'s device.

    Source: FLA's ``fla.ops.kda.gate`` (``kda_gate_fwd``)."""
    check_tensor("g", g, layout="BTHK")
    if lower_bound is not None:
        lower_bound = check_float("lower_bound", lower_bound)
    if A_log is None and lower_bound is None:
        fail(TypeError, "A_log must be a torch.Tensor of Hv elements when lower_bound is "
                        "not set, got None")
    hv, dk = g.shape[-2], g.shape[-1]
    A_log = _head_params("A_log", A_log, hv, "[Hv]", g)
    dt_bias = _head_params("dt_bias", dt_bias, hv * dk, "[Hv * K]", g)
    x = g.to(work_dtype(g.dtype))
    if dt_bias is not None:
        x = x + dt_bias.reshape(hv, dk)
    if lower_bound is None:
        return -A_log.reshape(hv, 1).exp() * F.softplus(x)
    if A_log is not None:
        x = A_log.reshape(hv, 1).exp() * x
    return lower_bound * torch.sigmoid(x)


def _check_gate_args(use_gate_in_kernel, A_log, lower_bound=None, *, kda: bool) -> None:
    check_flag("use_gate_in_kernel", use_gate_in_kernel)
    if lower_bound is not None:
        check_float("lower_bound", lower_bound)  # finite
    if use_gate_in_kernel and A_log is None and lower_bound is None:
        fail(ValueError, "A_log must be provided when use_gate_in_kernel=True"
                         + (" and lower_bound is not set" if kda else ""))


def _check_chunk_size(chunk_size, allowed: tuple, family: str) -> None:
    if chunk_size not in allowed:
        fail(ValueError, f"chunk_size must be one of {', '.join(map(str, allowed))} for "
                         f"{family}, got {shown(chunk_size)}")


def _check_safe_gate(safe_gate, use_gate_in_kernel, lower_bound) -> None:
    check_flag("safe_gate", safe_gate)
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            fail(ValueError,
                 "lower_bound must be set when safe_gate=True and use_gate_in_kernel=True")
        if not -5 <= lower_bound < 0:
            fail(ValueError,
                 f"lower_bound must be in [-5, 0) with safe_gate=True, got {shown(lower_bound)}")


def _finish(o, final_state, output_final_state):
    return o, (final_state if output_final_state else None)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    cp_context=None,
    *,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = 64,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FLA's ``chunk_gated_delta_rule`` on :func:`kdn_compile.chunk_gdn`: Gated DeltaNet,
    ``S_t = (I - beta_t k_t k_t^T) exp(g_t) S_{t-1} + beta_t k_t v_t^T``,
    ``o_t = scale * S_t^T q_t``.

    Args:
        q, k: ``[B, T, H, K]`` float16/bfloat16/float32/float64 (one dtype with ``v``).
        v: ``[B, T, HV, V]``; ``HV`` a multiple of ``H`` (value head ``h`` reads key
            head ``h // (HV // H)``).
        g: ``[B, T, HV]`` natural-log decay per token and value head (``<= 0``); with
            ``use_gate_in_kernel=True`` the raw gate input of
            ``-exp(A_log) * softplus(g + dt_bias)``.
        beta: ``[B, T, HV]`` write strengths; logits with ``use_beta_sigmoid_in_kernel``.
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``),
            any float dtype; zeros when ``None``.
        output_final_state: return the final state (else ``None``).
        use_qk_l2norm_in_kernel: L2-normalize q and k along ``K`` (eps ``1e-6``) first.
        use_beta_sigmoid_in_kernel: ``beta = sigmoid(beta)`` first.
        allow_neg_eigval: ``beta = 2 * sigmoid(beta)``; requires
            ``use_beta_sigmoid_in_kernel=True``.
        state_v_first: states are value-major ``[N, HV, V, K]``.
        cu_seqlens: ``[N + 1]`` int32/int64 boundaries of packed sequences, ``B == 1``.
        cu_seqlens_cpu, chunk_indices: FLA's host copy and chunk table of
            ``cu_seqlens``; accepted and not needed (kdn ops read ``cu_seqlens`` on its
            device).
        cp_context: FLA's context parallelism; only ``None``.
        use_gate_in_kernel: compute the decay from ``g``, ``A_log [HV]`` (required)
            and ``dt_bias [HV]`` (optional); keyword-only, as FLA reads them from its
            ``**kwargs``.
        chunk_size: 16, 32 or 64 as FLA allows; the result does not depend on it
            (the kdn op picks its own chunk).

    Returns:
        ``(o, final_state)``: ``o [B, T, HV, V]`` in v's dtype; ``final_state
        [N, HV, K, V]`` (value-major with ``state_v_first``) in float32 (float64 for
        float64 inputs) when ``output_final_state``, else ``None``.

    Raises:
        TypeError: an argument kdn ops do not implement (``cp_context``,
            ``head_first=True``, ``transpose_state_layout``, any other keyword), named;
            and as :func:`kdn_compile.chunk_gdn`.
        ValueError: ``allow_neg_eigval`` without ``use_beta_sigmoid_in_kernel``,
            ``use_gate_in_kernel`` without ``A_log``, ``g`` not ``[B, T, HV]``,
            ``A_log`` / ``dt_bias`` not of ``HV`` elements, a ``chunk_size`` FLA
            rejects; and as :func:`kdn_compile.chunk_gdn`.

    Source: FLA's ``fla/ops/gated_delta_rule/chunk.py`` (fla-core 0.6.0) for the
    arguments and preprocessing; the recurrence of :func:`kdn_compile.chunk_gdn`.
    """
    _reject("chunk_gated_delta_rule", **kwargs, **_non_default(cp_context=(cp_context, None)))
    _check_chunk_size(chunk_size, (16, 32, 64), "Gated DeltaNet")
    _check_gate_args(use_gate_in_kernel, A_log, kda=False)
    _check_gate_shape("g", g, q, v, per_key=False)
    q, k, beta = _prepare_qk_beta(q, k, beta, output_final_state, use_qk_l2norm_in_kernel,
                                  use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if use_gate_in_kernel:
        g = gdn_gate(g, A_log, dt_bias)
    o, final_state = _chunk_gdn(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                cu_seqlens=cu_seqlens, state_v_first=state_v_first)
    return _finish(o, final_state, output_final_state)


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FLA's ``fused_recurrent_gated_delta_rule`` on :func:`kdn_compile.recurrent_delta_rule`:
    the gated delta rule token by token, with a decay per value head (``g``), per key
    channel (``gk``), or both (their sum).

    Args:
        q, k, v, scale, initial_state, state_v_first, cu_seqlens: as
            :func:`chunk_gated_delta_rule`.
        output_final_state, use_qk_l2norm_in_kernel: as :func:`chunk_gated_delta_rule`.
        use_beta_sigmoid_in_kernel, allow_neg_eigval: as :func:`chunk_gated_delta_rule`.
        g: ``[B, T, HV]`` natural-log decay, or ``None`` (no decay); with
            ``use_gate_in_kernel=True`` the raw input of
            ``-exp(A_log) * softplus(g + dt_bias)`` (``A_log, dt_bias [HV]``).
        gk: ``[B, T, HV, K]`` natural-log decay per key channel, or ``None``.
        gv: per-value-channel decay: only ``None`` (kdn ops have no such gate).
        beta: ``[B, T, HV]``, or ``None`` for ones. FLA's per-value ``beta
            [B, T, HV, V]`` is not supported.
        use_gate_in_kernel, A_log, dt_bias: as above; ``A_log`` required with the flag.

    Returns:
        ``(o, final_state)`` as :func:`chunk_gated_delta_rule`.

    Raises:
        TypeError: ``gv`` or another argument kdn ops do not implement, named; and as
            :func:`kdn_compile.recurrent_delta_rule`.
        ValueError: as :func:`chunk_gated_delta_rule`; ``use_gate_in_kernel`` without
            ``g``; ``gk`` not ``[B, T, HV, K]``; ``beta`` not ``[B, T, HV]``.

    Source: FLA's ``fla/ops/gated_delta_rule/fused_recurrent.py`` (fla-core 0.6.0) for
    the arguments and preprocessing; the recurrence of
    :func:`kdn_compile.recurrent_delta_rule`.
    """
    _reject("fused_recurrent_gated_delta_rule", **kwargs, **_non_default(gv=(gv, None)))
    _check_gate_args(use_gate_in_kernel, A_log, kda=False)
    if use_gate_in_kernel and g is None:
        fail(ValueError, "g (the raw gate input) must be provided when use_gate_in_kernel=True")
    check_tensor("v", v, layout="BTHV")
    for name, gate, per_key in (("g", g, False), ("gk", gk, True)):
        if gate is not None:
            _check_gate_shape(name, gate, q, v, per_key=per_key)
    _check_beta_per_head(beta, v)
    b, t, hv = v.shape[:3]
    if beta is None:
        beta = v.new_ones(b, t, hv)
    q, k, beta = _prepare_qk_beta(q, k, beta, output_final_state, use_qk_l2norm_in_kernel,
                                  use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if g is not None and use_gate_in_kernel:
        g = gdn_gate(g, A_log, dt_bias)
    if gk is not None:
        g = gk if g is None else gk + g.unsqueeze(-1)
    elif g is None:
        g = v.new_zeros(b, t, hv)
    o, final_state = _recurrent_delta_rule(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
        state_v_first=state_v_first,
    )
    return _finish(o, final_state, output_final_state)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = 64,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FLA's ``chunk_kda`` on :func:`kdn_compile.chunk_kda`: Kimi Delta Attention,
    ``S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``.

    Args:
        q, k, v, beta, scale, initial_state, state_v_first: as
            :func:`chunk_gated_delta_rule`.
        cu_seqlens, cu_seqlens_cpu, output_final_state: as :func:`chunk_gated_delta_rule`.
        use_qk_l2norm_in_kernel: as :func:`chunk_gated_delta_rule`.
        use_beta_sigmoid_in_kernel, allow_neg_eigval: as :func:`chunk_gated_delta_rule`.
        g: ``[B, T, HV, K]`` natural-log decay per key channel (``<= 0``); with
            ``use_gate_in_kernel=True`` the raw gate input.
        use_gate_in_kernel: ``g = -exp(A_log) * softplus(g + dt_bias)`` with ``A_log
            [HV]`` and ``dt_bias [HV * K]`` (optional); with ``lower_bound``,
            ``g = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (``A_log`` may
            then be ``None``: ``lower_bound * sigmoid(g + dt_bias)``). As in FLA,
            ``A_log``, ``dt_bias`` and ``lower_bound`` are used only with this flag.
        safe_gate: FLA's kernel choice for bounded gates; validated as FLA does
            (with ``use_gate_in_kernel`` it needs ``-5 <= lower_bound < 0``), no effect
            on the result.
        disable_recompute: FLA's memory/speed choice for its backward; no effect.
        return_intermediate_states, cp_context, use_graph, max_num_seqs: only their
            defaults (``False``, ``None``, ``False``, ``None``).
        A_log, dt_bias, chunk_size: keyword-only, as FLA reads them from its
            ``**kwargs``; ``chunk_size`` 32 or 64, no effect on the result.

    Returns:
        ``(o, final_state)`` as :func:`chunk_gated_delta_rule`.

    Raises:
        TypeError: an argument kdn ops do not implement, named; and as
            :func:`kdn_compile.chunk_kda`.
        ValueError: as :func:`chunk_gated_delta_rule`; ``use_gate_in_kernel`` without
            ``A_log`` or ``lower_bound``; ``g`` not ``[B, T, HV, K]``; a NaN or infinite
            ``lower_bound``; ``safe_gate`` with a missing or out-of-range
            ``lower_bound``; ``dt_bias`` not of ``HV * K`` elements.

    Source: FLA's ``fla/ops/kda/chunk.py`` and ``fla/ops/kda/gate.py`` (fla-core 0.6.0)
    for the arguments and preprocessing; the recurrence of :func:`kdn_compile.chunk_kda`.
    """
    _reject("chunk_kda", **kwargs, **_non_default(
        return_intermediate_states=(return_intermediate_states, False),
        cp_context=(cp_context, None), use_graph=(use_graph, False),
        max_num_seqs=(max_num_seqs, None),
    ))
    check_flag("disable_recompute", disable_recompute)
    _check_chunk_size(chunk_size, (32, 64), "KDA")
    _check_gate_args(use_gate_in_kernel, A_log, lower_bound, kda=True)
    _check_safe_gate(safe_gate, use_gate_in_kernel, lower_bound)
    _check_gate_shape("g", g, q, v, per_key=True)
    q, k, beta = _prepare_qk_beta(q, k, beta, output_final_state, use_qk_l2norm_in_kernel,
                                  use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if use_gate_in_kernel:
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    o, final_state = _chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                cu_seqlens=cu_seqlens, state_v_first=state_v_first)
    return _finish(o, final_state, output_final_state)


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FLA's ``fused_recurrent_kda`` on :func:`kdn_compile.recurrent_delta_rule`: KDA
    token by token (the decode path).

    Args:
        q, k, v, g, beta, scale, initial_state, state_v_first, cu_seqlens: as
            :func:`chunk_kda`.
        output_final_state, use_qk_l2norm_in_kernel: as :func:`chunk_kda`.
        use_gate_in_kernel, A_log, lower_bound: as :func:`chunk_kda`.
        dt_bias: ``[HV * K]`` (as FLA's kernel reads it; its docstring says ``[HV]``).
        use_beta_sigmoid_in_kernel, allow_neg_eigval: as :func:`chunk_kda`.

    Returns:
        ``(o, final_state)`` as :func:`chunk_gated_delta_rule`.

    Raises:
        TypeError: an argument kdn ops do not implement (among them FLA's serving
            keywords ``ssm_state_indices``, ``num_accepted_tokens``,
            ``inplace_final_state``: see :func:`kdn_compile.delta_rule_decode`), named;
            and as :func:`kdn_compile.recurrent_delta_rule`.
        ValueError: as :func:`chunk_kda`; ``beta`` not ``[B, T, HV]``.

    Source: FLA's ``fla/ops/kda/fused_recurrent.py`` (fla-core 0.6.0) for the arguments
    and preprocessing; the recurrence of :func:`kdn_compile.recurrent_delta_rule`.
    """
    _reject("fused_recurrent_kda", **kwargs)
    _check_gate_args(use_gate_in_kernel, A_log, lower_bound, kda=True)
    _check_gate_shape("g", g, q, v, per_key=True)
    _check_beta_per_head(beta, v)
    q, k, beta = _prepare_qk_beta(q, k, beta, output_final_state, use_qk_l2norm_in_kernel,
                                  use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if use_gate_in_kernel:
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    o, final_state = _recurrent_delta_rule(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
        state_v_first=state_v_first,
    )
    return _finish(o, final_state, output_final_state)
