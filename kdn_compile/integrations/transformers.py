"""Hugging Face transformers' Gated DeltaNet and Kimi Delta Attention models on kdn ops.

:func:`use_kdn` routes the recurrence of every Gated DeltaNet layer of Qwen3-Next
(``Qwen3NextGatedDeltaNet``), Qwen3.5 (``Qwen3_5GatedDeltaNet``), Qwen3.5-MoE
(``Qwen3_5MoeGatedDeltaNet``), Qwen4-Exp (``Qwen4ExpTextGatedDeltaNet``) and Olmo Hybrid
(``OlmoHybridGatedDeltaNet``), and every Kimi Delta Attention layer of Kimi Linear
(``KimiLinearDeltaAttention``) and GLM-5.3-Flash (``Glm5NextTextLinearAttention``),
through :mod:`kdn_compile.fla`'s drop-ins for FLA (the full table: :data:`LAYERS`).
transformers calls FLA's ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``
/ ``chunk_kda`` / ``fused_recurrent_kda`` when FLA is installed and PyTorch loops
otherwise; after :func:`use_kdn` these layers call kdn ops instead, in eager mode,
under ``torch.compile(fullgraph=True)`` and under ``torch.export``. The rest of each
layer (projections, gates, convolution, gated norm, transformers' cache updates) is
transformers' own code, unchanged.

Tested with transformers 5.23.0 (the version the ``test`` extra pins; the CPU suite) and
5.17.0 (the GPU tiers).
"""

from __future__ import annotations

import functools
import inspect
import sys
import types

import torch
import torch.nn.functional as F

from kdn_compile import fla
from kdn_compile._checks import check_cu_seqlens, fail, sequence_of, type_name

__all__ = ["use_kdn", "LAYERS", "causal_conv1d"]


def causal_conv1d(hidden_states: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None, activation: str | None = None,
                  cu_seq_lens_q: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """transformers' PyTorch ``causal_conv1d_fn`` that also respects packed sequences.

    ``y[:, c, t] = act(bias[c] + sum_j weight[c, j] * x[:, c, t - (W - 1) + j])`` with
    ``W = weight.shape[-1]``; a tap that reaches before the start of its token's sequence
    reads zero. Packed sequences are named as transformers names them for attention,
    ``cu_seq_lens_q`` (``[N + 1]`` boundaries, ``B == 1``); without it the whole row is
    one sequence, as in transformers' own function. Shifted multiply-adds in traced
    PyTorch, so that it compiles with the model.

    Args:
        hidden_states: ``[B, C, T]``.
        weight: ``[C, W]`` depthwise filters.
        bias: ``[C]`` or None.
        activation: ``"silu"`` / ``"swish"`` or None.
        cu_seq_lens_q: packed sequence boundaries, int32 or int64, or None.

    Returns:
        ``[B, C, T]`` in the dtype of ``hidden_states``.

    Raises:
        ValueError: ``activation`` is another name; ``cu_seq_lens_q`` not ``[N + 1]``, with
            ``B != 1`` or boundaries that do not start at 0, rise and end at ``T`` (as the
            ops check them: on CUDA or while compiling a device-side assert).
        TypeError: ``cu_seq_lens_q`` not an int32 or int64 tensor.
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be 'silu', 'swish' or None, got {activation!r}")
    length, width = hidden_states.shape[-1], weight.shape[-1]
    x = hidden_states.to(weight.dtype)
    if cu_seq_lens_q is not None:
        # boundaries on any device: they are moved to the input's
        check_cu_seqlens(cu_seq_lens_q, x.shape[0], getattr(cu_seq_lens_q, "device", x.device),
                         length)
        starts = cu_seq_lens_q.to(device=x.device, dtype=torch.long)
        steps = torch.arange(length, device=x.device)
        position = steps - starts[sequence_of(starts, steps)]
    y = 0
    for j in range(width):
        shift = width - 1 - j
        tap = F.pad(x, (shift, 0))[..., :length]
        if cu_seq_lens_q is not None and shift:
            tap = tap * (position >= shift).to(x.dtype)
        y = y + tap * weight[:, j, None]
    if bias is not None:
        y = y + bias[:, None]
    if activation is not None:
        y = F.silu(y)
    return y.to(hidden_states.dtype)


_GATED_DELTANET = {
    "torch_chunk_gated_delta_rule": fla.chunk_gated_delta_rule,
    "torch_recurrent_gated_delta_rule": fla.fused_recurrent_gated_delta_rule,
    "causal_conv1d_fn": causal_conv1d,
}
_KIMI_DELTA_ATTENTION = {
    "chunk_kimi_delta_attention": fla.chunk_kda,
    "recurrent_kimi_delta_attention": fla.fused_recurrent_kda,
    "causal_conv1d_fn": causal_conv1d,
}

LAYERS = {
    (f"transformers.models.{model}.modeling_{model}", layer): replacements
    for model, layer, replacements in (
        ("qwen3_next", "Qwen3NextGatedDeltaNet", _GATED_DELTANET),
        ("qwen3_5", "Qwen3_5GatedDeltaNet", _GATED_DELTANET),
        ("qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet", _GATED_DELTANET),
        ("qwen4_exp", "Qwen4ExpTextGatedDeltaNet", _GATED_DELTANET),
        ("olmo_hybrid", "OlmoHybridGatedDeltaNet", _GATED_DELTANET),
        ("kimi_linear", "KimiLinearDeltaAttention", _KIMI_DELTA_ATTENTION),
        ("glm5_next", "Glm5NextTextLinearAttention", _KIMI_DELTA_ATTENTION),
    )
}
"""The layers :func:`use_kdn` routes: ``(module, class)`` to the functions its
``forward`` calls by global name and the function each becomes: the recurrences
:mod:`kdn_compile.fla`'s, the prefill convolution :func:`causal_conv1d` (packed
sequences). Every listed layer makes its natural-log decay ``g`` and its ``beta`` in its
own code and passes them with ``use_qk_l2norm_in_kernel=True``: Gated DeltaNet
``g = -exp(A_log) * softplus(a + dt_bias)`` per value head, ``beta = sigmoid(b)``
(Olmo Hybrid: ``2 * sigmoid(b)`` with ``linear_allow_neg_eigval``); KDA ``g`` per key
channel, Kimi Linear's ``-exp(A_log) * softplus(f + dt_bias)``, GLM-5.3-Flash's
``linear_lower_bound * sigmoid(exp(A_log) * (f + dt_bias))`` when that bound is set."""

_MARK = "__kdn_compile__"
_forwards: dict[type, types.FunctionType] = {}


def _taking_own_arguments(function):
    """``function`` called with only the keyword arguments it names, as transformers'
    FLA fallback calls FLA (the layers pass all of their ``**kwargs`` on). A function
    that takes ``cu_seqlens`` and is not given it reads the packed sequences from
    ``cu_seq_lens_q``, transformers' name for them (the KDA layers pass only that)."""
    names = frozenset(name for name, p in inspect.signature(function).parameters.items()
                      if p.kind is not inspect.Parameter.VAR_KEYWORD)
    packs = "cu_seqlens" in names

    @functools.wraps(function)
    def call(*args, **kwargs):
        if packs and kwargs.get("cu_seqlens") is None and "cu_seq_lens_q" in kwargs:
            kwargs["cu_seqlens"] = kwargs["cu_seq_lens_q"]
        return function(*args, **{k: v for k, v in kwargs.items() if k in names})

    return call


def _with_globals(function, replacements: dict, where: str):
    """A copy of ``function`` whose global names in ``replacements`` resolve to their
    values; decorators made with ``functools.wraps`` are copied around the new one."""
    inner = getattr(function, "__wrapped__", None)
    if inner is not None:
        new_inner = _with_globals(inner, replacements, where)
        cells = function.__closure__ or ()
        if not any(cell.cell_contents is inner for cell in cells):
            raise RuntimeError(f"use_kdn cannot route {where}: a decorator of its forward does not "
                               "hold the function it wraps; transformers 5.17.0 and 5.23.0 are "
                               "tested")
        closure = tuple(types.CellType(new_inner) if cell.cell_contents is inner else cell
                        for cell in cells)
        new = types.FunctionType(function.__code__, function.__globals__, function.__name__,
                                 function.__defaults__, closure)
    else:
        missing = sorted(set(replacements) - set(function.__code__.co_names))
        if missing:
            raise RuntimeError(f"use_kdn cannot route {where}: its forward no longer calls {missing}; "
                               "transformers 5.17.0 and 5.23.0 are tested")
        # Without "__name__", torch.compile guards these globals in this dictionary, not
        # on the module, where the names still hold transformers' own functions.
        namespace = {k: v for k, v in function.__globals__.items() if k != "__name__"}
        namespace.update({name: _taking_own_arguments(fn) for name, fn in replacements.items()})
        new = types.FunctionType(function.__code__, namespace, function.__name__,
                                 function.__defaults__, function.__closure__)
    functools.update_wrapper(new, function)
    new.__kwdefaults__ = function.__kwdefaults__
    if inner is not None:
        new.__wrapped__ = new_inner
    return new


def _kdn_forward(cls: type, replacements: dict) -> types.FunctionType:
    if cls not in _forwards:
        forward = _with_globals(cls.forward, replacements, f"{cls.__module__}.{cls.__qualname__}")
        setattr(forward, _MARK, True)
        _forwards[cls] = forward
    return _forwards[cls]


def use_kdn(model: torch.nn.Module) -> torch.nn.Module:
    """Route every Gated DeltaNet and Kimi Delta Attention layer of ``model`` (the
    classes of :data:`LAYERS`) through kdn ops.

    Each such layer's ``forward`` becomes transformers' own ``forward`` calling
    :func:`kdn_compile.fla.chunk_gated_delta_rule` and
    :func:`~kdn_compile.fla.fused_recurrent_gated_delta_rule` (Gated DeltaNet: Qwen3-Next,
    Qwen3.5, Qwen3.5-MoE, Qwen4-Exp, Olmo Hybrid) or :func:`~kdn_compile.fla.chunk_kda`
    and :func:`~kdn_compile.fla.fused_recurrent_kda` (KDA: Kimi Linear, GLM-5.3-Flash)
    where it would call FLA or its PyTorch fallback: prefill, decoding
    with transformers' cache and packed sequences go through kdn ops. Packed sequences
    arrive as transformers' ``cu_seq_lens_q`` (flash-attention keyword arguments, ``B ==
    1``); the prefill convolution becomes :func:`causal_conv1d`, which keeps each packed
    sequence to itself, as the recurrence does. Only the matched layer instances change
    (no global state); other modules and layers, including subclasses of these layers,
    are left as they are. Calling it again changes nothing. A whole model saved with
    ``torch.save`` loads with transformers' own ``forward``: call it again after
    ``torch.load``. Importing :mod:`kdn_compile` does not import transformers.

    Tested with transformers 5.17.0 and 5.23.0.

    Args:
        model (torch.nn.Module): a transformers model (or any module) holding layers of
            the classes of :data:`LAYERS` (``Qwen3NextGatedDeltaNet``,
            ``KimiLinearDeltaAttention``, ...).

    Returns:
        torch.nn.Module: ``model`` itself.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module`` (None, a tensor, a model's
            name), e.g. ``use_kdn: model must be a torch.nn.Module, got NoneType``.
        ValueError: ``model`` holds none of these layers.
        RuntimeError: the installed transformers' layer no longer calls the functions
            named in :data:`LAYERS`; a layer's instance already has a ``forward`` of its
            own that is not (and does not wrap) :func:`use_kdn`'s, such as accelerate's
            hooks set (nothing is changed then).

    Example::

        from transformers import AutoModelForCausalLM
        from kdn_compile.integrations.transformers import use_kdn

        model = use_kdn(AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-Next-80B-A3B-Instruct"))
        model = torch.compile(model, fullgraph=True)
    """
    if not isinstance(model, torch.nn.Module):
        fail(TypeError, f"use_kdn: model must be a torch.nn.Module, got {type_name(model)}")
    classes = {}
    for (module_name, class_name), replacements in LAYERS.items():
        # A layer can only exist once its modeling module is imported.
        module = sys.modules.get(module_name)
        cls = getattr(module, class_name, None) if module is not None else None
        if cls is not None:
            classes[cls] = replacements
    layers = [(path, layer) for path, layer in model.named_modules() if type(layer) in classes]
    if not layers:
        searched = ", ".join(f"{m}.{c}" for m, c in LAYERS)
        raise ValueError(f"use_kdn found no layer to route in {type(model).__name__}: it looks "
                         f"for {searched}")
    todo = []
    for path, layer in layers:
        current = layer.__dict__.get("forward")
        # the class's own forward: what unpickling a routed layer sets (pickle stores the
        # bound method as getattr(layer, "forward"), read before the instance's dict is back)
        if current is None or getattr(current, "__func__", None) is type(layer).forward:
            todo.append(layer)
        elif not _routed(current):
            raise RuntimeError(
                f"use_kdn cannot route {path} ({type(layer).__name__}): its instance has its "
                f"own forward, a {type_name(current)}, "
                "which routing would drop (hooks such as accelerate's set one): call use_kdn "
                "before adding them")
    for layer in todo:
        layer.forward = types.MethodType(_kdn_forward(type(layer), classes[type(layer)]), layer)
    return model


def _routed(forward) -> bool:
    """Whether an instance's own ``forward`` is :func:`use_kdn`'s or wraps it
    (``__wrapped__`` chains, as ``functools.update_wrapper`` sets)."""
    def marked(f):
        return getattr(getattr(f, "__func__", None), _MARK, False)

    return marked(inspect.unwrap(forward, stop=marked))
