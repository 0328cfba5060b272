"""Decode over state pools: ``delta_rule_decode`` / ``diag_kdn_decode`` against FLA's
``fused_recurrent_gated_delta_rule`` and ``fused_recurrent_kda``, and the layers' ``step``.

A shape ``BxTxH`` is batch x tokens per step x value heads; key heads are ``H / 2``
(grouped values), ``K = V = 128``, bf16 q/k/v, float32 gates. Every pool holds ``B``
slots named in a random order. Each case is timed called eagerly (``ours``, ``FLA``) and
replayed from a CUDA graph (``ours graph``, ``FLA graph``: the launch overhead out, as a
serving engine runs it); ``GBps`` is the effective state bandwidth of the graphed call,
state bytes read and written (float8 scales included) over time. FLA's GDN returns a new
final state; its KDA updates the state in place. Layer rows time one
``step`` of a ``[B, T, 2048]`` input (16 heads of 128) after a 512-token prefill.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kdn_compile.serving import delta_rule_decode, diag_kdn_decode
from kdn_compile.bench.timing import Shape, graphed, median_ms, relative_error, require_close
from kdn_compile.reference import recurrent_delta_rule_reference
from kdn_compile.reference.fp8 import dequantize_state_fp8, quantize_state_fp8

TITLE = ("Decode over state pools: B x T x H = batch x tokens per step x value heads "
         "(key heads H / 2), K = V = 128, bf16")
DEFAULT_SHAPES = (Shape(1, 1, 32), Shape(64, 1, 32), Shape(256, 1, 32), Shape(1, 4, 32),
                  Shape(64, 4, 32), Shape(256, 4, 32))
PLOT_IMPLS = ("ours graph", "FLA graph")  # the plots: CUDA-graph replays only
HEAD_DIM = 128
TOLERANCE = 2e-2  # bf16 inputs against float64 (float8 pools start from their own values)
FP8 = torch.float8_e4m3fn
POOLS = {"f32": torch.float32, "bf16": torch.bfloat16, "fp8": FP8}


def _inputs(shape: Shape, per_key: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    B, T, H = shape
    gen = torch.Generator("cuda").manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, device="cuda", generator=gen)

    hk = max(H // 2, 1)
    return {
        "q": F.normalize(randn(B, T, hk, HEAD_DIM), dim=-1).bfloat16(),
        "k": F.normalize(randn(B, T, hk, HEAD_DIM), dim=-1).bfloat16(),
        "v": randn(B, T, H, HEAD_DIM).bfloat16(),
        "g": -torch.rand(*((B, T, H, HEAD_DIM) if per_key else (B, T, H)), device="cuda",
                         generator=gen) * 0.5,
        "beta": torch.rand(B, T, H, device="cuda", generator=gen).bfloat16(),
    }


def _pool(slots: int, heads: int, dtype: torch.dtype, seed: int = 1):
    """``(pool, scales, float32 content)``."""
    gen = torch.Generator("cuda").manual_seed(seed)
    state = torch.randn(slots, heads, HEAD_DIM, HEAD_DIM, device="cuda", generator=gen) * 0.1
    if dtype == FP8:
        values, scales = quantize_state_fp8(state)
        return values, scales, dequantize_state_fp8(values, scales)
    pool = state.to(dtype)
    return pool, None, pool.float().clone()


def _state_bytes(shape: Shape, dtype: torch.dtype) -> int:
    per = {torch.float32: 4, torch.bfloat16: 2, FP8: 1}[dtype]
    scales = 4 * (HEAD_DIM // 64) if dtype == FP8 else 0
    return 2 * shape.batch * shape.heads * (HEAD_DIM * HEAD_DIM * per + scales)


def _fla(per_key: bool, x: dict, state: torch.Tensor) -> Callable[[], object]:
    if per_key:
        from fla.ops.kda import fused_recurrent_kda

        return lambda: fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                           initial_state=state, output_final_state=True)
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    return lambda: fused_recurrent_gated_delta_rule(  # its 5th parameter is gk: by name
        x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=state,
        output_final_state=True)


def check(against_fla: bool) -> dict[str, float]:
    """Every pool dtype and gate kind (and FLA's kernels) against the float64 token loop."""
    errors = {}
    shape = Shape(3, 4, 4)
    for per_key in (False, True):
        op = "kda" if per_key else "gdn"
        x = _inputs(shape, per_key, seed=1)
        exact = {n: t.double() for n, t in x.items()}
        for name, dtype in POOLS.items():
            pool, scales, start = _pool(5, 4, dtype)
            idx = torch.tensor([4, -1, 1], device="cuda")
            o = delta_rule_decode(*x.values(), pool, idx, pool_scales=scales)
            rows = torch.tensor([0, 2], device="cuda")
            o64, _ = recurrent_delta_rule_reference(
                *(t[rows] for t in exact.values()), initial_state=start[idx[rows]].double())
            errors[f"{op} o ({name} pool)"] = relative_error(o[rows], o64)
            errors[f"{op} padding row"] = float(o[1].abs().max())
        if against_fla:
            state = torch.randn(3, 4, HEAD_DIM, HEAD_DIM, device="cuda")
            o_fla, _ = _fla(per_key, x, state.clone())()
            o64, _ = recurrent_delta_rule_reference(*exact.values(), initial_state=state.double())
            errors[f"{op} o (FLA)"] = relative_error(o_fla, o64)
    return require_close(errors, TOLERANCE, "decode")


def _rows(case: str, fns: dict[str, Callable], bytes_moved: int | None, *, eager: bool = True,
          on_row: Callable[[dict], object] | None = None) -> list[dict]:
    rows = []
    for impl, fn in fns.items():
        timed = ((impl, fn),) if eager else ()
        for name, call in (*timed, (f"{impl} graph", graphed(fn))):
            row = {"case": case, "impl": name, "ms": median_ms(call)}
            if bytes_moved and name.endswith("graph"):
                row["GBps"] = bytes_moved / row["ms"] / 1e6
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows


def pool_rows(shape: Shape, against_fla: bool, slots: torch.Tensor | None = None, *,
              pools: tuple[str, ...] = tuple(POOLS), eager: bool = True,
              on_row: Callable[[dict], object] | None = None) -> list[dict]:
    """GDN then KDA ``delta_rule_decode`` over each pool dtype of ``pools`` (names of
    :data:`POOLS`) at ``shape``, and FLA's recurrent kernels beside the float32 pools with
    ``against_fla``: ``"<op> <pool> pool"`` rows, each call eager (unless ``eager`` is
    false) and replayed from a CUDA graph; ``slots`` (default: a random order of the pool)
    names the rows' slots; ``on_row(row)`` as each row is measured."""
    rows = []
    if slots is None:
        slots = torch.randperm(shape.batch, device="cuda")
    for per_key in (False, True):
        op = "KDA" if per_key else "GDN"
        x = _inputs(shape, per_key)
        for name in pools:
            dtype = POOLS[name]
            pool, scales, _ = _pool(shape.batch, shape.heads, dtype)
            fns = {"ours": lambda p=pool, s=scales: delta_rule_decode(
                *x.values(), p, slots, pool_scales=s)}
            if against_fla and dtype == torch.float32:
                fns["FLA"] = _fla(per_key, x, pool.clone())
            rows += _rows(f"{op} {name} pool", fns, _state_bytes(shape, dtype), eager=eager,
                          on_row=on_row)
    return rows


def _kdn_inputs(shape: Shape):
    B, T, H = shape
    gen = torch.Generator("cuda").manual_seed(3)
    q, k = (F.normalize(torch.randn(B, T, H, HEAD_DIM, device="cuda", generator=gen), dim=-1)
            .bfloat16() for _ in "qk")
    v = torch.randn(B, T, H, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    log_alpha = -torch.rand(B, T, H, HEAD_DIM, device="cuda", generator=gen) * 0.5
    omega = torch.rand(B, T, H, HEAD_DIM, device="cuda", generator=gen) * 0.1
    r = torch.rand(B, T, H, device="cuda", generator=gen) + 0.1
    return q, k, v, log_alpha, omega, r


def _layer_rows(shape: Shape) -> list[dict]:
    from kdn_compile.layers import DiagKDN, GatedDeltaNet, KimiDeltaAttention

    rows = []
    B, T, _ = shape
    for cls in (GatedDeltaNet, KimiDeltaAttention, DiagKDN):
        layer = cls(2048, 16, 128).cuda().bfloat16().eval()
        with torch.no_grad():
            cache = layer.allocate_cache(B, device="cuda")
            idx = torch.arange(B, device="cuda")
            layer.step(torch.randn(B, 512, 2048, device="cuda", dtype=torch.bfloat16), cache, idx)
            x = torch.randn(B, T, 2048, device="cuda", dtype=torch.bfloat16)
            compiled = torch.compile(layer.step, fullgraph=True, mode="reduce-overhead")
            for _ in range(3):
                compiled(x, cache, idx)
            case = f"{cls.__name__} step (D 2048, 16 x 128)"
            rows.append({"case": case, "impl": "ours",
                         "ms": median_ms(lambda: layer.step(x, cache, idx))})  # noqa: B023
            rows.append({"case": case, "impl": "ours graph",
                         "ms": median_ms(lambda: compiled(x, cache, idx))})  # noqa: B023
    return rows


def measure(shape: Shape, against_fla: bool) -> list[dict]:
    slots = torch.randperm(shape.batch, device="cuda")
    rows = pool_rows(shape, against_fla, slots)
    q, k, v, log_alpha, omega, r = _kdn_inputs(shape)
    memory, _, _ = _pool(shape.batch, shape.heads, torch.float32)
    precision = torch.rand(shape.batch, shape.heads, HEAD_DIM, device="cuda") + 0.5
    fns = {"ours": lambda: diag_kdn_decode(
        q, k, v, log_alpha, omega, r, memory, precision, slots, scale=HEAD_DIM**-0.5,
        info_scale=1.0)}
    rows += _rows("Diag-KDN f32 memory", fns, _state_bytes(shape, torch.float32)
                  + 2 * shape.batch * shape.heads * HEAD_DIM * 4)
    if shape.batch == 64 and shape.length == 1:
        rows += _layer_rows(shape)
    return rows
