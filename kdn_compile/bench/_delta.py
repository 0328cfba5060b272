"""What the GDN and KDA families share: FLA's calling convention, inputs, check, timing.

Ours and FLA's take ``(q, k, v, g, beta, initial_state, scale)`` here in the same
token-major layout (FLA >= 0.6.0: ``fn(q, k, v, g, beta, scale=, initial_state=,
output_final_state=True)``) and return ``(o, final_state)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kdn_compile.bench.timing import (
    Shape, fwd_bwd, relative_error, require_close, time_forward_backward,
)

HEAD_DIM = 128
DTYPE = torch.bfloat16
CHECK_SHAPE = Shape(2, 200, 2)  # an odd length: a partial last chunk
TOLERANCE = 2e-2  # bf16 inputs against the float64 reference (measured about 5e-3)
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def make_inputs(shape: Shape, seed: int, *, per_key: bool) -> tuple[torch.Tensor, ...]:
    """``q, k [B, T, H, K]`` (unit rows), ``v [B, T, H, V]``, ``beta [B, T, H]`` in bf16;
    float32 gates ``g [B, T, H]`` (``[B, T, H, K]`` with ``per_key``) in ``[-1.25, 0]``
    and initial state ``[B, H, K, V]``; ``K = V = 128``, on CUDA."""
    B, T, H = shape
    gen = torch.Generator("cuda").manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, device="cuda", generator=gen)

    q = F.normalize(randn(B, T, H, HEAD_DIM), dim=-1).to(DTYPE)
    k = F.normalize(randn(B, T, H, HEAD_DIM), dim=-1).to(DTYPE)
    v = randn(B, T, H, HEAD_DIM).to(DTYPE)
    g = F.logsigmoid(randn(B, T, H, *((HEAD_DIM,) if per_key else ()))).clamp_min(-5.0) / 4
    beta = torch.rand(B, T, H, device="cuda", generator=gen).to(DTYPE)
    h0 = randn(B, H, HEAD_DIM, HEAD_DIM)
    return q, k, v, g, beta, h0


def fla_call(fn: Callable) -> Callable:
    """FLA's ``fn`` in our argument order."""
    def run(q, k, v, g, beta, h0, scale):
        return fn(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True)
    return run


def check(ours: Callable, fla: Callable | None, reference: Callable, *, per_key: bool,
          where: str, state_tolerance: float = TOLERANCE) -> dict[str, float]:
    """Output, final state and input gradients of ``ours`` (and the output and final state
    of ``fla``) against ``reference`` in float64 at ``CHECK_SHAPE``: each within
    ``TOLERANCE``, the final states within ``state_tolerance``."""
    inputs = make_inputs(CHECK_SHAPE, 0, per_key=per_key)
    scale = HEAD_DIM ** -0.5
    grad = torch.randn_like(inputs[2], dtype=torch.float32)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    o, state = ours(*leaves, scale)
    torch.autograd.backward([o], [grad.to(o.dtype)])
    exact = [t.detach().double().requires_grad_() for t in inputs]
    o_ref, state_ref = reference(*exact[:5], scale=scale, initial_state=exact[5])
    torch.autograd.backward([o_ref], [grad.double()])
    errors = {"o": relative_error(o, o_ref), "final state": relative_error(state, state_ref)}
    errors.update({f"d{n}": relative_error(a.grad, b.grad)
                   for n, a, b in zip(NAMES, leaves, exact)})
    if fla is not None:
        o_fla, state_fla = fla(*inputs, scale)
        errors["o (FLA)"] = relative_error(o_fla, o_ref)
        errors["final state (FLA)"] = relative_error(state_fla, state_ref)
    states = {n: e for n, e in errors.items() if n.startswith("final state")}
    require_close(states, state_tolerance, where)
    require_close({n: e for n, e in errors.items() if n not in states}, TOLERANCE, where)
    return errors


def steps(shape: Shape, impls: dict[str, Callable], *, per_key: bool) -> dict[str, Callable]:
    """A forward+backward step of each ``impls`` entry at ``shape``, as :func:`measure`
    times it (for ``--profile``)."""
    scale = HEAD_DIM ** -0.5
    inputs = make_inputs(shape, 0, per_key=per_key)
    grad = torch.randn_like(inputs[2])
    return {impl: fwd_bwd(lambda *x, fn=fn: fn(*x, scale), inputs, grad)
            for impl, fn in impls.items()}


def measure(shape: Shape, impls: dict[str, Callable], *, per_key: bool,
            on_row: Callable[[dict], object] | None = None) -> list[dict]:
    """Forward and forward+backward (with peak memory) of each ``impls`` entry at ``shape``;
    ``on_row(row)`` as each row is measured."""
    scale = HEAD_DIM ** -0.5
    return time_forward_backward(
        lambda seed: make_inputs(shape, seed, per_key=per_key),
        {impl: (lambda *x, fn=fn: fn(*x, scale)) for impl, fn in impls.items()}, on_row=on_row)
