"""What the tests share: tier markers, the interpreter switch, the error helpers, launch
recorders and the float64 token-loop oracles (the random inputs: ``_inputs.py``)."""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch

# Tier markers (registered in conftest.py): ``gpu`` runs on CUDA only; ``kernels`` runs the
# Triton kernels on CUDA, or in Triton's interpreter without CUDA; ``slow``: full tier only.
gpu = pytest.mark.gpu
slow = pytest.mark.slow


def kernels(test):
    """Mark ``test`` as running our Triton kernels: on CUDA (a GPU tier test) or, without
    CUDA, in Triton's interpreter."""
    return pytest.mark.interpreter(pytest.mark.gpu(test))


def interpreting() -> bool:
    """Whether ``@triton.jit`` kernels run in Triton's interpreter (``TRITON_INTERPRET=1``,
    which conftest.py sets where there is no CUDA)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def without_interpreter() -> dict:
    """This process's environment less ``TRITON_INTERPRET``: for a child process whose
    kernels must build for a real target (traced or compiled, not run)."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def trace_kernel_paths(*modes: str) -> dict:
    """``{mode: (passed, output)}``: ``tests/_trace_kernel_path.py`` run once for all
    ``modes``, in one child process without the interpreter. A mode passed if it ran
    without raising and the process exited 0 (or 1 because another mode raised); its output
    ends with the tail of the process's stderr."""
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "tests/_trace_kernel_path.py", *modes],
                          env=without_interpreter(), capture_output=True, text=True,
                          timeout=900, cwd=root)
    parts = dict(re.findall(r"^== (\S+)\n(.*?)(?=^== \S+\n|\Z)", done.stdout, re.M | re.S))
    raised = {m for m in modes if f"== {m} failed" in done.stdout}
    exit_ok = done.returncode == 0 or (done.returncode == 1 and bool(raised))
    return {m: (exit_ok and m in parts and m not in raised,
                parts.get(m, done.stdout) + "\n" + done.stderr[-3000:]) for m in modes}


# A test outside the GPU tiers that runs the kernels: on CUDA, or in the interpreter.
needs_kernels = pytest.mark.skipif(not (torch.cuda.is_available() or interpreting()),
                                   reason="needs CUDA or TRITON_INTERPRET=1")


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative RMS error ``||a - e|| / max(||e||, tiny)`` in float64."""
    a, e = actual.detach().double(), expected.detach().double()
    return float((a - e).norm() / e.norm().clamp_min(1e-300))


def assert_close(actual, expected, tol: float, what: str = "") -> None:
    """Fail loudly, with the relative error and the worst element, above ``tol``."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = rel_error(actual, expected)
    if not err <= tol:  # also catches NaN
        diff = (actual.detach().double() - expected.detach().double()).abs()
        idx = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        raise AssertionError(
            f"{what}: relative error {err:.3e} > {tol:.1e}; worst at {idx}: "
            f"{actual[idx].item()} vs {expected[idx].item()}"
        )


LAUNCHER_MODULES = ("chunk_gdn_fwd", "chunk_gdn_bwd", "chunk_gdn_wy", "two_key_fwd", "two_key_bwd",
                    "kalman_gain", "recurrent", "slots", "fp8")


def launcher_modules():
    """The ``kdn_compile.lowering`` modules that call ``wrap_triton``."""
    import importlib

    return [importlib.import_module(f"kdn_compile.lowering.{name}") for name in LAUNCHER_MODULES]


def launch_recorder(sink: list):
    """A stand-in for ``wrap_triton``: each launch appends ``(kernel, grid, args, kwargs)``
    to ``sink`` and runs nothing (the launcher's host code still runs)."""

    def wrap(kernel):
        class _Launch:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    sink.append((kernel, tuple(grid), args, kwargs))
                return launch
        return _Launch()

    return wrap


def count_calls(monkeypatch, module, names) -> list:
    """Wrap the functions ``names`` of ``module`` so each call appends its name to the
    returned list (the functions still run)."""
    calls: list = []
    for name in names:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **kw:
                            calls.append(_name) or _real(*a, **kw))
    return calls


@contextlib.contextmanager
def poisoned():
    """torch.empty, empty_like and Tensor.new_empty return NaN-filled memory meanwhile, so an
    output element a kernel never writes shows."""
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def nan(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "empty", lambda *a, **kw: nan(empty(*a, **kw)))
        patch.setattr(torch, "empty_like", lambda *a, **kw: nan(empty_like(*a, **kw)))
        patch.setattr(torch.Tensor, "new_empty",
                      lambda self, *a, **kw: nan(new_empty(self, *a, **kw)))
        yield


# -- float64 token loops: the oracles of the property tests --------------------------


def _runs(cu_seqlens, batch: int, length: int) -> list[tuple[int, int, int, int]]:
    """``(state row, batch row, start, stop)`` of each independent sequence."""
    if cu_seqlens is None:
        return [(b, b, 0, length) for b in range(batch)]
    bounds = [int(x) for x in cu_seqlens.tolist()]
    return [(n, 0, bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]


def delta_rule_oracle(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
                      state_v_first=False):
    """The gated delta rule token by token in float64, written from the spec's recurrence
    ``S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``,
    ``o_t = scale * S_t^T q_t`` (value head ``h`` reads key head ``h // (Hv // Hk)``;
    ``g`` ``[B, T, Hv]`` or ``[B, T, Hv, K]``). Differentiable; returns
    ``(o [B, T, Hv, V], final_state)`` in float64, the state in the layout it came in.
    ``T >= 1``; ``cu_seqlens`` (``B == 1``) may hold empty sequences."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    scale = dk ** -0.5 if scale is None else scale
    runs = _runs(cu_seqlens, b, t)
    if initial_state is None:
        states = q.new_zeros(len(runs), hv, dk, dv)
    else:
        states = initial_state.double()
        states = states.transpose(-1, -2) if state_v_first else states
    eye = torch.eye(dk, dtype=torch.float64)
    rows, finals = [[None] * t for _ in range(b)], []
    for n, row, start, stop in runs:
        state = states[n]
        for tok in range(start, stop):
            key = k[row, tok].repeat_interleave(hv // hk, dim=0)  # [Hv, K]
            query = q[row, tok].repeat_interleave(hv // hk, dim=0)
            decay = g[row, tok].exp()  # [Hv] or [Hv, K]
            decay = decay[:, :, None] if decay.dim() == 2 else decay[:, None, None]
            write = beta[row, tok][:, None, None] * key[:, :, None]  # beta k, [Hv, K, 1]
            state = (eye - write * key[:, None, :]) @ (decay * state) + write * v[row, tok][:, None, :]
            rows[row][tok] = scale * torch.einsum("hk,hkv->hv", query, state)
        finals.append(state)
    o = torch.stack([torch.stack(r) for r in rows])
    final = torch.stack(finals)
    return o, (final.transpose(-1, -2) if state_v_first else final)


def diag_kdn_oracle(q, k, v, log_alpha, omega, r, memory, precision, *, scale, info_scale,
                    cu_seqlens=None, floor=math.log(1e-6)):
    """Diagonal KDN token by token in float64, written from the spec's recurrence:
    ``p_hat = alpha^2 p + omega``, ``kappa = p_hat k / (r + sum_i p_hat_i k_i^2)``,
    ``1/p = 1/p_hat + info_scale k^2 / r``,
    ``S = (I - kappa k^T) diag(alpha') S + kappa v^T`` (``log alpha'`` floored at
    ``floor``, the covariance uses the raw ``alpha``), ``o = scale S^T q``.
    Returns ``(o, memory, precision)`` in float64."""
    q, k, v, log_alpha, omega, r = (x.double() for x in (q, k, v, log_alpha, omega, r))
    b, t, h, dk = q.shape
    eye = torch.eye(dk, dtype=torch.float64)
    rows, memories, precisions = [[None] * t for _ in range(b)], [], []
    for n, row, start, stop in _runs(cu_seqlens, b, t):
        state, p = memory[n].double(), 1.0 / precision[n].double()
        for tok in range(start, stop):
            key, noise = k[row, tok], r[row, tok][:, None]
            p_hat = (2 * log_alpha[row, tok]).exp() * p + omega[row, tok]
            gain = p_hat * key / (noise + (p_hat * key**2).sum(-1, keepdim=True))
            p = 1.0 / (1.0 / p_hat + info_scale * key**2 / noise)
            alpha = log_alpha[row, tok].clamp_min(floor).exp()
            state = ((eye - gain[:, :, None] * key[:, None, :]) @ (alpha[:, :, None] * state)
                     + gain[:, :, None] * v[row, tok][:, None, :])
            rows[row][tok] = scale * torch.einsum("hk,hkv->hv", q[row, tok], state)
        memories.append(state)
        precisions.append(1.0 / p)
    return torch.stack([torch.stack(rw) for rw in rows]), torch.stack(memories), torch.stack(precisions)
