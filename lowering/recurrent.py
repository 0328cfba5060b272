"""Token recurrences in Triton: decode steps over state pools, and the token loop of any length.

One program per (sequence, head, tile of ``BV`` value columns) holds its ``[K, BV]``
state tile in registers across the sequence's tokens, so the state is read once and
written once per call whatever ``T`` is: the cost of a decode step is that traffic.

* :func:`recurrent_delta_fwd`: GDN (scalar gate ``g [.., Hv]``) and KDA (per-key gate
  ``g [.., Hv, K]``), ``S_t = (I - beta_t k_t k_t^T) diag(e^{g_t}) S_{t-1} +
  beta_t k_t v_t^T``, ``o_t = scale S_t^T q_t``. The state comes from an initial state
  (row ``n``) or from a pool (slot ``state_indices[n]``), in float32, bfloat16 or
  float8 E4M3 with one float32 scale per ``[K, 64]`` tile, and goes to a new float32
  state or back to the pool in its dtype.
* :func:`recurrent_kdn_fwd`: Diag-KDN, the Kalman gain step (covariance with the raw
  ``alpha``, memory with ``log alpha`` floored) then the two-key update, over a memory
  pool (float32 or bfloat16) and a float32 precision pool.

A negative slot marks a padding row: its output is zeros and nothing else is read or
written. One program of each decode launch also checks every index (none ``>= S``, no
non-negative one repeated) into a flag that the op asserts on without a host sync; a slot
``>= S`` is skipped like a padding row, so no launch touches memory past the pool. Float8 stores round as
:func:`kdn_compile.reference.fp8.quantize_state_fp8`: ``scale = amax / 448`` of the
tile (1 when all zero) and values ``state / scale`` to nearest-even E4M3, both
divisions correctly rounded (``div_rn``), so a kernel's pool equals the reference's
bit for bit on the same float32 state. Launchers size grids from shapes alone and
never synchronize: every call can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

__all__ = [
    "FP8_BLOCK_V", "decode_config", "recurrent_delta_fwd", "recurrent_kernel_supports",
    "recurrent_kdn_fwd",
]

FP8_BLOCK_V = 64  # value columns per float8 scale: one program owns one scale tile
_E4M3_MAX = 448.0
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_STATE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256  # a [256, BV] float32 tile still fits in registers at BV <= 32

# State load/store kinds (constexpr): nothing (zeros), a plain dtype, float8 with scales.
_NONE, _PLAIN, _FP8 = 0, 1, 2


def recurrent_kernel_supports(q, v, state_dtypes=()) -> bool:
    """Whether the token-recurrence kernels cover these inputs (shapes and dtypes only):
    q/k/v float16, bfloat16 or float32; ``K <= 256``; every state dtype in
    ``state_dtypes`` float16/bfloat16/float32 or float8 E4M3. float64 takes the reference."""
    return (
        q.dtype in _DTYPES and v.dtype == q.dtype
        and 1 <= q.shape[-1] <= _MAX_HEAD_DIM and v.shape[-1] >= 1
        and all(d in _STATE_DTYPES or d == torch.float8_e4m3fn for d in state_dtypes)
    )


def decode_config(value_dim: int, float8: bool) -> tuple[int, int]:
    """``(BV, num_warps)``: value columns per program and warps.

    A float8 pool needs ``BV = 64`` (one program per scale tile); otherwise 32-column
    tiles on 4 warps (swept against 8 and 16 columns on 1-2 warps on the H200:
    ``kdn-compile bench --ops decode``).
    """
    if float8:
        return min(FP8_BLOCK_V, triton.next_power_of_2(value_dim)), 4
    return min(32, triton.next_power_of_2(value_dim)), 4


@triton.jit
def _repeats(rows, r_ids, cols, c_ids, c_mask):
    """How many non-negative ``rows`` reappear later (higher id) among ``cols``."""
    repeated = (rows[:, None] == cols[None, :]) & (rows[:, None] >= 0)
    repeated = repeated & (r_ids[:, None] < c_ids[None, :]) & c_mask[None, :]
    return tl.sum(tl.sum(repeated.to(tl.int32), axis=1), axis=0)


@triton.jit
def _round_to_e4m3(y):
    """``y`` (float32, ``|y| <= 448``) rounded to the nearest E4M3 value, ties to even, as
    float32: ``y`` in units of its E4M3 spacing ``2^(max(e, -6) - 3)``, rounded to an
    integer by the ``1.5 * 2^23`` addition. The cast to float8 that follows is then exact
    on every backend (Triton's interpreter rounds some float8 casts wrongly)."""
    magnitude = tl.abs(y)
    bits = magnitude.to(tl.int32, bitcast=True)
    exponent = tl.maximum((bits >> 23) - 127, -6)
    spacing = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    units = magnitude / spacing  # exact: a power of two
    units = (units + 12582912.0) - 12582912.0
    rounded = units * spacing
    return tl.where(y < 0, -rounded, rounded)  # -0.0 where a negative value rounds to zero


@triton.jit
def _fp8_tile(b_h, BOUND: tl.constexpr):
    """``(values, scale)``: a float32 tile as E4M3 and its dynamic scale (amax / BOUND, 1 if 0)."""
    amax = tl.max(tl.max(tl.abs(b_h), axis=1), axis=0)
    s = tl.where(amax > 0, tl.math.div_rn(amax, BOUND), 1.0)
    return _round_to_e4m3(tl.math.div_rn(b_h, s + tl.zeros_like(b_h))).to(tl.float8e4nv), s


@triton.jit
def _recurrent_delta_kernel(
    q, k, v, g, beta, o, state_in, scales_in, state_out, scales_out, inter,
    indices, slots_ok, cu_seqlens, T, num_rows, num_slots, scale,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NS: tl.constexpr,
    PER_KEY: tl.constexpr, STATE_V_FIRST: tl.constexpr, LOAD: tl.constexpr,
    STORE: tl.constexpr, SLOTS: tl.constexpr, VARLEN: tl.constexpr, INTER: tl.constexpr,
    CHECK_BLOCK: tl.constexpr,
):
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // HV, i_nh % HV
    i_hk = i_h // (HV // HK)
    if VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    if STATE_V_FIRST:
        p_tile = o_k[:, None] + o_v[None, :] * K
    else:
        p_tile = o_k[:, None] * V + o_v[None, :]

    row = i_n.to(tl.int64)
    if SLOTS:
        if i_nh + i_v == 0:  # one program checks every index (see recurrent_delta_fwd)
            errors = 0
            for r0 in range(0, num_rows, CHECK_BLOCK):
                r_ids = r0 + tl.arange(0, CHECK_BLOCK)
                rows = tl.load(indices + r_ids, mask=r_ids < num_rows, other=-1).to(tl.int64)
                errors += tl.sum((rows >= num_slots).to(tl.int32), axis=0)
                for c0 in range(r0, num_rows, CHECK_BLOCK):
                    c_ids = c0 + tl.arange(0, CHECK_BLOCK)
                    cols = tl.load(indices + c_ids, mask=c_ids < num_rows, other=-1)
                    errors += _repeats(rows, r_ids, cols.to(tl.int64), c_ids, c_ids < num_rows)
            tl.store(slots_ok, errors == 0)
        row = tl.load(indices + i_n).to(tl.int64)
        if (row < 0) | (row >= num_slots):  # padding row: zero output, no state touched
            for t in range(bos, eos):
                tl.store(o + (t * HV + i_h) * V + o_v, tl.zeros([BV], tl.float32)
                         .to(o.dtype.element_ty), mask=m_v)
            return
    base = (row * HV + i_h) * K * V
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if LOAD == 1:
        b_h = tl.load(state_in + base + p_tile, mask=m_h, other=0).to(tl.float32)
    if LOAD == 2:  # masked lanes are undefined bytes until the where
        b_h = tl.load(state_in + base + p_tile, mask=m_h).to(tl.float32)
        b_h = tl.where(m_h, b_h * tl.load(scales_in + (row * HV + i_h) * NS + i_v), 0.0)

    for t in range(bos, eos):
        b_q = tl.load(q + (t * HK + i_hk) * K + o_k, mask=m_k, other=0).to(tl.float32) * scale
        b_k = tl.load(k + (t * HK + i_hk) * K + o_k, mask=m_k, other=0).to(tl.float32)
        b_v = tl.load(v + (t * HV + i_h) * V + o_v, mask=m_v, other=0).to(tl.float32)
        b_beta = tl.load(beta + t * HV + i_h).to(tl.float32)
        if PER_KEY:
            b_g = tl.load(g + (t * HV + i_h) * K + o_k, mask=m_k, other=0).to(tl.float32)
            b_h = b_h * tl.exp(b_g)[:, None]
        else:
            b_h = b_h * tl.exp(tl.load(g + t * HV + i_h).to(tl.float32))
        b_v = (b_v - tl.sum(b_h * b_k[:, None], axis=0)) * b_beta
        b_h += b_k[:, None] * b_v[None, :]
        b_o = tl.sum(b_h * b_q[:, None], axis=0)
        tl.store(o + (t * HV + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        if INTER:  # [N, T, HV, K, V] in the pool's layout: the state after this token
            p_i = ((i_n.to(tl.int64) * T + (t - bos)) * HV + i_h) * K * V
            tl.store(inter + p_i + p_tile, b_h.to(inter.dtype.element_ty), mask=m_h)

    if STORE == 1:
        tl.store(state_out + base + p_tile, b_h.to(state_out.dtype.element_ty), mask=m_h)
    if STORE == 2:
        values, s = _fp8_tile(b_h, 448.0)
        tl.store(state_out + base + p_tile, values, mask=m_h)
        tl.store(scales_out + (row * HV + i_h) * NS + i_v, s)


_CHECK_BLOCK = 64  # indices compared per block by the one program that checks them


def _launch(kernel, grid, like: torch.Tensor):
    """``kernel[grid]``: through ``wrap_triton`` while tracing (fake or functional tensors,
    torch.compile, export) so that Inductor sees the kernel, directly otherwise. A direct
    launch skips the wrapper's dispatch, most of an eager decode step's host time."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    tracing = (isinstance(like, (FakeTensor, FunctionalTensor)) or torch.compiler.is_compiling()
               or torch._guards.detect_fake_mode() is not None)
    return wrap_triton(kernel)[grid] if tracing or not launch_directly else kernel[grid]


launch_directly = True  # False: every launch through wrap_triton (tests that record launches)


def _state_kind(state) -> int:
    if state is None:
        return _NONE
    return _FP8 if state.dtype == torch.float8_e4m3fn else _PLAIN


def recurrent_delta_fwd(
    q, k, v, g, beta, *, scale: float, state_in=None, state_out=None, scales=None,
    indices=None, cu_seqlens=None, intermediate=None, state_v_first: bool = False,
    block_v: int | None = None, num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the GDN / KDA token recurrence; returns ``(o, slots_ok)``: ``o`` like ``v``, and
    with ``indices`` a 0-dim bool tensor, False if an index is ``>= S`` or a non-negative
    index repeats (one program compares them all; the caller asserts on it), else None.

    Args:
        q, k: ``[B, T, Hk, K]``; v ``[B, T, Hv, V]``; g ``[B, T, Hv]`` or
            ``[B, T, Hv, K]``; beta ``[B, T, Hv]``; contiguous.
        state_in: the state read at the start: ``[N, Hv, K, V]`` (value-major with
            ``state_v_first``) indexed by sequence, or a pool ``[S, Hv, K, V]``
            indexed by ``indices``; None for zeros.
        state_out: where the final state goes (float32/bfloat16/float8, same layout and
            row indexing as ``state_in``; it may be ``state_in`` itself: a pool updated in
            place). Required.
        scales: ``[S, Hv, ceil(V / 64)]`` float32 scales of a float8 pool (read and
            written in place).
        indices: ``[N]`` int32/int64 slots of a pool (negative: padding row).
        cu_seqlens: ``[N + 1]`` boundaries of packed sequences (``B == 1``).
        intermediate: ``[N, T, Hv, K, V]`` (pool layout) receiving the state after every
            token.
        block_v, num_warps: launch configuration (default :func:`decode_config`).
    """
    b, length, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    float8 = _FP8 in (_state_kind(state_in), _state_kind(state_out))
    tile, warps = decode_config(dv, float8)
    tile, warps = block_v or tile, num_warps or warps
    o = torch.empty_like(v)
    slots = state_out.shape[0] if indices is not None else n
    ok = None if indices is None else torch.empty((), dtype=torch.bool, device=q.device)
    _launch(_recurrent_delta_kernel, (triton.cdiv(dv, tile), n * hv), q)(
        q, k, v, g, beta, o, state_in, scales, state_out, scales, intermediate,
        indices, ok, cu_seqlens, length, n, slots, scale,
        HK=hk, HV=hv, K=dk, V=dv, BK=triton.next_power_of_2(dk), BV=tile,
        NS=triton.cdiv(dv, FP8_BLOCK_V), PER_KEY=g.dim() == 4,
        STATE_V_FIRST=state_v_first, LOAD=_state_kind(state_in), STORE=_state_kind(state_out),
        SLOTS=indices is not None, VARLEN=cu_seqlens is not None,
        INTER=intermediate is not None, CHECK_BLOCK=_CHECK_BLOCK, num_warps=warps,
    )
    return o, ok


@triton.jit
def _recurrent_kdn_kernel(
    q, k, v, log_alpha, omega, r, o, memory, precision, indices, slots_ok,
    T, num_rows, num_slots, scale, info_scale, log_alpha_floor,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CHECK_BLOCK: tl.constexpr,
):
    # One program per (row, head) walks the value tiles in turn: the precision it updates
    # in place is read by every tile, so no other program may own a tile of this head.
    # Inductor passes Python floats as fp64; the interpreter passes them as Python floats
    scale, info_scale = tl.cast(scale, tl.float32), tl.cast(info_scale, tl.float32)
    log_alpha_floor = tl.cast(log_alpha_floor, tl.float32)
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    bos = i_n.to(tl.int64) * T
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    if i_nh == 0:  # one program checks every index (see recurrent_delta_fwd)
        errors = 0
        for r0 in range(0, num_rows, CHECK_BLOCK):
            r_ids = r0 + tl.arange(0, CHECK_BLOCK)
            rows = tl.load(indices + r_ids, mask=r_ids < num_rows, other=-1).to(tl.int64)
            errors += tl.sum((rows >= num_slots).to(tl.int32), axis=0)
            for c0 in range(r0, num_rows, CHECK_BLOCK):
                c_ids = c0 + tl.arange(0, CHECK_BLOCK)
                cols = tl.load(indices + c_ids, mask=c_ids < num_rows, other=-1)
                errors += _repeats(rows, r_ids, cols.to(tl.int64), c_ids, c_ids < num_rows)
        tl.store(slots_ok, errors == 0)
    row = tl.load(indices + i_n).to(tl.int64)
    if (row < 0) | (row >= num_slots):  # padding row
        for t in range(bos, bos + T):
            for v0 in range(0, V, BV):
                o_v = v0 + tl.arange(0, BV)
                tl.store(o + (t * H + i_h) * V + o_v, tl.zeros([BV], tl.float32)
                         .to(o.dtype.element_ty), mask=o_v < V)
        return
    p_p = precision + (row * H + i_h) * K + o_k
    b_p0 = tl.load(p_p, mask=m_k, other=1).to(tl.float32)
    b_p = b_p0
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < V
        m_h = m_k[:, None] & m_v[None, :]
        p_h = memory + (row * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
        b_h = tl.load(p_h, mask=m_h, other=0).to(tl.float32)
        b_p = b_p0
        for t in range(bos, bos + T):
            p_t = (t * H + i_h) * K + o_k
            b_q = tl.load(q + p_t, mask=m_k, other=0).to(tl.float32)
            b_k = tl.load(k + p_t, mask=m_k, other=0).to(tl.float32)
            b_la = tl.load(log_alpha + p_t, mask=m_k, other=0).to(tl.float32)
            b_om = tl.load(omega + p_t, mask=m_k, other=0).to(tl.float32)
            b_r = tl.load(r + t * H + i_h).to(tl.float32)
            b_v = tl.load(v + (t * H + i_h) * V + o_v, mask=m_v, other=0).to(tl.float32)
            k2 = b_k * b_k
            predicted = tl.exp(2.0 * b_la) / b_p + b_om
            gain = predicted * b_k / (b_r + tl.sum(predicted * k2, axis=0))
            b_p = 1.0 / predicted + info_scale * k2 / b_r
            b_h = b_h * tl.exp(tl.maximum(b_la, log_alpha_floor))[:, None]
            innovation = b_v - tl.sum(b_h * b_k[:, None], axis=0)
            b_h += gain[:, None] * innovation[None, :]
            b_o = tl.sum(b_h * b_q[:, None], axis=0) * scale
            tl.store(o + (t * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        tl.store(p_h, b_h.to(memory.dtype.element_ty), mask=m_h)
    tl.store(p_p, b_p, mask=m_k)


def recurrent_kdn_fwd(
    q, k, v, log_alpha, omega, r, memory, precision, indices, *, scale: float,
    info_scale: float, log_alpha_floor: float, block_v: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the Diag-KDN decode step over pools; returns ``(o, slots_ok)`` as
    :func:`recurrent_delta_fwd`.

    ``q, k, log_alpha, omega [B, T, H, K]``, ``v [B, T, H, V]``, ``r [B, T, H]``;
    ``memory [S, H, K, V]`` (float32/bfloat16) and ``precision [S, H, K]`` (float32)
    are updated in place at slots ``indices [B]``.
    """
    b, length, h, dk = q.shape
    dv = v.shape[3]
    tile, warps = decode_config(dv, False)
    tile, warps = block_v or tile, num_warps or warps
    o = torch.empty_like(v)
    ok = torch.empty((), dtype=torch.bool, device=q.device)
    _launch(_recurrent_kdn_kernel, (b * h,), q)(
        q, k, v, log_alpha, omega, r, o, memory, precision, indices, ok,
        length, b, memory.shape[0], scale, info_scale, log_alpha_floor,
        H=h, K=dk, V=dv, BK=triton.next_power_of_2(dk), BV=tile, CHECK_BLOCK=_CHECK_BLOCK,
        num_warps=warps,
    )
    return o, ok
