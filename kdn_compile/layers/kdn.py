"""Diagonal Kalman Delta Network layer: Kalman-gain delta rule with a learned noise model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from kdn_compile.api import diag_kdn
from kdn_compile.checkpoints import diag_kdn_prefill_states
from kdn_compile._checks import check_float, check_state, num_sequences
from kdn_compile.layers._common import GatedRMSNorm, ShortConv, check_eps, check_sizes, convolved_qkv
from kdn_compile.layers._common import decay_rate_log, heads, time_step_bias
from kdn_compile.layers._serving import SlotCache, load_state, write_slots
from kdn_compile.layers._state import LayerState, signature, state_entries
from kdn_compile.reference._common import to_work, work_dtype
from kdn_compile.reference import (
    INITIAL_PRECISION_FLOOR,
    initial_precision_logit,
    initial_state,
    kalman_noise,
    normalize_query_key,
)
from kdn_compile.serving import (
    KDN_MEMORY_DTYPES, MAX_DECODE_TOKENS, commit_diag_kdn_states, diag_kdn_decode,
)


class DiagKDN(SlotCache, nn.Module):
    """Diagonal Kalman Delta Network token mixer, ``[B, T, D] -> [B, T, D]``.

    ``q, k, v`` come from linear projections through a short causal depthwise
    convolution and SiLU, ``q, k`` normalized by
    :func:`kdn_compile.reference.normalize_query_key`. Raw retention, process
    noise and observation noise projections go through
    :func:`kdn_compile.reference.kalman_noise` to ``log_alpha [B, T, H, K]``,
    ``omega [B, T, H, K]``, ``r [B, T, H]`` and the learned prior precision
    ``[H]``. :func:`kdn_compile.diag_kdn` runs the recurrence (Kalman gain in
    place of GDN's ``beta``; the math is in the docs' math page and
    :mod:`kdn_compile.reference.kdn`), then
    ``rmsnorm(o) * silu(gate_proj(x))`` and the output projection. ``q, k, v`` enter
    :func:`~kdn_compile.diag_kdn` in the activations' dtype (``q, k`` normalized in
    float32 first); the noise model, the Kalman gain and the state are float32 (float64
    for float64 inputs).

    Args:
        hidden_size: model width ``D``.
        num_heads: heads ``H`` (keys and values alike).
        head_dim: key width ``K`` per head.
        head_v_dim: value width ``V`` per head (default ``head_dim``).
        info_scale: weight of each observation in the precision update (default 1).
        conv_size: taps of the short convolution (default 4).
        chunk_size: chunk length of the chunked memory recurrence (default 64).
        norm_eps: epsilon of the output RMSNorm (default 1e-5).

    ``forward(x, state=None, cu_seqlens=None) -> (y, state)``: ``state`` is
    ``None`` (start: zero memory, learned prior precision) or the dict returned
    by the previous call, a :class:`~kdn_compile.layers.LayerState`
    ``{"conv": [N, conv_size - 1, 2 * H * K + H * V], "memory": [N, H, K, V],
    "precision": [N, H, K]}`` (memory and precision in float32, float64 for float64
    inputs) that records the layer type and sizes. Without gradients (``torch.no_grad`` or
    nothing that requires one) and up to 8 tokens without ``cu_seqlens``, the step
    runs :func:`kdn_compile.diag_kdn_decode` on a copy of the state (exact either way).

    Serving (:doc:`/serving`): ``allocate_cache(num_slots, *,
    state_dtype=torch.float32, device=None)`` makes the slot pools (``"conv"``,
    ``"memory"`` float32 or bfloat16, ``"precision"`` float32 holding the learned
    prior; a :class:`~kdn_compile.layers.LayerCache` that records this layer's
    ``state_signature``, which ``step`` and ``reset_cache`` check),
    ``reset_cache(cache, slots)`` frees slots for reuse and ``step(x, cache,
    state_indices, cu_seqlens=None) -> y`` advances the named slots in place: prompts
    through :func:`kdn_compile.diag_kdn`, decode steps of up to 8 tokens through
    :func:`kdn_compile.diag_kdn_decode`. Speculative decoding: ``verify(x, cache,
    state_indices, drafts) -> y`` and ``commit(cache, state_indices, accepted, drafts)``
    with the buffers of ``allocate_drafts(batch, tokens)``, as :class:`GatedDeltaNet`.

    Raises:
        ValueError: a size (``hidden_size``, ``num_heads``, head dims, ``chunk_size``,
            ``conv_size >= 2``) not a positive int; a NaN or infinite ``info_scale``; a
            ``norm_eps`` not finite or negative.
        TypeError: ``norm_eps`` or ``info_scale`` not a real number.
        ValueError (forward): ``x`` not ``[B, T, D]``, ``cu_seqlens`` with ``B != 1`` or
            boundaries that do not start at 0, rise and end at ``T`` (checked before
            the packed convolution; on CUDA or while compiling a device-side assert,
            raised at the next synchronization), a ``state`` entry not of the
            shape this layer returns for these rows (the message names it, e.g.
            ``state["conv"]``), a ``state`` made by a layer of another type or sizes, or
            a dict with other keys.
        TypeError (forward, step): ``x`` or ``state`` of the wrong type (a tensor as
            ``state``); ``x`` in another dtype than the parameters (``q_proj.weight``'s;
            not checked under ``torch.autocast``).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        head_v_dim: int | None = None,
        info_scale: float = 1.0,
        conv_size: int = 4,
        chunk_size: int = 64,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        check_sizes(hidden_size=hidden_size, num_heads=num_heads, head_dim=head_dim,
                    head_v_dim=head_v_dim, conv_size=conv_size, chunk_size=chunk_size)
        norm_eps = check_eps("norm_eps", norm_eps)
        head_v_dim = head_dim if head_v_dim is None else head_v_dim
        self.num_heads, self.head_dim, self.head_v_dim = num_heads, head_dim, head_v_dim
        self.info_scale, self.chunk_size = check_float("info_scale", info_scale), chunk_size
        self.state_signature = signature(
            self, hidden_size=hidden_size, num_heads=num_heads, head_dim=head_dim,
            head_v_dim=head_v_dim, conv_size=conv_size,
        )
        key_width, value_width = num_heads * head_dim, num_heads * head_v_dim

        self.q_proj = nn.Linear(hidden_size, key_width, bias=False)
        self.k_proj = nn.Linear(hidden_size, key_width, bias=False)
        self.v_proj = nn.Linear(hidden_size, value_width, bias=False)
        self.conv = ShortConv(2 * key_width + value_width, conv_size)
        self.retention_proj = nn.Linear(hidden_size, key_width, bias=False)
        self.omega_proj = nn.Linear(hidden_size, key_width, bias=False)
        self.r_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.A_log = nn.Parameter(decay_rate_log(num_heads))
        self.dt_bias = nn.Parameter(time_step_bias(key_width))
        self.initial_precision_param = nn.Parameter(
            torch.full((num_heads,), initial_precision_logit())
        )
        self.gate_proj = nn.Linear(hidden_size, value_width, bias=False)
        self.norm = GatedRMSNorm(head_v_dim, norm_eps)
        self.o_proj = nn.Linear(value_width, hidden_size, bias=False)

    state_dtypes = (torch.float32, torch.bfloat16, torch.float64)  # no float8 memory

    def mixer_inputs(self, x, q, k, v):
        """``(q, k, log_alpha, omega, r, prior)``: q and k normalized (back in v's dtype)
        and the noise model of :func:`kdn_compile.reference.kalman_noise`."""
        # Normalized in float32, then back in the activations' dtype, as the KDA layer's
        # q, k, v: with half activations the memory runs on the two-key kernels' half path.
        q, k = (t.to(v.dtype) for t in normalize_query_key(q, k))
        return (q, k) + kalman_noise(
            heads(self.retention_proj(x), self.num_heads),
            heads(self.omega_proj(x), self.num_heads),
            self.r_proj(x),
            self.A_log,
            self.dt_bias,
            self.initial_precision_param,
        )

    def output(self, o, x):
        """``o [B, T, H, V]`` through the gated norm and the output projection."""
        o = self.norm(o, heads(self.gate_proj(x), self.num_heads)).to(x.dtype)
        return self.o_proj(o.flatten(-2))

    def _needs_grad(self, *tensors) -> bool:
        return torch.is_grad_enabled() and (
            any(t.requires_grad for t in tensors) or any(p.requires_grad for p in self.parameters())
        )

    @staticmethod
    def _decodable(memory, precision) -> bool:
        """Whether the decode op takes a copy of this state as its pools: plain tensors (not
        a sharded layer's DTensors) in the pools' dtypes. Other states take
        :func:`kdn_compile.diag_kdn`, which takes any float state."""
        plain = type(memory) is torch.Tensor and type(precision) is torch.Tensor
        return (plain and memory.dtype in KDN_MEMORY_DTYPES
                and precision.dtype == work_dtype(memory.dtype))

    def forward(
        self,
        x: torch.Tensor,
        state: dict[str, torch.Tensor] | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``x [B, T, D]`` -> ``(y [B, T, D], state)``, continuing ``state`` (None: zero
        memory and the learned prior precision) as the class docstring says; without
        gradients up to 8 tokens run the decode kernels (:func:`kdn_compile.diag_kdn_decode`),
        otherwise :func:`kdn_compile.diag_kdn`. A server's slot pools use :meth:`step`."""
        conv_cache, memory, precision = state_entries(
            self, state, ("conv", "memory", "precision")
        )
        q, k, v, conv_cache = convolved_qkv(self, x, conv_cache, cu_seqlens, self.num_heads)
        q, k, log_alpha, omega, r, prior = self.mixer_inputs(x, q, k, v)
        rows = num_sequences(x.shape[0], cu_seqlens)
        if state is None:
            memory, precision = initial_state(
                prior, batch_size=rows, key_dim=self.head_dim, value_dim=self.head_v_dim
            )
        else:
            h = self.num_heads
            check_state('state["memory"]', memory, (rows, h, self.head_dim, self.head_v_dim))
            check_state('state["precision"]', precision, (rows, h, self.head_dim))
        scale = self.head_dim**-0.5
        short = cu_seqlens is None and statically_known_true(x.shape[1] <= MAX_DECODE_TOKENS)
        if (short and not self._needs_grad(x, memory, precision)
                and self._decodable(memory, precision)):
            # the decode step over a one-slot-per-row (contiguous) copy of the state
            memory = memory.detach().clone(memory_format=torch.contiguous_format)
            precision = precision.detach().clone(memory_format=torch.contiguous_format)
            o = diag_kdn_decode(
                q, k, v, log_alpha, omega, r, memory, precision,
                torch.arange(rows, device=x.device), scale=scale, info_scale=self.info_scale,
            )
        else:
            o, memory, precision = diag_kdn(
                q, k, v, log_alpha, omega, r, memory, precision,
                scale=scale, info_scale=self.info_scale,
                chunk_size=self.chunk_size, cu_seqlens=cu_seqlens,
            )
        state = LayerState(self.state_signature,
                           {"conv": conv_cache, "memory": memory, "precision": precision})
        return self.output(o, x), state

    # -- serving -------------------------------------------------------------------------
    @property
    def _state_key(self) -> str:
        return "memory"

    def pool_layout(self, state_dtype):
        h, dk = self.num_heads, self.head_dim
        return {
            "conv": ((self.conv.kernel_size - 1, self.conv.weight.shape[0]),
                     self.q_proj.weight.dtype),
            "memory": ((h, dk, self.head_v_dim), state_dtype),
            "precision": ((h, dk), work_dtype(state_dtype)),
        }

    def fresh_row(self, name, shape, dtype, device):
        if name != "precision":
            return super().fresh_row(name, shape, dtype, device)
        # the learned prior of kalman_noise, as initial_state lays it out
        prior = INITIAL_PRECISION_FLOOR + F.softplus(to_work(self.initial_precision_param.detach()))
        _, precision = initial_state(prior, batch_size=1, key_dim=self.head_dim, value_dim=1)
        return precision[0].to(device, dtype)

    @property
    def _keeps_checkpoints(self) -> bool:
        return True

    def advance(self, x, cache, indices, cu_seqlens, decode, checkpoints=None):
        q, k, v = self._conv_step(x, cache, indices, cu_seqlens, self.num_heads, checkpoints)
        q, k, log_alpha, omega, r, _ = self.mixer_inputs(x, q, k, v)
        scale = self.head_dim**-0.5
        if decode:
            o = diag_kdn_decode(
                q, k, v, log_alpha, omega, r, cache["memory"], cache["precision"], indices,
                scale=scale, info_scale=self.info_scale,
            )
        else:
            dtype = work_dtype(x.dtype)
            memory = load_state(cache, "memory", indices, dtype)
            precision = load_state(cache, "precision", indices, dtype)
            if checkpoints is None:
                o, memory, precision = diag_kdn(
                    q, k, v, log_alpha, omega, r, memory, precision, scale=scale,
                    info_scale=self.info_scale, chunk_size=self.chunk_size,
                    cu_seqlens=cu_seqlens,
                )
            else:  # the states at the checkpoints too, into their slots
                kept, every, count = checkpoints
                o, memory, precision, memories, precisions = diag_kdn_prefill_states(
                    q, k, v, log_alpha, omega, r, memory, precision, checkpoint_every=every,
                    checkpoints=count, scale=scale, info_scale=self.info_scale,
                    cu_seqlens=cu_seqlens)
                write_slots(cache["memory"], kept, memories)
                write_slots(cache["precision"], kept, precisions)
            write_slots(cache["memory"], indices, memory)
            write_slots(cache["precision"], indices, precision)
        return self.output(o, x)

    # -- speculative decoding (SlotCache.verify / commit) ---------------------------------
    @property
    def _value_heads(self) -> int:
        return self.num_heads

    def _draft_layout(self, state_dtype):
        layout = self.pool_layout(state_dtype)
        memory = torch.float64 if state_dtype == torch.float64 else torch.float32
        return {"memory": (layout["memory"][0], memory), "precision": layout["precision"]}

    def _verify_mix(self, x, q, k, v, cache, indices, drafts):
        q, k, log_alpha, omega, r, _ = self.mixer_inputs(x, q, k, v)
        return diag_kdn_decode(
            q, k, v, log_alpha, omega, r, cache["memory"], cache["precision"], indices,
            scale=self.head_dim**-0.5, info_scale=self.info_scale,
            intermediate_memory=drafts["memory"], intermediate_precision=drafts["precision"],
            update_state=False,
        )

    def _commit_mix(self, cache, indices, accepted, drafts):
        commit_diag_kdn_states(cache["memory"], cache["precision"], indices, drafts["memory"],
                               drafts["precision"], accepted)
