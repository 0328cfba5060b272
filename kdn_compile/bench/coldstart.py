"""Cold start: the first forward+backward in a new process, from empty caches and from the
caches that run left behind.

Each measurement is a fresh Python process (``python -m kdn_compile.bench.coldstart``) with
``TRITON_CACHE_DIR`` and ``TORCHINDUCTOR_CACHE_DIR`` pointing into a new temporary
folder: ``ours`` / ``FLA`` start from empty caches (every kernel compiled, FLA's autotuning
run), ``ours cached`` / ``FLA cached`` are a second process on the caches the first one
filled (what a restarted job sees). The time runs from the first call to the end of its
backward (``torch.cuda.synchronize``); the process start, imports and CUDA initialisation
are not in it. Cases (:data:`OP_CASES`, this family): the ops ``gdn``, ``kda``, ``kdn``
called eagerly, as the ``gdn``, ``kda`` and ``kdn`` families do; the ``coldstart-layers``
family (:mod:`kdn_compile.bench.coldstart_layers`) times :data:`LAYER_CASES`, ``gdn layer``,
``kda layer``, ``kdn layer``: one training step of our layer under
``torch.compile(fullgraph=True)`` (FLA's layer eager), as the ``layers`` family. Each
process checks its first output against the reference in float64 (ours only) before it
reports.

Each row is printed as soon as its process ends. Budget: a process running longer than
:data:`ROW_BUDGET_S` is stopped and reported, not recorded (nor is the cached run after
it); no process runs past :data:`RUN_BUDGET_S` from the start of a shape's measurement, and
the rows not reached by then are named. Either family thus fits an 8-minute call.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from kdn_compile.bench.timing import CheckFailed, Shape, relative_error

TITLE = ("Cold start of the ops: first forward+backward in a new process, empty caches and "
         "cached, K = V = 128, bf16 (ms)")
DEFAULT_SHAPES = (Shape(1, 4096, 16),)
OP_CASES = ("gdn", "kda", "kdn")
LAYER_CASES = ("gdn layer", "kda layer", "kdn layer")
CASES = OP_CASES + LAYER_CASES
FLA_CASES = ("gdn", "kda", "gdn layer", "kda layer")
ROW_BUDGET_S = 180  # one process (first call from empty caches, or cached) is stopped after this
RUN_BUDGET_S = 420  # no process runs past this many seconds from the start of :func:`measure`
_clock = time.monotonic
TOLERANCE = 3e-2  # bf16 against the float64 reference, as the ``layers`` family
PLOT_IMPLS = ()  # no plots: compile time hardly depends on the shape
_RESULT = "coldstart result: "


def _op_step(case: str, impl: str, shape: Shape):
    """``(step, reference)`` for an op: ``step()`` runs the first forward+backward and
    returns the output; ``reference()`` the float64 output of the same inputs."""
    from kdn_compile.bench import _delta, gdn, kda, kdn
    from kdn_compile.reference import (
        chunk_gdn_reference, chunk_kda_reference, diag_kdn_reference,
    )

    scale = _delta.HEAD_DIM ** -0.5
    if case == "kdn":
        inputs = kdn.make_inputs(shape, 0)
        fn = kdn.ours

        def reference():
            return diag_kdn_reference(*(t.double() for t in inputs), scale=scale,
                                      info_scale=kdn.INFO_SCALE)[0]
    else:
        family, exact = {"gdn": (gdn, chunk_gdn_reference), "kda": (kda, chunk_kda_reference)}[case]
        inputs = _delta.make_inputs(shape, 0, per_key=case == "kda")
        call = family.ours if impl == "ours" else family.fla()

        def fn(*x):
            return call(*x, scale)

        def reference():
            *x, h0 = (t.double() for t in inputs)
            return exact(*x, scale=scale, initial_state=h0)[0]
    leaves = [t.detach().clone().requires_grad_() for t in inputs]

    def step():
        o = fn(*leaves)[0]
        o.backward(torch.ones_like(o))
        return o
    return step, reference


def _layer_step(case: str, impl: str, shape: Shape):
    """``(step, reference)`` for one training step of a layer (see :func:`_op_step`)."""
    from kdn_compile._backend import use_backend
    from kdn_compile.bench import layers

    name = case.split()[0]
    B, T, H = shape
    if impl == "ours":
        layer = layers.our_layer(name, H).to(torch.bfloat16)
        exact = copy.deepcopy(layer).double()  # the timed layer's bf16 weights, in float64

        def reference():
            with use_backend("reference"):
                return exact(x.detach().double())[0]
        fn = torch.compile(lambda t: layer(t)[0], fullgraph=True)
    else:
        layer = layers.fla_layer(name, H)
        fn, reference = (lambda t: layer(t)[0]), None
    device = next(layer.parameters()).device
    x = torch.randn(B, T, H * layers.HEAD_DIM, device=device, generator=torch.Generator(
        device).manual_seed(0)).to(torch.bfloat16).requires_grad_()

    def step():
        y = fn(x)
        y.backward(torch.ones_like(y))
        return y
    return step, reference


def first_step(case: str, impl: str, shape: Shape) -> dict:
    """In this process: the seconds of the first forward+backward of ``case`` by ``impl``
    (``"ours"`` or ``"FLA"``) at ``shape`` and, for ours, the relative error of its output
    against the reference in float64 (None for FLA)."""
    make = _layer_step if case.endswith("layer") else _op_step
    step, reference = make(case, impl, shape)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    error = None if reference is None else relative_error(out.detach(), reference())
    return {"seconds": seconds, "error": error}


def _in_new_process(case: str, impl: str, shape: Shape, caches: str,
                    timeout: float) -> dict | None:
    """:func:`first_step` in a new process on ``caches``; None when it ran past ``timeout``
    seconds (it is then stopped)."""
    env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(caches, "triton"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"))
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kdn_compile.bench.coldstart", case, impl, str(shape)],
            env=env, capture_output=True, text=True, check=False, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(_RESULT)]
    if done.returncode or not lines:
        raise RuntimeError(f"coldstart {case} ({impl}) failed with exit code "
                           f"{done.returncode}:\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len(_RESULT):])


def check(against_fla: bool) -> dict[str, float]:
    """Nothing before timing: every measured process checks its own output (see
    :func:`measure`)."""
    return {}


def _pairs(cases: tuple[str, ...], against_fla: bool) -> list[tuple[str, str]]:
    """``(case, impl)`` in the order measured: each case, ours then FLA's where it has one."""
    impls = ("ours", "FLA") if against_fla else ("ours",)
    return [(case, impl) for case in cases for impl in impls
            if impl == "ours" or case in FLA_CASES]


def measure(shape: Shape, against_fla: bool, cases: tuple[str, ...] = OP_CASES) -> list[dict]:
    """Per case of ``cases`` and implementation, one process on empty caches, then one on
    its caches, each row printed as it ends, within :data:`ROW_BUDGET_S` a process and
    :data:`RUN_BUDGET_S` in all (see the module's description).

    Raises:
        CheckFailed: one of our first outputs is further than ``TOLERANCE`` from the
            reference.
    """
    rows, start = [], _clock()
    pairs = _pairs(cases, against_fla)
    print(f"coldstart {shape}: {2 * len(pairs)} processes, each stopped after {ROW_BUDGET_S} s, "
          f"none past {RUN_BUDGET_S} s", flush=True)
    for index, (case, impl) in enumerate(pairs):
        left = RUN_BUDGET_S - (_clock() - start)
        if left <= 0:
            print(f"coldstart {shape}: the {RUN_BUDGET_S} s budget is spent; not timed: "
                  + ", ".join(f"{c} ({i})" for c, i in pairs[index:]), flush=True)
            break
        with tempfile.TemporaryDirectory(prefix="kdn-coldstart-") as caches:
            for label in (impl, f"{impl} cached"):
                timeout = min(ROW_BUDGET_S, RUN_BUDGET_S - (_clock() - start))
                got = _in_new_process(case, impl, shape, caches, timeout) if timeout > 0 else None
                if got is None:
                    why = (f"stopped after {timeout:.0f} s" if timeout > 0
                           else f"the {RUN_BUDGET_S} s budget is spent")
                    print(f"coldstart {case} {label} {shape}: not recorded, {why}", flush=True)
                    break
                if got["error"] is not None and not got["error"] <= TOLERANCE:
                    raise CheckFailed(f"coldstart {case}: relative error {got['error']:.2e} "
                                      f"above {TOLERANCE:g}")
                rows.append({"case": case, "impl": label, "ms": 1e3 * got["seconds"]})
                checked = "" if got["error"] is None else f", {got['error']:.1e} from float64"
                print(f"coldstart {case} {label} {shape}: {got['seconds']:.1f} s{checked}",
                      flush=True)
    return rows


def main(argv: list[str]) -> None:
    """``python -m kdn_compile.bench.coldstart CASE IMPL BxTxH``: one measurement, printed
    as one JSON line after ``coldstart result: ``."""
    from kdn_compile.bench.timing import parse_shapes

    case, impl, shape = argv
    print(_RESULT + json.dumps(first_step(case, impl, parse_shapes(shape)[0])), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
