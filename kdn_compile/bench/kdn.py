"""Diag-KDN: ``kdn_compile.diag_kdn`` (Kalman gains, then the two-key memory), with our
``chunk_kda`` on the same ``q, k, v`` and gates as the yardstick (FLA has no Diag-KDN).

Forward, and forward+backward of a random output gradient through autograd, at
K = V = 128 in bf16 with float32 gates, noises, memory and precision.
"""

from __future__ import annotations

import torch

from kdn_compile.api import chunk_kda, diag_kdn
from kdn_compile.bench import _delta
from kdn_compile.bench.timing import (
    Shape, fwd_bwd, relative_error, require_close, time_forward_backward,
)
from kdn_compile.reference import diag_kdn_reference

TITLE = "Diag-KDN: diag_kdn, with our chunk_kda as the yardstick, K = V = 128, bf16"
DEFAULT_SHAPES = (Shape(1, 4096, 16), Shape(1, 16384, 16), Shape(1, 32768, 16), Shape(4, 4096, 16),
                  Shape(8, 4096, 16))  # plots: T at B = 1, B at T = 4096
INFO_SCALE = 1.0
NAMES = ("q", "k", "v", "log_alpha", "omega", "r", "memory", "precision")


def make_inputs(shape: Shape, seed: int) -> tuple[torch.Tensor, ...]:
    """``(q, k, v, log_alpha, omega, r, memory, precision)``: KDA's inputs with the gate
    as ``log_alpha``, ``omega [B, T, H, K]`` in ``[0, 0.1)``, ``r [B, T, H]`` in
    ``[0.5, 1.5)``, ``precision [B, H, K]`` in ``[1, 2)``."""
    q, k, v, g, _, h0 = _delta.make_inputs(shape, seed, per_key=True)
    gen = torch.Generator("cuda").manual_seed(seed + 1)
    B, T, H, K = k.shape
    omega = 0.1 * torch.rand(B, T, H, K, device="cuda", generator=gen)
    r = 0.5 + torch.rand(B, T, H, device="cuda", generator=gen)
    precision = 1.0 + torch.rand(B, H, K, device="cuda", generator=gen)
    return q, k, v, g, omega, r, h0, precision


def ours(*inputs):
    return diag_kdn(*inputs, scale=_delta.HEAD_DIM ** -0.5, info_scale=INFO_SCALE)


def kda(q, k, v, log_alpha, omega, r, memory, precision):
    beta = torch.ones_like(r, dtype=q.dtype)
    return chunk_kda(q, k, v, log_alpha, beta, scale=_delta.HEAD_DIM ** -0.5,
                     initial_state=memory)


def check(against_fla: bool) -> dict[str, float]:
    inputs = make_inputs(_delta.CHECK_SHAPE, 0)
    grad = torch.randn_like(inputs[2], dtype=torch.float32)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    o, memory, precision = ours(*leaves)
    torch.autograd.backward([o], [grad.to(o.dtype)])
    exact = [t.detach().double().requires_grad_() for t in inputs]
    o_ref, memory_ref, precision_ref = diag_kdn_reference(
        *exact, scale=_delta.HEAD_DIM ** -0.5, info_scale=INFO_SCALE)
    torch.autograd.backward([o_ref], [grad.double()])
    errors = {"o": relative_error(o, o_ref), "memory": relative_error(memory, memory_ref),
              "precision": relative_error(precision, precision_ref)}
    errors.update({f"d{n}": relative_error(a.grad, b.grad)
                   for n, a, b in zip(NAMES, leaves, exact)})
    return require_close(errors, _delta.TOLERANCE, "kdn")


def measure(shape: Shape, against_fla: bool, on_row=None) -> list[dict]:
    """Forward and forward+backward rows at ``shape``; ``on_row(row)`` as each is measured."""
    return time_forward_backward(lambda seed: make_inputs(shape, seed),
                                 {"ours": ours, "chunk_kda": kda}, on_row=on_row)


def profile_steps(shape: Shape, against_fla: bool) -> dict:
    inputs = make_inputs(shape, 0)
    grad = torch.randn_like(inputs[2])
    return {"ours": fwd_bwd(ours, inputs, grad), "chunk_kda": fwd_bwd(kda, inputs, grad)}
