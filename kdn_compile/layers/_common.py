"""Pieces shared by the layers: short causal convolution, gated RMSNorm, gate init.

Everything here is plain PyTorch so Inductor can fuse it around the ``kdn`` ops.
Nothing branches on tensor values: the same code traces under
``torch.compile(fullgraph=True, dynamic=True)`` and ``torch.export``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kdn_compile._checks import _FLOATS, check_cu_seqlens, check_float, check_state, check_tensor
from kdn_compile._checks import dims, fail
from kdn_compile._checks import listed, num_sequences, sequence_of, shown
from kdn_compile.reference._common import to_work


class ShortConv(nn.Module):
    """Causal depthwise convolution over time followed by SiLU, with a decode cache.

    ``y_t = silu(sum_j weight[:, j] * x_{t - kernel_size + 1 + j})``, written as
    shifted multiply-adds (no convolution op: elementwise work Inductor fuses,
    and no size specialization in its backward). The cache holds the last
    ``kernel_size - 1`` inputs of each sequence, ``[N, kernel_size - 1, C]``,
    so a sequence split across calls (prefill, then token-by-token decode)
    gives the same outputs as one call. With ``cu_seqlens`` (``B == 1``, ``N``
    packed sequences) every tap reads only from its own sequence, or from that
    sequence's cache row. The input may come as channel blocks (the layers pass q, k
    and v apart), each convolved with its rows of ``weight``: under tensor
    parallelism each block is sharded on its channels and is never joined.

    Args:
        channels: number of channels ``C`` (one filter per channel).
        kernel_size: taps per filter, default 4.
    """

    def __init__(self, channels: int, kernel_size: int = 4):
        super().__init__()
        if kernel_size < 2:
            fail(ValueError, f"kernel_size must be >= 2, got {shown(kernel_size)}")
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, kernel_size))
        bound = kernel_size**-0.5  # nn.Conv1d's default for a depthwise filter
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(
        self,
        x: torch.Tensor | tuple[torch.Tensor, ...],
        cache: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor]:
        """``x [B, T, C]`` -> ``(y [B, T, C], cache [N, kernel_size - 1, C])``; or ``x`` a
        tuple of channel blocks ``[B, T, C_i]`` (``sum C_i = C``) -> ``y`` the same blocks,
        as their concatenation would give them.

        Raises:
            ValueError: ``cache`` (a layer's ``state["conv"]``) not of that shape.
        """
        blocks = tuple(x) if isinstance(x, (tuple, list)) else (x,)
        widths = [b.shape[-1] for b in blocks]
        rows = num_sequences(blocks[0].shape[0], cu_seqlens)
        check_state('state["conv"]', cache, (rows, self.kernel_size - 1, sum(widths)))
        caches = [None] * len(blocks) if cache is None else cache.split(widths, dim=-1)
        ys, tails = [], []
        for block, weight, tail in zip(blocks, self.weight.split(widths), caches):
            if cu_seqlens is None:
                y, tail = self._fixed(block, tail, weight)
            else:
                y, tail = self._packed(block, tail, cu_seqlens, weight)
            ys.append(F.silu(y))
            tails.append(tail)
        cache = torch.cat(tails, dim=-1) if len(tails) > 1 else tails[0]
        return (tuple(ys) if isinstance(x, (tuple, list)) else ys[0]), cache

    def _fixed(self, x, cache, weight):
        tail = self.kernel_size - 1
        if cache is None:
            cache = x.new_zeros((x.shape[0], tail, x.shape[-1]))
        padded = torch.cat((cache.to(x.dtype), x), dim=1)
        length = x.shape[1]
        weight = weight.to(x.dtype)
        y = sum(padded[:, j : j + length] * weight[:, j] for j in range(self.kernel_size))
        return y, padded[:, length:]

    def _packed(self, x, cache, cu_seqlens, weight):
        # One pool of rows: every sequence's cache, then the packed tokens. Each
        # tap and each new cache entry is a gather from that pool, so a tap that
        # reaches before its sequence's start lands in that sequence's cache.
        tail = self.kernel_size - 1
        count = num_sequences(x.shape[0], cu_seqlens)
        if cache is None:
            cache = x.new_zeros((count, tail, x.shape[-1]))
        pool = torch.cat((cache.to(x.dtype).flatten(0, 1), x[0]))
        starts = cu_seqlens.to(torch.long)
        steps = torch.arange(x.shape[1], device=x.device)
        sequence = sequence_of(starts, steps)
        position = steps - starts[sequence]

        def row(seq, pos):
            """Pool row of relative position ``pos`` (may be < 0) in sequence ``seq``."""
            return torch.where(pos >= 0, count * tail + starts[seq] + pos, seq * tail + tail + pos)

        weight = weight.to(x.dtype)
        y = sum(
            pool[row(sequence, position - tail + j)] * weight[:, j] for j in range(self.kernel_size)
        )
        lengths = starts[1:] - starts[:-1]
        last = lengths[:, None] - tail + torch.arange(tail, device=x.device)
        ids = torch.arange(count, device=x.device)[:, None].expand_as(last)
        return y[None], pool[row(ids, last)]


class GatedRMSNorm(nn.Module):
    """``rmsnorm(o) * weight * act(gate)`` over the last dim (one head's values).

    Args:
        dim: size of the normalized (last) dim.
        eps: added to the mean square, default 1e-5.
        activation: ``act``, ``"silu"`` (default; Gated DeltaNet) or ``"sigmoid"``
            (Kimi Delta Attention).
    """

    _ACTIVATIONS = {"silu": F.silu, "sigmoid": torch.sigmoid}

    def __init__(self, dim: int, eps: float = 1e-5, activation: str = "silu"):
        super().__init__()
        if activation not in self._ACTIVATIONS:
            fail(ValueError, f"activation must be one of {listed(self._ACTIVATIONS)}, "
                             f"got {shown(activation)}")
        self.eps, self.activation = eps, activation
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        wide = to_work(o)
        normed = wide * torch.rsqrt(wide.square().mean(-1, keepdim=True) + self.eps)
        act = self._ACTIVATIONS[self.activation]
        return (normed * self.weight * act(gate.to(normed.dtype))).to(o.dtype)


def check_sizes(**sizes: int | None) -> None:
    """Layer constructor sizes: each given one a positive int (``conv_size`` at least 2).

    Raises:
        ValueError: naming the first size that is not, and its value.
    """
    for name, value in sizes.items():
        if value is None:
            continue
        least = 2 if name == "conv_size" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            fail(ValueError, f"{name} must be an int >= {least}, got {shown(value)}")


def check_eps(name: str, value) -> float:
    """A layer constructor's epsilon: a finite real number ``>= 0``, as float.

    Raises:
        TypeError: not a real number (a bool, a string, None).
        ValueError: not finite, or negative; naming the argument and its value.
    """
    value = check_float(name, value)
    if not value >= 0:
        fail(ValueError, f"{name} must be >= 0, got {shown(value)}")
    return value


def decay_rate_log(heads: int) -> torch.Tensor:
    """``A_log`` init: ``log A`` with ``A ~ U(1, 16)`` per head (the usual Mamba2/GDN range)."""
    return torch.empty(heads).uniform_(1.0, 16.0).log()


def time_step_bias(size: int, dt_min: float = 1e-3, dt_max: float = 0.1) -> torch.Tensor:
    """``dt_bias`` init: ``softplus^-1(dt)`` with ``dt`` log-uniform in ``[dt_min, dt_max]``."""
    dt = torch.exp(torch.rand(size) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = dt.clamp_min(1e-4)
    return dt + torch.log(-torch.expm1(-dt))


def heads(x: torch.Tensor, count: int) -> torch.Tensor:
    """``[B, T, count * d]`` -> ``[B, T, count, d]``."""
    return x.unflatten(-1, (count, -1))


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, in at least float32, returned in
    ``x``'s dtype: the L2 normalization of q and k in FLA's layers (``l2norm``, same
    ``eps``)."""
    wide = to_work(x)
    return (wide * torch.rsqrt(wide.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def check_input_dtype(layer: nn.Module, x: torch.Tensor) -> None:
    """``x`` in the dtype of ``layer``'s parameters (its ``q_proj`` weight), which its
    projections multiply ``x`` with.

    Not checked under ``torch.autocast`` on ``x``'s device (the projections cast their
    operands there) nor when that weight is not a float16, bfloat16, float32 or float64
    tensor (a quantized projection). Reads dtypes only: no host sync, no graph break.

    Raises:
        TypeError: ``x`` in another dtype, naming both, e.g. ``x must be torch.float32,
            the dtype of this GatedDeltaNet's parameters, got torch.float64``.
    """
    weight = getattr(layer.q_proj, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype not in _FLOATS:
        return
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        fail(TypeError, f"x must be {weight.dtype}, the dtype of this {type(layer).__name__}'s "
                        f"parameters, got {x.dtype}: cast x (or the layer with .to), or run "
                        "under torch.autocast")


def convolved_qkv(layer: nn.Module, x: torch.Tensor, conv_cache, cu_seqlens, value_heads: int,
                  *, with_inputs: bool = False):
    """The q/k/v projections of ``layer`` through its short convolution, split into heads.

    ``layer`` has ``q_proj``, ``k_proj``, ``v_proj``, ``conv``, ``num_heads``,
    ``head_dim`` and ``head_v_dim``. Returns ``(q [B, T, Hk, K], k [B, T, Hk, K],
    v [B, T, value_heads, V], conv_cache)``; q and k are not normalized here. With
    ``with_inputs`` also the convolution's input, the projections joined on their
    channels ``[B, T, C]`` (what the convolution windows hold), last.

    Raises:
        ValueError: ``x`` is not ``[B, T, D]`` (an unbatched ``[T, D]``, say) with
            ``D`` the layer's ``hidden_size``.
        TypeError: ``x`` not in the parameters' dtype (:func:`check_input_dtype`).
    """
    check_tensor("x", x, floating=False)
    if x.dim() != 3:
        fail(ValueError, f"x must be [B, T, D] (3 dims), got shape {dims(x.shape)}")
    hidden = layer.q_proj.in_features
    if x.shape[-1] != hidden:
        fail(ValueError, f"x must be [B, T, D] with D = hidden_size = {hidden}, "
                         f"got shape {dims(x.shape)}")
    check_input_dtype(layer, x)
    # before the packed convolution gathers rows by cu_seqlens
    check_cu_seqlens(cu_seqlens, x.shape[0], x.device, x.shape[1])
    # Three module calls, not one product on the stacked weights: that was 2% faster in
    # the compiled front (H200) but skipped hooks and adapters on the
    # projections (LoRA) and copied the weights on every call (a decode token). The
    # convolution takes them as blocks, never joined: each is head-sharded under
    # tensor parallelism.
    blocks = (layer.q_proj(x), layer.k_proj(x), layer.v_proj(x))
    (q, k, v), conv_cache = layer.conv(blocks, conv_cache, cu_seqlens)
    out = heads(q, layer.num_heads), heads(k, layer.num_heads), heads(v, value_heads), conv_cache
    return out + (torch.cat(blocks, dim=-1),) if with_inputs else out
