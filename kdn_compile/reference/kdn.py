"""Exact Diagonal Kalman Delta Network (Diag-KDN) recurrences.

Each head keeps a memory ``S [K, V]`` and one covariance coordinate per key
channel, ``p [K]`` (carried as the precision ``1 / p``). Per token::

    p_hat_t = alpha_t**2 * p_{t-1} + omega_t
    kappa_t = p_hat_t * k_t / (r_t + sum_i p_hat_ti * k_ti**2)      (Kalman gain)
    1 / p_t = 1 / p_hat_t + info_scale * k_t**2 / r_t
    S_t     = (I - kappa_t k_t^T) diag(alpha_t) S_{t-1} + kappa_t v_t^T
    o_t     = scale * S_t^T q_t

The covariance uses the raw ``alpha``; the memory decay floors ``log alpha`` at
``LOG_MEMORY_ALPHA_FLOOR``; the gain's denominator has no ``info_scale``.
Functions take and return ``(memory, precision)`` so that prefill, decode and
padded batches continue a sequence exactly. Shapes: ``q, k, log_alpha, omega``
``[B, T, H, K]``, ``v [B, T, H, V]``, ``r [B, T, H]``, ``memory [B, H, K, V]``,
``precision [B, H, K]``. Math runs in ``promote_types(dtype, float32)``.
Source: the Diagonal KDN specification (the docs' math page).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kdn_compile._checks import check_kdn_inputs
from kdn_compile.reference._common import to_work
from kdn_compile.reference.delta_rule import two_key_chunk_recurrence

OMEGA_MIN = 0.0
R_MIN = 0.01
INITIAL_PRECISION = 1.0
INITIAL_PRECISION_FLOOR = 0.1
LOG_MEMORY_ALPHA_FLOOR = math.log(1e-6)
NORM_EPS = 1e-12
DEFAULT_CHUNK_SIZE = 64

__all__ = [
    "OMEGA_MIN", "R_MIN", "INITIAL_PRECISION", "INITIAL_PRECISION_FLOOR",
    "LOG_MEMORY_ALPHA_FLOOR", "NORM_EPS", "DEFAULT_CHUNK_SIZE",
    "initial_precision_logit", "kalman_noise", "normalize_query_key", "initial_state",
    "mask_padding", "diag_kdn_step", "diag_kdn_recurrent", "kalman_gain",
    "covariance_step_maps", "mobius_product",
    "chunked_memory", "diag_kdn_chunked", "diag_kdn_reference",
]


def initial_precision_logit() -> float:
    """Raw parameter whose floored softplus is ``INITIAL_PRECISION``."""
    return math.log(math.expm1(INITIAL_PRECISION - INITIAL_PRECISION_FLOOR))


def kalman_noise(
    retention_raw: torch.Tensor,
    omega_raw: torch.Tensor,
    r_raw: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    initial_precision_param: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Map raw projections to ``(log_alpha, omega, r, initial_precision)``.

    ``log_alpha = -exp(A_log)[h] * softplus(retention_raw + dt_bias)`` (natural
    log, ``[..., H, K]``), ``omega = OMEGA_MIN + softplus(omega_raw)``,
    ``r = R_MIN + softplus(r_raw)``, ``initial_precision =
    INITIAL_PRECISION_FLOOR + softplus(initial_precision_param)``. ``A_log`` is
    ``[H]``, ``dt_bias`` has ``H * K`` entries.
    """
    heads, key_dim = retention_raw.shape[-2:]
    rate = to_work(A_log).exp().view(heads, 1)
    log_alpha = -rate * F.softplus(to_work(retention_raw) + to_work(dt_bias).view(heads, key_dim))
    omega = OMEGA_MIN + F.softplus(to_work(omega_raw))
    r = R_MIN + F.softplus(to_work(r_raw))
    precision = INITIAL_PRECISION_FLOOR + F.softplus(to_work(initial_precision_param))
    return log_alpha, omega, r, precision


def normalize_query_key(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalize ``q`` and ``k`` over the last dim (eps ``NORM_EPS``), in the working dtype."""
    return (
        F.normalize(to_work(q), dim=-1, eps=NORM_EPS),
        F.normalize(to_work(k), dim=-1, eps=NORM_EPS),
    )


def initial_state(
    initial_precision: torch.Tensor, *, batch_size: int, key_dim: int, value_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero memory ``[B, H, K, V]`` and the learned prior precision ``[B, H, K]``."""
    heads = initial_precision.shape[0]
    prior = to_work(initial_precision)
    memory = prior.new_zeros((batch_size, heads, key_dim, value_dim))
    precision = prior.view(1, heads, 1).expand(batch_size, heads, key_dim).contiguous()
    return memory, precision


def mask_padding(
    token_mask: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_alpha: torch.Tensor,
    omega: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Make padded tokens (``token_mask [B, T]`` False) identity steps.

    Zero key, value, log decay and process noise leave memory and precision
    untouched (the gain of a zero key is zero).
    """
    keep = token_mask[:, :, None, None]
    return tuple(torch.where(keep, x, 0.0) for x in (k, v, log_alpha, omega))


def diag_kdn_step(
    q, k, v, log_alpha, omega, r, memory, precision, *, scale: float, info_scale: float
):
    """Advance one token; ``q, k, log_alpha, omega`` are ``[B, H, K]``, ``r`` ``[B, H]``.

    Returns ``(output [B, H, V], memory, precision)``.
    """
    k_squared = k.square()
    predicted = (2.0 * log_alpha).exp() / precision + omega
    noise = r[..., None]
    gain = predicted * k / (noise + (predicted * k_squared).sum(-1, keepdim=True))
    precision = predicted.reciprocal() + info_scale * k_squared / noise
    decayed = memory * log_alpha.clamp_min(LOG_MEMORY_ALPHA_FLOOR).exp()[..., None]
    innovation = v - torch.einsum("bhk,bhkv->bhv", k, decayed)
    memory = decayed + gain[..., None] * innovation[..., None, :]
    output = scale * torch.einsum("bhk,bhkv->bhv", q, memory)
    return output, memory, precision


def diag_kdn_recurrent(
    q, k, v, log_alpha, omega, r, memory, precision, *, scale: float, info_scale: float
):
    """Token-by-token Diag-KDN; returns ``(output [B, T, H, V], memory, precision)``."""
    outputs = []
    for t in range(q.shape[1]):
        output, memory, precision = diag_kdn_step(
            q[:, t], k[:, t], v[:, t], log_alpha[:, t], omega[:, t], r[:, t],
            memory, precision, scale=scale, info_scale=info_scale,
        )
        outputs.append(output)
    if not outputs:
        return v.new_zeros(v.shape).to(memory.dtype), memory, precision
    return torch.stack(outputs, dim=1), memory, precision


def _normalized(entries):
    """A 2x2 map ``(m00, m01, m10, m11)`` divided by its largest entry magnitude.

    A Mobius map is unchanged by scaling its matrix, so this changes no covariance;
    the scale is a constant for autograd (its gradient is zero exactly).
    """
    size = torch.stack(entries).abs().amax(dim=0).detach()
    size = size.clamp_min(torch.finfo(size.dtype).tiny)
    return tuple(entry / size for entry in entries)


def _compose(later, earlier):
    """``later @ earlier`` for normalized 2x2 maps kept as ``(m00, m01, m10, m11)``,
    normalized again: entries of the factors are at most 1 in magnitude, so every
    product stays finite however long the scan (:func:`_normalized`)."""
    a00, a01, a10, a11 = later
    b00, b01, b10, b11 = earlier
    return _normalized((
        a00 * b00 + a01 * b10,
        a00 * b01 + a01 * b11,
        a10 * b00 + a11 * b10,
        a10 * b01 + a11 * b11,
    ))


def _prefix_products(maps):
    """Inclusive prefix products ``M_t ... M_1`` along dim 1 (Hillis-Steele)."""
    length = maps[0].shape[1]
    step = 1
    while step < length:
        combined = _compose(
            tuple(m[:, step:] for m in maps), tuple(m[:, :-step] for m in maps)
        )
        maps = tuple(torch.cat((m[:, :step], c), dim=1) for m, c in zip(maps, combined))
        step *= 2
    return maps


def covariance_step_maps(k, log_alpha, omega, r, *, info_scale: float):
    """Each token's covariance step as a Mobius map ``(m00, m01, m10, m11)``, each
    ``[B, T, H, K]``: ``p_t = (m00 p + m01) / (m10 p + m11)``, the matrix
    ``(alpha^2, omega; I alpha^2, 1 + I omega)`` with ``I = info_scale k^2 / r``, scaled.

    Where ``|I| > 1`` the matrix is divided by ``I`` as its entries are formed, from
    ``1 / I = r / (info_scale k^2)``, so that neither ``I`` nor ``I * omega`` is formed (they
    overflow for a tiny ``r``, or a tiny ``r`` with a large ``omega``); then by its largest
    entry magnitude (:func:`_normalized`): products of maps stay finite for every ``r > 0``,
    ``omega >= 0`` that float32 holds. Scaling changes no covariance.
    """
    alpha_squared = (2.0 * log_alpha).exp()
    weight = info_scale * k.square()
    noise = r[..., None]
    large = weight.abs() > noise  # |I| > 1
    # each form divides by 1 where the other is taken: no inf in either one's gradient
    information = weight / torch.where(large, 1.0, noise)
    inverse = noise / torch.where(large, weight, 1.0)
    return _normalized((
        torch.where(large, alpha_squared * inverse, alpha_squared),
        torch.where(large, omega * inverse, omega),
        torch.where(large, alpha_squared, information * alpha_squared),
        torch.where(large, inverse + omega, 1.0 + information * omega),
    ))


def mobius_product(maps: torch.Tensor) -> torch.Tensor:
    """The product ``M_T ... M_1`` of the 2x2 maps ``maps [B, T, ..., 4]`` along dim 1.

    Entries are ``(m00, m01, m10, m11)`` on the last dim; the result ``[B, ..., 4]``
    is rescaled to largest entry magnitude 1 (the Mobius map it stands for is
    unchanged), the identity when ``T == 0``. Pairs are multiplied level by level, so
    the work is ``O(T)`` in ``log2(T)`` rounds.
    """
    entries = tuple(maps.unbind(-1))
    identity = (1.0, 0.0, 0.0, 1.0)
    if maps.shape[1] == 0:
        return torch.stack([maps.new_full(maps.shape[:1] + maps.shape[2:-1], value)
                            for value in identity], dim=-1)
    while entries[0].shape[1] > 1:
        if entries[0].shape[1] % 2:  # an identity last, as the later factor of the last pair
            entries = tuple(torch.cat((e, torch.full_like(e[:, :1], value)), dim=1)
                            for e, value in zip(entries, identity))
        entries = _compose(tuple(e[:, 1::2] for e in entries), tuple(e[:, 0::2] for e in entries))
    return torch.stack([e[:, 0] for e in entries], dim=-1)


def kalman_gain(k, log_alpha, omega, r, precision, *, info_scale: float):
    """Gains ``kappa [B, T, H, K]`` for every token and the final precision ``[B, H, K]``.

    The covariance step ``p -> (a^2 p + w) / (I a^2 p + 1 + I w)`` (with
    ``I = info_scale k^2 / r``) is a Mobius map, so all covariances come from a
    parallel prefix scan of 2x2 matrices applied to the initial ``1 / precision``.
    """
    k_squared = k.square()
    noise = r[..., None]
    alpha_squared = (2.0 * log_alpha).exp()
    m00, m01, m10, m11 = _prefix_products(
        covariance_step_maps(k, log_alpha, omega, r, info_scale=info_scale)
    )
    start = precision.reciprocal()[:, None]
    covariance = (m00 * start + m01) / (m10 * start + m11)
    previous = torch.cat((start, covariance[:, :-1]), dim=1)
    predicted = alpha_squared * previous + omega
    gain = predicted * k / (noise + (predicted * k_squared).sum(-1, keepdim=True))
    if k.shape[1] == 0:
        return gain, precision
    # the last token's update as the token step writes it: 1 / covariance would square a tiny
    # covariance in the gradient (overflowing float32 for r below about 1e-19)
    information = info_scale * k_squared[:, -1] / noise[:, -1]
    return gain, predicted[:, -1].reciprocal() + information


def chunked_memory(
    q, k, v, log_alpha, gain, memory, *, scale: float, chunk_size: int = DEFAULT_CHUNK_SIZE
):
    """Two-key delta-rule memory (erase ``k``, write ``gain``) in WY form per chunk.

    Uses the floored memory decay. Returns ``(output [B, T, H, V], memory)``.
    Raises ``ValueError`` for a non-positive ``chunk_size``.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    decay = log_alpha.clamp_min(LOG_MEMORY_ALPHA_FLOOR)
    output, memory = two_key_chunk_recurrence(
        *(x.transpose(1, 2) for x in (q, k, gain, v, decay)),
        memory, scale=scale, chunk_size=chunk_size,
    )
    return output.transpose(1, 2), memory


def diag_kdn_chunked(
    q, k, v, log_alpha, omega, r, memory, precision, *, scale: float, info_scale: float,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
):
    """Parallel form of :func:`diag_kdn_recurrent`: gain scan, then chunked memory."""
    gain, precision = kalman_gain(k, log_alpha, omega, r, precision, info_scale=info_scale)
    output, memory = chunked_memory(
        q, k, v, log_alpha, gain, memory, scale=scale, chunk_size=chunk_size
    )
    return output, memory, precision


def diag_kdn_reference(
    q, k, v, log_alpha, omega, r, memory, precision, *, scale: float, info_scale: float,
    chunk_size: int = DEFAULT_CHUNK_SIZE, cu_seqlens: torch.Tensor | None = None,
):
    """:func:`diag_kdn_chunked` over packed sequences, in the working dtype.

    With ``cu_seqlens`` (``[N + 1]``, ``B == 1``, read on the CPU) each sequence
    runs from its own ``memory [N, H, K, V]`` and ``precision [N, H, K]`` row.
    Returns ``(output, memory, precision)``: ``output`` in ``v``'s dtype, the
    state in ``promote_types(dtype, float32)``.

    Raises:
        ValueError, TypeError: on inconsistent shapes, dtypes or devices, or bad
            ``cu_seqlens`` (as :func:`kdn_compile.diag_kdn`).
    """
    from kdn_compile.reference._common import segments, work_dtype

    check_kdn_inputs(
        q, k, v, log_alpha, omega, r, memory, precision, cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )
    dtype = work_dtype(q.dtype)
    work = [x.to(dtype) for x in (q, k, v, log_alpha, omega, r)]
    memory, precision = memory.to(dtype), precision.to(dtype)
    outputs, memories, precisions = [], [], []
    for rows, times in segments(cu_seqlens, q.shape[0], q.shape[1]):
        o, m, p = diag_kdn_chunked(
            *(x[:, times] for x in work), memory[rows], precision[rows],
            scale=scale, info_scale=info_scale, chunk_size=chunk_size,
        )
        outputs.append(o)
        memories.append(m)
        precisions.append(p)
    return (
        torch.cat(outputs, dim=1).to(v.dtype),
        torch.cat(memories, dim=0),
        torch.cat(precisions, dim=0),
    )
