"""``kdn`` ops of the Diagonal Kalman Delta Network: Kalman gain scan + two-key memory.

Where they launch, the gain runs on ``lowering/kalman_gain*.py`` and the memory
(erase ``k``, write the gain, decay ``log_alpha`` floored at
``LOG_MEMORY_ALPHA_FLOOR``) on the two-key kernels of ``lowering/two_key_*.py``;
the memory's gradients then come from ``kdn::diag_kdn_memory_bwd`` (triton_op).

``kdn::diag_kdn`` returns ``(output, memory, precision)`` followed by the tensors
its backward reads (:data:`SAVED`: the gains, the gain scan's covariances and the
two-key kernels' saved tensors; empty placeholders where a branch has none), kept
by its autograd and not differentiable: nothing of the forward is run again in the
backward. :func:`kdn_compile.diag_kdn` returns the first three.

``kdn::mobius_product_reference`` multiplies a run of the covariance's 2x2 Mobius
maps (:func:`kdn_compile.reference.mobius_product`): context parallelism
(:mod:`kdn_compile.distributed`) sends each rank's product to the others.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import Tensor

from kdn_compile import reference as ref
from kdn_compile._checks import tracing
from kdn_compile.ops._dispatch import TRITON, can_launch, metadata_only, plain
from kdn_compile.ops._registry import (
    FLAT,
    FamilyOps,
    check_backward_arguments,
    empty_grads,
    reference_vjp,
    saved_placeholders,
)
from kdn_compile.ops.kda import SAVED as TWO_KEY_SAVED
from kdn_compile.reference._common import segments, work_dtype

if TRITON:  # else every op takes its reference (see _dispatch.TRITON)
    from kdn_compile.lowering.kalman_gain import (
        kalman_gain_bwd,
        kalman_gain_fwd,
        kalman_gain_kernel_supports,
    )
    from kdn_compile.lowering.two_key_bwd import two_key_bwd
    from kdn_compile.lowering.two_key_common import two_key_kernel_supports
    from kdn_compile.lowering.two_key_fwd import two_key_fwd


def _diag_kdn_signature(
    q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, omega: Tensor, r: Tensor,
    memory: Tensor, precision: Tensor, cu_seqlens: Optional[Tensor],
    scale: float, info_scale: float, chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor]: ...


def _diag_kdn_reference(q, k, v, log_alpha, omega, r, memory, precision, cu_seqlens,
                        scale, info_scale, chunk_size):
    return ref.diag_kdn_reference(
        q, k, v, log_alpha, omega, r, memory, precision, scale=scale,
        info_scale=info_scale, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
    )


def _diag_kdn_fake(q, k, v, log_alpha, omega, r, memory, precision, cu_seqlens, scale,
                   info_scale, chunk_size):
    dtype = work_dtype(q.dtype)
    return (
        v.new_empty(v.shape),
        memory.new_empty(memory.shape, dtype=dtype),
        precision.new_empty(precision.shape, dtype=dtype),
    )


DIAG_KDN = FamilyOps(
    "diag_kdn", _diag_kdn_signature, _diag_kdn_reference, _diag_kdn_fake,
    differentiable=("q", "k", "v", "log_alpha", "omega", "r", "memory", "precision"),
)


def _gain_kernels(q, k, log_alpha, omega, r, precision, cu_seqlens) -> bool:
    """Whether the Kalman gain runs on its Triton kernels (``lowering/kalman_gain*.py``).

    Varlen while tracing stays on the reference: the reference memory math below
    (:func:`_memory`) reads ``cu_seqlens`` on the host.
    """
    return (
        can_launch(q)
        and kalman_gain_kernel_supports(k, log_alpha, omega, r, precision, cu_seqlens)
        and not (cu_seqlens is not None and tracing(q))
    )


def _memory(q, k, v, log_alpha, gain, memory, cu_seqlens, scale, chunk_size):
    """Two-key memory from the gains by the reference math, one run per sequence: the
    path of inputs that the two-key kernels do not cover. Returns ``(output, memory)``.
    """
    dtype = work_dtype(q.dtype)
    work = [x.to(dtype) for x in (q, k, v, log_alpha, gain)]
    memory = memory.to(dtype)
    outputs, memories = [], []
    for rows, times in segments(cu_seqlens, q.shape[0], q.shape[1]):
        o, m = ref.chunked_memory(*(x[:, times] for x in work), memory[rows], scale=scale,
                                  chunk_size=chunk_size)
        outputs.append(o)
        memories.append(m)
    return torch.cat(outputs, dim=1).to(v.dtype), torch.cat(memories, dim=0)


def _memory_kernels(q, v, chunk_size) -> bool:
    """Whether the memory runs on the two-key Triton kernels (same rule as ``chunk_kda``)."""
    return can_launch(q) and two_key_kernel_supports(q, v, chunk_size=chunk_size)


# The outputs of kdn::diag_kdn after (output, memory, precision): what its backward reads,
# the gain scan's then the two-key kernels', each with the dimension of its heads (where
# DTensor shards it; the chunk covariances are a flat per-chunk buffer).
GAIN_SAVED = {"gain": 2, "chunk_cov": FLAT, "final_cov": 1}
SAVED = {**GAIN_SAVED, **TWO_KEY_SAVED}
# The memory's arguments (given the gains): of _memory, and of kdn::diag_kdn_memory_bwd
# before the two-key kernels' saved tensors; and those it returns gradients of, in order.
MEMORY_ARGUMENTS = tuple(inspect.signature(_memory).parameters)
MEMORY_GRADS = ("q", "k", "v", "log_alpha", "gain", "memory")


@torch.library.triton_op("kdn::diag_kdn_memory_bwd", mutates_args=())
def diag_kdn_memory_bwd_op(
    q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, gain: Tensor, memory: Tensor,
    cu_seqlens: Optional[Tensor], scale: float, chunk_size: int,
    c: Tensor, qd: Tensor, kd: Tensor, wl: Tensor, tmat: Tensor, rmat: Tensor, h: Tensor,
    x: Tensor, spans: Tensor, offsets: Tensor,
    grad_output: Tensor, grad_memory: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of the Diag-KDN memory on the two-key kernels, from the forward's
    saved tensors (``c`` .. ``offsets``, as :func:`two_key_fwd` returns them).

    Returns ``(dq, dk, dv, dlog_alpha, dgain, dmemory)``; ``dlog_alpha`` is zero
    where ``log_alpha`` sits below the memory floor (the clamp's gradient).
    """
    if metadata_only(q):
        return empty_grads(q, (q, k, v, log_alpha, gain, memory))
    dq, dk, dgain, dv, dlog_alpha, dmemory = two_key_bwd(
        q, k, gain, v, log_alpha, memory, cu_seqlens,
        c, qd, kd, wl, tmat, rmat, h, x, spans, offsets, grad_output, grad_memory,
        chunk_size=chunk_size, scale=scale, state_v_first=False,
        log_decay_floor=ref.LOG_MEMORY_ALPHA_FLOOR,
    )
    return dq, dk, dv, dlog_alpha, dgain, dmemory.to(memory.dtype)


check_backward_arguments(diag_kdn_memory_bwd_op, MEMORY_ARGUMENTS, TWO_KEY_SAVED, 2)


@torch.library.triton_op("kdn::kalman_gain_bwd", mutates_args=())
def kalman_gain_bwd_op(
    k: Tensor, log_alpha: Tensor, omega: Tensor, r: Tensor, precision: Tensor,
    cu_seqlens: Optional[Tensor], chunk_cov: Tensor, final_cov: Tensor, dgain: Tensor,
    dprecision: Optional[Tensor], dk_add: Tensor, dlog_alpha_add: Tensor, info_scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of the Kalman gains on their kernels (:func:`kalman_gain_bwd`), from the
    forward's saved covariances: ``(dk, dlog_alpha, domega, dr, dprecision)``, with
    ``dk_add`` and ``dlog_alpha_add`` (the memory's) added. An op, so that it dispatches
    on DTensors like the rest of the backward."""
    if metadata_only(k):
        return empty_grads(k, (k, log_alpha, omega, r, precision))
    return kalman_gain_bwd(
        k, log_alpha, omega, r, precision, cu_seqlens, chunk_cov, final_cov, dgain, dprecision,
        info_scale=info_scale, dk_add=dk_add, dlog_alpha_add=dlog_alpha_add)


@torch.library.triton_op("kdn::diag_kdn", mutates_args=())
def diag_kdn_op(
    q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, omega: Tensor, r: Tensor,
    memory: Tensor, precision: Tensor, cu_seqlens: Optional[Tensor],
    scale: float, info_scale: float, chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
           Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Diag-KDN; launches Triton where it can, else the reference op.

    Returns ``(output, memory, precision, *saved)`` (:data:`SAVED`).
    """
    if not _gain_kernels(q, k, log_alpha, omega, r, precision, cu_seqlens):
        found = torch.ops.kdn.diag_kdn_reference(
            q, k, v, log_alpha, omega, r, memory, precision, cu_seqlens, scale, info_scale,
            chunk_size,
        )
        return (*found, *saved_placeholders(q, len(SAVED), q.shape[2]))
    memory_kernels = _memory_kernels(q, v, chunk_size)
    # The memory kernels read the gains as their write key (in float32 products): stored
    # in a half k's dtype, as KDA's w = beta k comes from half inputs, they cost half the
    # traffic there and in the memory's backward (dgain is stored in the gains' dtype):
    # the op's forward+backward 8.54-8.58 ms against 8.77 at 8x4096x16 (H200).
    half = k.dtype in (torch.float16, torch.bfloat16)
    gain, final_precision, chunk_cov, final_cov = kalman_gain_fwd(
        k, log_alpha, omega, r, precision, cu_seqlens, info_scale=info_scale,
        gain_dtype=k.dtype if memory_kernels and half else torch.float32)
    if memory_kernels:
        output, memory, *two_key_saved = two_key_fwd(
            q, k, gain, v, log_alpha, memory, cu_seqlens,
            chunk_size=chunk_size, scale=scale, state_v_first=False,
            log_decay_floor=ref.LOG_MEMORY_ALPHA_FLOOR,
        )
    else:
        output, memory = _memory(q, k, v, log_alpha, gain, memory, cu_seqlens, scale,
                                 chunk_size)
        two_key_saved = saved_placeholders(q, len(TWO_KEY_SAVED), q.shape[2])
    return (output, memory, final_precision, gain, chunk_cov, final_cov, *two_key_saved)


def _backward_path(x: dict) -> str:
    """How the backward of ``kdn::diag_kdn`` on the inputs ``x`` runs, by the branches that
    its forward takes on them: ``"kernels"``, the gain and memory kernels reversed from the
    saved tensors; ``"gain kernels"``, the gain kernels reversed and the memory through the
    VJP of its reference math (:func:`_memory`); ``"reference"``, the reference's VJP (also
    for a DTensor whose memory has no kernels: its reference math would run op by op)."""
    if not _gain_kernels(x["q"], x["k"], x["log_alpha"], x["omega"], x["r"], x["precision"],
                         x["cu_seqlens"]):
        return "reference"
    if _memory_kernels(x["q"], x["v"], x["chunk_size"]):
        return "kernels"
    return "gain kernels" if plain(x["q"]) else "reference"


def _diag_kdn_backward(inputs, grads, saved, path):
    """The gain kernels reversed and the memory's backward, from the forward's saved
    tensors, along the forward's :func:`_backward_path`."""
    if path == "reference":
        return DIAG_KDN.reference_backward(inputs, grads)
    q, k, v, log_alpha, omega, r, memory, precision, cu_seqlens = (
        inputs[n] for n in ("q", "k", "v", "log_alpha", "omega", "r", "memory", "precision",
                            "cu_seqlens"))
    doutput, dmemory, dprecision = grads
    memory_inputs = {n: saved["gain"] if n == "gain" else inputs[n] for n in MEMORY_ARGUMENTS}
    if path == "kernels":
        found = diag_kdn_memory_bwd_op(
            *memory_inputs.values(), *(saved[n] for n in TWO_KEY_SAVED), doutput, dmemory)
    else:  # from leaves in the working dtype: the gain kernel adds dk, dlog_alpha from it
        dtype = work_dtype(q.dtype)
        leaves = {n: x.to(dtype) if n in MEMORY_GRADS else x for n, x in memory_inputs.items()}
        found = reference_vjp(_memory, leaves, MEMORY_GRADS, [doutput, dmemory])
    dq, dk, dv, dlog_alpha, dgain, dmemory0 = found
    # the gain kernel adds the memory's dk, dlog_alpha as it stores its own (in the
    # dtypes of k, log_alpha)
    dk, dlog_alpha, domega, dr, dprecision0 = kalman_gain_bwd_op(
        k, log_alpha, omega, r, precision, cu_seqlens, saved["chunk_cov"], saved["final_cov"],
        dgain, dprecision, dk, dlog_alpha, inputs["info_scale"])
    return {
        "q": dq.to(q.dtype), "k": dk, "v": dv.to(v.dtype), "log_alpha": dlog_alpha,
        "omega": domega, "r": dr, "memory": dmemory0.to(memory.dtype), "precision": dprecision0,
    }


DIAG_KDN.attach_autograd(diag_kdn_op, _diag_kdn_backward, saved=SAVED, path=_backward_path)


def _mobius_product_signature(maps: Tensor) -> Tensor: ...


def _mobius_product_fake(maps):
    return maps.new_empty(maps.shape[:1] + maps.shape[2:])


MOBIUS_PRODUCT = FamilyOps(
    "mobius_product", _mobius_product_signature, ref.mobius_product, _mobius_product_fake,
    differentiable=("maps",),
)
