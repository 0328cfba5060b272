"""Whole token-mixing layers: ``kdn_compile.layers`` under ``torch.compile(fullgraph=True)``
(and eager) against ``fla.layers`` eager.

Forward+backward of a random output gradient for a ``[B, T, H * 128]`` bf16 input, with
``H`` heads of 128 (the shape's ``H``). Cases ``gdn``, ``kda`` and ``kdn`` (FLA has no
Diag-KDN layer). FLA's layers are timed eager: under ``torch.compile`` they break graphs.
"""

from __future__ import annotations

import torch

from kdn_compile._backend import use_backend
from kdn_compile.bench.timing import Shape, median_ms, peak_mib, relative_error, require_close

TITLE = "Layers: ours compiled (fullgraph) and eager vs FLA eager, heads of 128, bf16, fwd+bwd"
DEFAULT_SHAPES = (Shape(1, 4096, 16), Shape(4, 4096, 16))
HEAD_DIM = 128
CHECK_SHAPE = Shape(2, 200, 2)
TOLERANCE = 3e-2  # a bf16 layer against itself in float64 (measured about 1e-2)


def our_layer(name: str, heads: int) -> torch.nn.Module:
    from kdn_compile import layers

    cls = {"gdn": layers.GatedDeltaNet, "kda": layers.KimiDeltaAttention,
           "kdn": layers.DiagKDN}[name]
    torch.manual_seed(0)
    return cls(heads * HEAD_DIM, heads, HEAD_DIM).cuda()


def fla_layer(name: str, heads: int) -> torch.nn.Module | None:
    """FLA's layer of the same anatomy, or None where FLA has none (``kdn``).

    fla-core 0.6.0 refuses its GDN backward on Hopper with Triton < 3.7.1 (a miscompiled
    gated kernel); the refusal is lifted so that it can be timed.
    """
    import fla.ops.common.chunk_o as chunk_o
    from fla.layers import GatedDeltaNet, KimiDeltaAttention

    chunk_o.TRITON_ABOVE_3_7_1 = True
    cls = {"gdn": GatedDeltaNet, "kda": KimiDeltaAttention}.get(name)
    if cls is None:
        return None
    return cls(hidden_size=heads * HEAD_DIM, expand_v=1, head_dim=HEAD_DIM,
               num_heads=heads).cuda().to(torch.bfloat16)


def check(against_fla: bool) -> dict[str, float]:
    """Each of our layers with kernels in bf16 against itself on the references in float64."""
    B, T, H = CHECK_SHAPE
    errors = {}
    for name in ("gdn", "kda", "kdn"):
        layer = our_layer(name, H)
        x = torch.randn(B, T, H * HEAD_DIM, device="cuda")
        y = layer.to(torch.bfloat16)(x.to(torch.bfloat16))[0]
        with use_backend("reference"):
            y_ref = layer.double()(x.double())[0]
        errors[name] = relative_error(y, y_ref)
    return require_close(errors, TOLERANCE, "layers")


def _step(fn, x, grad, module):
    """A training step of ``fn`` on ``x``: gradients set to None first, as ``zero_grad()``
    does."""
    def run():
        x.grad = None
        module.zero_grad(set_to_none=True)
        fn(x).backward(grad)
    return run


def _steps(name: str, shape: Shape, against_fla: bool, *, eager: bool = True) -> dict:
    """Forward+backward steps of layer ``name`` at ``shape``: ours compiled (and eager), FLA's
    eager where it has that layer."""
    B, T, H = shape
    x = torch.randn(B, T, H * HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    layer = our_layer(name, H).to(torch.bfloat16)
    impls = {"ours": (torch.compile(lambda t: layer(t)[0], fullgraph=True), layer)}
    if eager:
        impls["ours eager"] = (lambda t: layer(t)[0], layer)
    fla = fla_layer(name, H) if against_fla else None
    if fla is not None:
        impls["FLA"] = (lambda t: fla(t)[0], fla)
    return {impl: _step(fn, x, grad, module) for impl, (fn, module) in impls.items()}


def measure(shape: Shape, against_fla: bool) -> list[dict]:
    rows = []
    for name in ("gdn", "kda", "kdn"):
        for impl, step in _steps(name, shape, against_fla).items():
            rows.append({"case": name, "impl": impl, "ms": median_ms(step),
                         "peak_mib": peak_mib(step)})
        del step
        torch.cuda.empty_cache()
    return rows


def profile_steps(shape: Shape, against_fla: bool) -> dict:
    """Our compiled layers' steps (``ours gdn``, ...) and FLA's (``FLA gdn``, ...)."""
    return {f"{impl} {name}": step for name in ("gdn", "kda", "kdn")
            for impl, step in _steps(name, shape, against_fla, eager=False).items()}
