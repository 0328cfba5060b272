"""Shared pieces of ``kdn-compile bench``: shapes, timing, memory, errors, run metadata."""

from __future__ import annotations

import datetime
import importlib.metadata
import itertools
import math
import os
import subprocess
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

WARMUP_MS = 25  # do_bench's warm-up, then REPEAT_MS of timed calls (medians)
REPEAT_MS = 100
ROTATE_MAX = 8  # at most this many input sets in the rotation of :func:`rotating`
PROFILE_STEPS = 5  # steps recorded by :func:`kernel_times`, after one warm step


class CheckFailed(RuntimeError):
    """A family's correctness check found an error above its tolerance."""


class Shape(NamedTuple):
    """``batch x length x heads``, written ``BxTxH`` on the command line."""

    batch: int
    length: int
    heads: int

    def __str__(self) -> str:
        return f"{self.batch}x{self.length}x{self.heads}"


def parse_shapes(text: str) -> list[Shape]:
    """``"8x4096x16,1x32768x16"`` -> shapes.

    Raises:
        ValueError: an item is not three positive integers joined by ``x``.
    """
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"shape {item!r} is not BxTxH with positive integers, e.g. 8x4096x16")
        shapes.append(Shape(*map(int, parts)))
    return shapes


def median_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn()`` by ``triton.testing.do_bench`` (which clears the L2
    cache before every call), after ``WARMUP_MS`` of warm-up."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=WARMUP_MS, rep=REPEAT_MS, return_mode="median")


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph (after one eager call); returns its replay."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _nbytes(tensors: Sequence) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def rotating(make: Callable[[int], Sequence], step: Callable[..., object]) -> Callable[[], object]:
    """``step`` over input sets ``make(0), make(1), ...`` in turn, so that no call finds
    its inputs in the L2 cache left by the one before.

    Makes enough sets to hold twice the device's L2 cache (at most ``ROTATE_MAX``; one
    when a set alone is larger).
    """
    first = make(0)
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    count = min(ROTATE_MAX, max(1, math.ceil(2 * l2 / max(_nbytes(first), 1))))
    sets = itertools.cycle([first] + [make(i) for i in range(1, count)])
    return lambda: step(*next(sets))


def peak_mib(fn: Callable[[], object]) -> float:
    """Peak MiB allocated by one ``fn()`` above what was allocated before it."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``|actual - expected| / |expected|`` (Frobenius norms, in float64)."""
    expected = expected.double()
    return float((actual.double() - expected).norm() / expected.norm().clamp_min(1e-300))


def require_close(errors: dict[str, float], tolerance: float, where: str) -> dict[str, float]:
    """Returns ``errors``; raises :class:`CheckFailed` naming every one above ``tolerance``
    or not finite."""
    bad = {name: e for name, e in errors.items() if not e <= tolerance}
    if bad:
        raise CheckFailed(f"{where}: relative error above {tolerance:g}: "
                          + ", ".join(f"{n} {e:.2e}" for n, e in bad.items()))
    return errors


def fwd_bwd(fn: Callable[..., Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor],
            grad: torch.Tensor) -> Callable[[], None]:
    """A training step: ``fn(*leaves)`` and its backward from ``grad`` on the first output,
    with ``leaves`` fresh copies of the floating ``inputs`` that require gradients. Each step
    starts with the leaves' ``.grad`` set to None, as ``zero_grad()`` does, so that autograd
    hands the gradients over instead of adding them to the previous step's."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]

    def step():
        for leaf in leaves:
            leaf.grad = None
        torch.autograd.backward([fn(*leaves)[0]], [grad])
    return step


def kernel_times(step: Callable[[], object], steps: int = PROFILE_STEPS) -> list[dict]:
    """The GPU work of one ``step()`` by kernel, slowest first: ``{"kernel", "calls", "ms"}``
    per step, averaged over ``steps`` steps recorded by ``torch.profiler`` after one warm
    step (kernels, copies and memsets, as the CUDA activity trace names them)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return summarize_kernels(prof.events(), steps)


def summarize_kernels(events, steps: int) -> list[dict]:
    """:func:`kernel_times` of profiler ``events`` (``FunctionEvent``-like: ``name``,
    ``device_type``, ``time_range.elapsed_us()``) covering ``steps`` steps: the device
    events grouped by name, per step, slowest first."""
    totals: dict[str, list] = {}
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        total = totals.setdefault(event.name, [0, 0.0])
        total[0] += 1
        total[1] += event.time_range.elapsed_us()
    rows = [{"kernel": name, "calls": calls / steps, "ms": us / steps / 1e3}
            for name, (calls, us) in totals.items()]
    return sorted(rows, key=lambda row: -row["ms"])


def time_forward_backward(make: Callable[[int], Sequence[torch.Tensor]],
                          impls: dict[str, Callable[..., Sequence[torch.Tensor]]],
                          grad_index: int = 2,
                          on_row: Callable[[dict], object] | None = None) -> list[dict]:
    """Rows ``{"case": "fwd" | "fwd+bwd", "impl", "ms"[, "peak_mib"]}`` for each of
    ``impls`` on the inputs ``make(seed)``: the forward over rotating input sets, then
    forward+backward from a random gradient shaped as input ``grad_index`` (the first
    output's shape), with its peak memory. ``on_row(row)`` is called as each row is
    measured."""
    rows = []

    def add(row):
        rows.append(row)
        if on_row is not None:
            on_row(row)
    for impl, fn in impls.items():
        add({"case": "fwd", "impl": impl, "ms": median_ms(rotating(make, fn))})
        inputs = make(0)
        step = fwd_bwd(fn, inputs, torch.randn_like(inputs[grad_index]))
        add({"case": "fwd+bwd", "impl": impl, "ms": median_ms(step), "peak_mib": peak_mib(step)})
        del inputs, step
        torch.cuda.empty_cache()
    return rows


def fla_version() -> str | None:
    """The installed FLA distribution's version, or None."""
    for name in ("flash-linear-attention", "fla-core"):
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def source_commit(package_dir: str) -> str:
    """The git commit of the checkout whose tree holds the package in ``package_dir``, with
    ``+dirty`` when the checkout's tracked files differ from it (the timed code is then not
    that commit's).

    The checkout is the git repository around ``package_dir`` only where that repository's
    ``HEAD`` holds ``package_dir/__init__.py``: a copy unpacked (or installed) inside another
    repository is not that repository's code. Otherwise :func:`installed_version`'s
    ``"unknown (kdn-compile 0.1.0)"`` when the package is an installed distribution's,
    else ``"unknown"``.
    """
    package_dir = os.path.realpath(package_dir)

    def git(*args):
        return subprocess.run(["git", *args], cwd=package_dir, capture_output=True, text=True,
                              timeout=10)
    commit = ""
    try:
        top = git("rev-parse", "--show-toplevel").stdout.strip()
        if top:
            init = os.path.relpath(os.path.join(package_dir, "__init__.py"), os.path.realpath(top))
            if git("cat-file", "-e", f"HEAD:{init.replace(os.sep, '/')}").returncode == 0:
                commit = git("rev-parse", "--short", "HEAD").stdout.strip()
        if commit and git("diff", "--quiet", "HEAD", "--").returncode == 1:
            commit += "+dirty"
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    if commit:
        return commit
    version = installed_version(package_dir)
    return f"unknown ({version})" if version else "unknown"


def installed_version(package_dir: str, distribution: str = "kdn-compile") -> str | None:
    """``"kdn-compile 0.1.0"`` when the installed ``distribution``'s files hold the package in
    ``package_dir`` (not some other copy of it), else None."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    name = os.path.basename(os.path.realpath(package_dir))
    located = os.path.realpath(str(dist.locate_file(os.path.join(name, "__init__.py"))))
    if located != os.path.realpath(os.path.join(package_dir, "__init__.py")):
        return None
    return f"{distribution} {dist.version}"


def run_metadata() -> dict[str, str]:
    """GPU name, torch / triton / FLA versions, the commit of the imported ``kdn_compile``
    (:func:`source_commit`) and the UTC time."""
    import triton

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = source_commit(package)
    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fla": fla_version() or "absent",
        "commit": commit,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
