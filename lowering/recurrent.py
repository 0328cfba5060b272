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
* :func:`recurrent_kdn_fwd`: Diag-KDN over a memory pool (float32 or bfloat16) and a
  float32 precision pool: the Kalman gains of the step's tokens and the new precision
  (covariance with the raw ``alpha``; one small program per row and head), then the same
  delta-rule kernel with the gain as its write key and ``log alpha`` floored for the memory.

A negative slot marks a padding row: its output is zeros and nothing else is read or
written. One program of each decode launch also checks every index (none ``>= S``, no
non-negative one repeated) with a device assert (no host sync, no second launch; where no
device assert is compiled in, also into a flag that the op asserts on); a slot ``>= S`` is
skipped like a padding row, so no launch touches memory past the pool. Float8 pools are
read and written by the tile helpers of :mod:`.fp8`, so a kernel's pool equals
:func:`kdn_compile.reference.fp8.quantize_state_fp8` bit for bit on the same float32
state. Launchers size grids from shapes alone and never synchronize: every call can be
captured in a CUDA graph.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from kdn_compile._checks import SLOT_ERROR, num_sequences, tracing

from ._direct import DirectKernel
from .fp8 import dequantize_tile, quantize_tile, soft_cast

__all__ = [
    "FP8_BLOCK_V", "decode_config", "recurrent_delta_fwd", "recurrent_kernel_supports",
    "recurrent_kdn_fwd",
]

FP8_BLOCK_V = 64  # value columns per float8 scale: one program owns one scale tile
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


def decode_config(rows: int | None, heads: int, value_dim: int, state_dtype: torch.dtype
                  ) -> tuple[int, int]:
    """``(BV, num_warps)``: value columns per program and warps, from shapes only.

    ``rows`` None: a step over a pool, whose launch never depends on the batch, so that a
    row's outputs and slot are bit for bit the same whatever else is batched beside it
    (the tile shape decides the order of the sums over the keys): float32 and bfloat16
    pools 32 columns on one warp, float8 pools 64 (one program per scale tile) on 4.
    Measured on an H100 in CUDA-graph replays at ``K = V = 128``, 32 heads, against the
    batch-dependent launches below: float32 batch 256 386 us against 373, batch 1 10.5
    against 10.5, batch 64 x 4 tokens 146 against 158.

    Otherwise (the token recurrence over whole sequences) the launches that were the
    fastest pool steps on the H200 at batch 64 and 256: float32 64 columns on 2 warps
    (279 us at batch 256, against 299 for 32 on 4); bfloat16 32 on 2 (190 against 209 for
    64 on 2); float8 64 on 4 warps (228 against 304 on 2); few ``rows * heads``: 8-column
    tiles on one warp, the most programs.
    """
    if state_dtype == torch.float8_e4m3fn:
        tile, warps = FP8_BLOCK_V, 4
    elif rows is None:
        tile, warps = 32, 1
    elif rows * heads < 512:
        tile, warps = 8, 1
    elif state_dtype == torch.float32:
        tile, warps = 64, 2
    else:
        tile, warps = 32, 2
    return min(tile, triton.next_power_of_2(value_dim)), warps


@triton.jit
def _repeats(rows, r_ids, cols, c_ids, c_mask):
    """``[CB, CB]`` int32: 1 where a non-negative entry of ``rows`` reappears later (higher
    id) among ``cols``."""
    repeated = (rows[:, None] == cols[None, :]) & (rows[:, None] >= 0)
    return (repeated & (r_ids[:, None] < c_ids[None, :]) & c_mask[None, :]).to(tl.int32)


@triton.jit
def _product(a, b, INTERPRETED: tl.constexpr):
    """``a * b`` (float32, same shape) rounded on its own: ``mul.rn`` in PTX, which neither
    the compiler nor ptxas fuses into the additions of a sum. Left to contraction, which
    multiply-adds become fused depends on what else a specialization of the kernel computes
    (the state stored or not, the intermediate states or not), and its outputs with them."""
    if INTERPRETED:
        return a * b
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b],
                                     dtype=tl.float32, is_pure=True, pack=1)


_SLOT_MESSAGE = tl.constexpr(SLOT_ERROR)


# debug: the index check's device assert compiled into every launch (Inductor compiles its
# kernels so too)
@triton.jit(debug=True)
def _recurrent_delta_kernel(
    q, k, v, g, beta, w, o, state_in, scales_in, state_out, scales_out, inter,
    indices, slots_ok, cu_seqlens, T, num_rows, num_slots, scale, gate_floor,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NS: tl.constexpr,
    PER_KEY: tl.constexpr, STATE_V_FIRST: tl.constexpr, LOAD: tl.constexpr,
    STORE: tl.constexpr, SLOTS: tl.constexpr, VARLEN: tl.constexpr, INTER: tl.constexpr,
    CHECK_BLOCK: tl.constexpr, FLAG: tl.constexpr, INTERPRETED: tl.constexpr,
    WRITE_KEY: tl.constexpr, FLOOR: tl.constexpr,
):
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    gate_floor = tl.cast(gate_floor, tl.float32)
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
        if i_nh + i_v == 0:  # one program checks every index
            errors = tl.zeros([CHECK_BLOCK, CHECK_BLOCK], dtype=tl.int32)
            for r0 in range(0, num_rows, CHECK_BLOCK):
                r_ids = r0 + tl.arange(0, CHECK_BLOCK)
                rows = tl.load(indices + r_ids, mask=r_ids < num_rows, other=-1).to(tl.int64)
                errors += (rows >= num_slots).to(tl.int32)[:, None]
                for c0 in range(r0, num_rows, CHECK_BLOCK):
                    c_ids = c0 + tl.arange(0, CHECK_BLOCK)
                    cols = tl.load(indices + c_ids, mask=c_ids < num_rows, other=-1)
                    errors += _repeats(rows, r_ids, cols.to(tl.int64), c_ids, c_ids < num_rows)
            bad = tl.sum(tl.sum(errors, axis=1), axis=0)
            # in the launch itself: no second kernel (2-3 us of a batch-1 step); a flag for
            # the op to assert on where no device assert is compiled in (see _slot_flag)
            tl.device_assert(bad == 0, _SLOT_MESSAGE)
            if FLAG:
                tl.store(slots_ok, bad == 0)
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
        b_h = tl.load(state_in + base + p_tile, mask=m_h)
        b_h = tl.where(m_h, dequantize_tile(b_h, tl.load(scales_in + (row * HV + i_h) * NS + i_v)),
                       0.0)

    for t in range(bos, eos):
        b_q = tl.load(q + (t * HK + i_hk) * K + o_k, mask=m_k, other=0).to(tl.float32) * scale
        b_k = tl.load(k + (t * HK + i_hk) * K + o_k, mask=m_k, other=0).to(tl.float32)
        b_v = tl.load(v + (t * HV + i_h) * V + o_v, mask=m_v, other=0).to(tl.float32)
        if PER_KEY:
            b_g = tl.load(g + (t * HV + i_h) * K + o_k, mask=m_k, other=0).to(tl.float32)
            if FLOOR:
                b_g = tl.maximum(b_g, gate_floor)
            b_h = b_h * tl.exp(b_g)[:, None]
        else:
            b_h = b_h * tl.exp(tl.load(g + t * HV + i_h).to(tl.float32))
        # every product rounded once, every update one explicit fused multiply-add: the
        # same arithmetic in every specialization (see _product)
        b_kk = tl.broadcast_to(b_k[:, None], (BK, BV))
        b_v = b_v - tl.sum(_product(b_h, b_kk, INTERPRETED), axis=0)
        if WRITE_KEY:  # S += w (v - k^T S): the write key as given (Diag-KDN's gain)
            b_w = tl.load(w + (t * HV + i_h) * K + o_k, mask=m_k, other=0).to(tl.float32)
            b_h = tl.fma(tl.broadcast_to(b_w[:, None], (BK, BV)),
                         tl.broadcast_to(b_v[None, :], (BK, BV)), b_h)
        else:  # S += beta k (v - k^T S)
            b_u = b_v * tl.load(beta + t * HV + i_h).to(tl.float32)
            b_h = tl.fma(b_kk, tl.broadcast_to(b_u[None, :], (BK, BV)), b_h)
        b_qq = tl.broadcast_to(b_q[:, None], (BK, BV))
        b_o = tl.sum(_product(b_h, b_qq, INTERPRETED), axis=0)
        tl.store(o + (t * HV + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        if INTER:  # [N, T, HV, K, V] in the pool's layout: the state after this token
            p_i = ((i_n.to(tl.int64) * T + (t - bos)) * HV + i_h) * K * V
            tl.store(inter + p_i + p_tile, b_h.to(inter.dtype.element_ty), mask=m_h)

    if STORE == 1:
        tl.store(state_out + base + p_tile, b_h.to(state_out.dtype.element_ty), mask=m_h)
    if STORE == 2:
        values, s = quantize_tile(b_h, INTERPRETED)
        tl.store(state_out + base + p_tile, values, mask=m_h)
        tl.store(scales_out + (row * HV + i_h) * NS + i_v, s)


_CHECK_BLOCK = 16  # indices per block of the one program that compares them all


def _launch(kernel, grid, like: torch.Tensor):
    """``kernel[grid]``: through ``wrap_triton`` while tracing (fake or functional tensors,
    torch.compile, export) so that Inductor sees the kernel; eager CUDA launches through
    :class:`~._direct.DirectKernel`, which skips the wrapper's dispatch and Triton's
    per-call binding, most of an eager decode step's host time. Direct launches compile
    as Inductor does: without Triton's int32 overflow checks, which its debug mode (the
    index check's device assert) would add (ptxas sm_90: 254 registers against 242 at
    the 32-column pool tile)."""
    if tracing(like):
        return wrap_triton(kernel)[grid]
    if like.device.type != "cuda":  # Triton's interpreter
        return functools.partial(kernel[grid], sanitize_overflow=False)
    return functools.partial(_direct(kernel)[grid], sanitize_overflow=False)


_direct = functools.cache(DirectKernel)  # one per kernel launched eagerly


def _slot_flag(q: torch.Tensor) -> bool:
    """Whether the decode kernel also writes its index check into a flag for the op to
    assert on: where its device assert is not compiled in, in Triton's interpreter and
    under an Inductor that compiles no device asserts (``assert_indirect_indexing`` off,
    or ROCm)."""
    if soft_cast():
        return True
    if not tracing(q):
        return False  # a direct launch: @triton.jit(debug=True)
    from torch._inductor import config

    return not config.assert_indirect_indexing or torch.version.hip is not None


def _state_kind(state) -> int:
    if state is None:
        return _NONE
    return _FP8 if state.dtype == torch.float8_e4m3fn else _PLAIN


def recurrent_delta_fwd(
    q, k, v, g, beta, *, scale: float, state_in=None, state_out=None, scales=None,
    indices=None, cu_seqlens=None, intermediate=None, state_v_first: bool = False,
    write_key=None, gate_floor: float | None = None,
    block_v: int | None = None, num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the GDN / KDA token recurrence; returns ``(o, slots_ok)``: ``o`` like ``v``.
    With ``indices`` one program compares them all: on the GPU a device assert fails the
    launch if an index is ``>= S`` or a non-negative index repeats (``slots_ok`` None);
    where no device assert is compiled in (:func:`_slot_flag`) ``slots_ok`` is a 0-dim
    bool tensor, False then, that the caller asserts on. Else None.

    Args:
        q, k: ``[B, T, Hk, K]``; v ``[B, T, Hv, V]``; g ``[B, T, Hv]`` or
            ``[B, T, Hv, K]``; beta ``[B, T, Hv]``; contiguous.
        state_in: the state read at the start: ``[N, Hv, K, V]`` (value-major with
            ``state_v_first``) indexed by sequence, or a pool ``[S, Hv, K, V]``
            indexed by ``indices``; None for zeros.
        state_out: where the final state goes (float32/bfloat16/float8, same layout and
            row indexing as ``state_in``; it may be ``state_in`` itself: a pool updated in
            place), or None (with ``state_in``: the final state is not kept, as in a
            speculative-decoding verification whose states go to ``intermediate``).
        scales: ``[S, Hv, ceil(V / 64)]`` float32 scales of a float8 pool (read and
            written in place).
        indices: ``[N]`` int32/int64 slots of a pool (negative: padding row).
        cu_seqlens: ``[N + 1]`` boundaries of packed sequences (``B == 1``).
        intermediate: ``[N, T, Hv, K, V]`` (pool layout) receiving the state after every
            token.
        write_key: ``[B, T, Hv, K]`` float32 write key ``w`` in place of ``beta k``
            (``S += w (v - k^T S)``; ``beta`` unused): Diag-KDN's Kalman gain.
        gate_floor: per-key gates floored at this log decay (Diag-KDN's memory).
        block_v, num_warps: launch configuration (default :func:`decode_config`).
    """
    b, length, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    n = num_sequences(b, cu_seqlens)
    kept = state_in if state_out is None else state_out
    dtype = kept.dtype if _state_kind(state_in) != _FP8 else state_in.dtype
    tile, warps = decode_config(None if indices is not None else n, hv, dv, dtype)
    tile, warps = block_v or tile, num_warps or warps
    o = torch.empty_like(v)
    slots = kept.shape[0] if indices is not None else n
    ok = None
    if indices is not None and _slot_flag(q):  # written by the first program; an empty
        # batch launches none
        ok = (torch.empty if n > 0 else torch.ones)((), dtype=torch.bool, device=q.device)
    _launch(_recurrent_delta_kernel, (triton.cdiv(dv, tile), n * hv), q)(
        q, k, v, g, beta, write_key, o, state_in, scales, state_out, scales, intermediate,
        indices, ok, cu_seqlens, length, n, slots, scale,
        0.0 if gate_floor is None else gate_floor,
        HK=hk, HV=hv, K=dk, V=dv, BK=triton.next_power_of_2(dk), BV=tile,
        NS=triton.cdiv(dv, FP8_BLOCK_V), PER_KEY=g.dim() == 4,
        STATE_V_FIRST=state_v_first, LOAD=_state_kind(state_in), STORE=_state_kind(state_out),
        SLOTS=indices is not None, VARLEN=cu_seqlens is not None,
        INTER=intermediate is not None, CHECK_BLOCK=_CHECK_BLOCK, FLAG=ok is not None,
        INTERPRETED=soft_cast(), WRITE_KEY=write_key is not None,
        FLOOR=gate_floor is not None, num_warps=warps,
    )
    return o, ok


@triton.jit
def _decode_gain_kernel(
    k, log_alpha, omega, r, gain, precision, inter, indices, T, num_slots, info_scale,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, INTER: tl.constexpr,
    UPDATE: tl.constexpr,
):
    """Diag-KDN's Kalman gains of one decode step, one program per (row, head): ``gain
    [B, T, H, K]``, with ``INTER`` the precision after every token into ``inter [B, T, H,
    K]``, and with ``UPDATE`` the last one written back to its slot (no other program
    reads it). Slots past the pool are skipped; the update that follows checks the
    indices."""
    info_scale = tl.cast(info_scale, tl.float32)  # fp64 from Inductor
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    row = tl.load(indices + i_n).to(tl.int64)
    if (row >= 0) & (row < num_slots):  # padding rows: nothing (the update skips them too)
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        p_p = precision + (row * H + i_h) * K + o_k
        b_p = tl.load(p_p, mask=m_k, other=1).to(tl.float32)
        for t in range(i_n.to(tl.int64) * T, (i_n.to(tl.int64) + 1) * T):
            p_t = (t * H + i_h) * K + o_k
            b_k = tl.load(k + p_t, mask=m_k, other=0).to(tl.float32)
            b_la = tl.load(log_alpha + p_t, mask=m_k, other=0).to(tl.float32)
            b_om = tl.load(omega + p_t, mask=m_k, other=0).to(tl.float32)
            b_r = tl.load(r + t * H + i_h).to(tl.float32)
            k2 = b_k * b_k
            predicted = tl.exp(2.0 * b_la) / b_p + b_om
            tl.store(gain + p_t, predicted * b_k / (b_r + tl.sum(predicted * k2, axis=0)),
                     mask=m_k)
            b_p = 1.0 / predicted + info_scale * k2 / b_r
            if INTER:
                tl.store(inter + p_t, b_p, mask=m_k)
        if UPDATE:
            tl.store(p_p, b_p, mask=m_k)


def recurrent_kdn_fwd(
    q, k, v, log_alpha, omega, r, memory, precision, indices, *, scale: float,
    info_scale: float, log_alpha_floor: float, intermediate_memory=None,
    intermediate_precision=None, update_state: bool = True, block_v: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the Diag-KDN decode step over pools; returns ``(o, slots_ok)`` as
    :func:`recurrent_delta_fwd`.

    ``q, k, log_alpha, omega [B, T, H, K]``, ``v [B, T, H, V]``, ``r [B, T, H]``;
    ``memory [S, H, K, V]`` (float32/bfloat16) and ``precision [S, H, K]`` (float32)
    are updated in place at slots ``indices [B]`` (``update_state``; else only read).
    ``intermediate_memory [B, T, H, K, V]`` and ``intermediate_precision [B, T, H, K]``
    (float32), when given, receive the state after every token. Two launches: the Kalman
    gains and the precision (one program per row and head, :func:`_decode_gain_kernel`),
    then the memory through the delta-rule kernel with the gain as its write key and
    ``log alpha`` floored.
    """
    b, length, h, dk = q.shape
    gain = torch.empty(k.shape, dtype=torch.float32, device=k.device)
    _launch(_decode_gain_kernel, (b * h,), q)(
        k, log_alpha, omega, r, gain, precision, intermediate_precision, indices, length,
        memory.shape[0], info_scale,
        H=h, K=dk, BK=triton.next_power_of_2(dk), INTER=intermediate_precision is not None,
        UPDATE=update_state, num_warps=4,
    )
    return recurrent_delta_fwd(
        q, k, v, log_alpha, None, scale=scale, state_in=memory,
        state_out=memory if update_state else None, indices=indices,
        intermediate=intermediate_memory, write_key=gain, gate_floor=log_alpha_floor,
        block_v=block_v, num_warps=num_warps,
    )
