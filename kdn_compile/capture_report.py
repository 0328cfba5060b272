"""``kdn-compile check``: a capture report of the training and token-recurrence functions on
this device (the serving ops of :mod:`kdn_compile.serving` are covered by the tests).

For each public function it records which ``torch.ops.kdn`` op actually runs
(backend switch and device decide), runs ``torch.library.opcheck`` on that op,
compiles the function with ``torch.compile(fullgraph=True, dynamic=True)``,
exports it with ``torch.export`` (dynamic sequence length) and runs the export
at another length, and measures the error of its float32 output against the
reference (in float64; for the FP8 QDQ, whose grid moves with the scale's
rounding, in float32).
"""

from __future__ import annotations

import argparse
import sys
import traceback

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from kdn_compile import api
from kdn_compile import reference as ref
from kdn_compile._backend import BACKENDS, get_backend, set_backend

LENGTHS = (37, 70)  # traced at the first length, rerun at the second
AGREE = 1e-4  # compiled / exported vs eager: the same op on the same inputs
ACCURATE = 1e-3  # float32 op vs reference at these sizes (measured: <= 7e-6 for the references)


class _RecordKdnOps(TorchDispatchMode):
    """Remembers the outermost ``kdn`` op calls ``(op, args, kwargs)`` under it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "kdn":
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def _delta(T, device, gen, per_key=False):
    r = lambda *s: torch.randn(*s, generator=gen).to(device)  # noqa: E731
    B, Hk, Hv, K, V = 2, 2, 4, 16, 16
    g_shape = (B, T, Hv, K) if per_key else (B, T, Hv)
    return {
        "q": F.normalize(r(B, T, Hk, K), dim=-1), "k": F.normalize(r(B, T, Hk, K), dim=-1),
        "v": r(B, T, Hv, V), "g": -torch.rand(*g_shape, generator=gen).to(device),
        "beta": torch.rand(B, T, Hv, generator=gen).to(device),
        "initial_state": r(B, Hv, K, V),
    }


def _kdn(T, device, gen):
    r = lambda *s: torch.randn(*s, generator=gen).to(device)  # noqa: E731
    B, H, K, V = 2, 2, 16, 16
    q, k = ref.normalize_query_key(r(B, T, H, K), r(B, T, H, K))
    log_alpha, omega, rr, prior = ref.kalman_noise(
        r(B, T, H, K), r(B, T, H, K) - 2, r(B, T, H), 0.3 * r(H), 0.5 * r(H * K), r(H)
    )
    memory, precision = ref.initial_state(prior, batch_size=B, key_dim=K, value_dim=V)
    return {"q": q, "k": k, "v": r(B, T, H, V), "log_alpha": log_alpha, "omega": omega,
            "r": rr, "memory": memory, "precision": precision}


def _kdn_public(**x):
    return api.diag_kdn(**x, scale=0.25, info_scale=1.0)


def _kdn_reference(**x):
    return ref.diag_kdn_chunked(**x, scale=0.25, info_scale=1.0)


# name: (public function, reference, inputs(T, device, generator), reference in float64?)
# The FP8 grid moves with the scale's rounding, so that reference runs on the same float32.
CASES = {
    "chunk_gdn": (api.chunk_gdn, ref.chunk_gdn_reference, _delta, True),
    "chunk_kda": (api.chunk_kda, ref.chunk_kda_reference,
                  lambda T, d, g: _delta(T, d, g, per_key=True), True),
    "recurrent_delta_rule": (api.recurrent_delta_rule,
                             ref.recurrent_delta_rule_reference, _delta, True),
    "diag_kdn": (_kdn_public, _kdn_reference, _kdn, True),
    "state_fp8_qdq": (api.state_fp8_qdq, ref.state_fp8_qdq_reference,
                      lambda T, d, g: {"state": torch.randn(T, 4, 16, 16, generator=g).to(d)},
                      False),
}


def _as_tuple(out):
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


def _max_error(got, want) -> float:
    return max((a.double() - b.double()).abs().max().item() for a, b in zip(got, want))


def _opcheck(func, args, kwargs) -> str:
    def leaf(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.detach().clone().requires_grad_()
        return x

    result = torch.library.opcheck(func, tuple(leaf(a) for a in args), kwargs)
    failed = [name for name, outcome in result.items() if outcome != "SUCCESS"]
    return "ok" if not failed else "FAIL " + ",".join(failed)


class _Call(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, inputs: dict):
        return self.fn(**inputs)


def check_op(name: str, device: torch.device) -> dict:
    """The capture report of one public function (see the module docstring).

    Returns a row ``{column: text}`` plus ``"failures"``: what did not pass.
    """
    public, reference, make, in_float64 = CASES[name]
    gen = torch.Generator().manual_seed(0)
    first, second = (make(T, device, gen) for T in LENGTHS)
    row = {"op": name, "failures": []}

    def attempt(column, measure, tolerance=None):
        """Fill ``column`` with ``measure()`` (a verdict or an error); note failures."""
        try:
            value = measure()
        except Exception:  # a report, not a test: show what failed and go on
            row[column] = "FAIL (raised)"
            row["failures"].append(f"{name} {column}: {traceback.format_exc(limit=4)}")
            return
        if tolerance is None:
            row[column] = value
            good = value == "ok"
        else:
            good = value <= tolerance
            row[column] = f"{'ok' if good else 'FAIL'} ({value:.0e})"
        if not good:
            row["failures"].append(f"{name} {column}: {row[column]}")

    recorder = _RecordKdnOps()
    with recorder:
        eager = _as_tuple(public(**first))
    func, args, kwargs = recorder.calls[0]
    row["runs"] = str(func).replace(".default", "")
    attempt("opcheck", lambda: _opcheck(func, args, kwargs))

    def compiled():
        torch._dynamo.reset()
        # a caller's frame, as in a model: its locals, not the op's defaults, are the inputs
        fn = torch.compile(lambda x: public(**x), fullgraph=True, dynamic=True)
        return max(_max_error(_as_tuple(fn(x)), _as_tuple(public(**x))) for x in (first, second))

    def exported():
        axis = 0 if name == "state_fp8_qdq" else 1  # the axis that grows with T
        dims = {
            n: ({axis: torch.export.Dim.AUTO}
                if t.dim() >= 3 and t.shape[axis] == LENGTHS[0] else None)
            for n, t in first.items()
        }
        program = torch.export.export(_Call(public), (first,), dynamic_shapes=(dims,))
        return _max_error(_as_tuple(program.module()(second)), _as_tuple(public(**second)))

    attempt("compile", compiled, AGREE)
    attempt("export", exported, AGREE)
    wide = {n: t.double() if in_float64 else t for n, t in first.items()}
    attempt("vs_reference", lambda: _max_error(eager, _as_tuple(reference(**wide))), ACCURATE)
    return row


def run(args: argparse.Namespace) -> int:
    """Print the report; returns 0 when every op passed every check, else 1."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.backend:
        set_backend(args.backend)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    print(f"kdn-compile check on {device}: torch {torch.__version__}, triton {triton_version}, "
          f"backend {get_backend()!r}, float32 inputs, "
          f"T = {LENGTHS[0]} then {LENGTHS[1]}")
    columns = ("op", "runs", "opcheck", "compile", "export", "vs_reference")
    rows = []
    for name in CASES:  # a compile and an export each: seconds apiece on a CPU
        print(f"checking {name} ...", file=sys.stderr, flush=True)
        rows.append(check_op(name, device))
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
    for row in rows:
        print("  ".join(str(row[c]).ljust(w) for c, w in zip(columns, widths)).rstrip())
    print(
        "runs: the op the public function called (kdn.<name>_reference: the exact reference; "
        "kdn.<name>: the Triton op, which falls back to the reference where its kernels do not "
        "cover the inputs).\n"
        f"compile: torch.compile(fullgraph=True, dynamic=True), max |compiled - eager| over both "
        f"lengths; export: torch.export with dynamic T, run at the second length, max |diff| "
        f"(both ok <= {AGREE:g}).\n"
        f"vs_reference: max |float32 op - float64 reference| (state_fp8_qdq: float32 reference), "
        f"ok <= {ACCURATE:g}."
    )
    failures = [f for r in rows for f in r["failures"]]
    for failure in failures:
        print(failure)
    return 1 if failures else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if present)")
    parser.add_argument("--backend", choices=BACKENDS, default=None,
                        help="backend switch for this report (default: the current one)")
