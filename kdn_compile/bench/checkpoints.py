"""Prefill with prefix-cache checkpoints: what keeping the states costs a prompt step.

A shape ``BxTxH`` is prompts x prompt length x heads, ``K = V = 128``, bf16 q/k/v, float32
gates (the inputs of the ``gdn`` and ``kda`` families). Each case times
:func:`kdn_compile.chunk_checkpoints` writing the state after every
``EVERY`` tokens of each prompt into a float32 pool (``ours``) against the same call
keeping none (``no checkpoints``: a ``[B, 0]`` index tensor), under ``torch.no_grad``
and replayed from a CUDA graph as a serving engine runs a prompt step (the host's time
out: eagerly, the argument checks and index bookkeeping of a call take longer than the
kernels at these shapes), so the ratio is the checkpoints' GPU cost.
"""

from __future__ import annotations

import torch

from kdn_compile.bench._delta import HEAD_DIM, make_inputs
from kdn_compile.bench.timing import Shape, graphed, median_ms, relative_error, require_close
from kdn_compile.checkpoints import chunk_checkpoints
from kdn_compile.reference.checkpoints import chunk_checkpoints_reference

TITLE = ("Prefill with prefix-cache checkpoints: B x T x H = prompts x prompt length x heads, "
         "K = V = 128, bf16, float32 pool, a checkpoint every 256 tokens")
DEFAULT_SHAPES = (Shape(8, 4096, 16), Shape(1, 32768, 16))
EVERY = 256
TOLERANCE = 2e-2  # bf16 inputs against float64 (as the gdn and kda families)


def _call(x, pool, indices):
    q, k, v, g, beta, h0 = x
    return lambda: chunk_checkpoints(q, k, v, g, beta, pool, indices, checkpoint_every=EVERY,
                                     initial_state=h0)


def _pool_and_indices(shape: Shape, count: int):
    pool = torch.zeros(shape.batch * count, shape.heads, HEAD_DIM, HEAD_DIM, device="cuda")
    indices = torch.randperm(pool.shape[0], device="cuda").view(shape.batch, count)
    return pool, indices


def check(fla: bool) -> dict[str, float]:
    """The outputs, final states and kept checkpoints of a 512-token prompt pair (two
    checkpoints each) against the float64 reference; FLA has no counterpart."""
    del fla
    errors = {}
    shape = Shape(2, 512, 2)
    for per_key in (False, True):
        name = "kda" if per_key else "gdn"
        x = make_inputs(shape, 0, per_key=per_key)
        pool, indices = _pool_and_indices(shape, 2)
        with torch.no_grad():
            o, final = _call(x, pool, indices)()
        exact = [t.double() for t in x]
        o64, final64, states64 = chunk_checkpoints_reference(
            *exact[:5], checkpoint_every=EVERY, checkpoints=2, initial_state=exact[5])
        errors[f"{name} o"] = relative_error(o, o64)
        errors[f"{name} final state"] = relative_error(final, final64)
        errors[f"{name} checkpoints"] = relative_error(pool[indices], states64)
    return require_close(errors, TOLERANCE, "checkpoints")


def measure(shape: Shape, fla: bool) -> list[dict]:
    """Rows for ``shape``; none for prompts shorter than ``EVERY`` tokens (no checkpoint)."""
    del fla
    rows = []
    count = shape.length // EVERY
    for per_key in (False, True) if count else ():
        case = f"{'KDA' if per_key else 'GDN'}, {count} checkpoints per prompt"
        x = make_inputs(shape, 1, per_key=per_key)
        pool, indices = _pool_and_indices(shape, count)
        with torch.no_grad():
            for impl, idx in (("ours", indices), ("no checkpoints", indices[:, :0])):
                row = {"case": case, "impl": impl, "ms": median_ms(graphed(_call(x, pool, idx)))}
                if impl == "ours":
                    row["versus"] = "no checkpoints"
                rows.append(row)
    return rows
