"""Input factories and the one error helper the tests share."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F


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


def delta_inputs(B=2, T=37, Hk=2, Hv=4, K=8, V=6, *, per_key=False, dtype=torch.float64,
                 requires_grad=False, seed=0, with_state=True, state_v_first=False, N=None):
    """Random GDN/KDA inputs: normalized q/k, gates in (-1, 0), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    N = B if N is None else N
    x = {
        "q": F.normalize(r(B, T, Hk, K), dim=-1),
        "k": F.normalize(r(B, T, Hk, K), dim=-1),
        "v": r(B, T, Hv, V),
        "g": -torch.rand(*((B, T, Hv, K) if per_key else (B, T, Hv)), generator=gen,
                         dtype=torch.float64),
        "beta": torch.rand(B, T, Hv, generator=gen, dtype=torch.float64),
    }
    if with_state:
        x["initial_state"] = r(N, Hv, V, K) if state_v_first else r(N, Hv, K, V)
    return {n: t.to(dtype).requires_grad_(requires_grad) for n, t in x.items()}


def kdn_inputs(B=2, T=29, H=2, K=8, V=6, *, dtype=torch.float64, requires_grad=False, seed=0,
               N=None):
    """Random Diag-KDN inputs through the spec's own noise map and normalization."""
    from kdn_compile.reference import kalman_noise, normalize_query_key

    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    N = B if N is None else N
    q, k = normalize_query_key(r(B, T, H, K), r(B, T, H, K))
    log_alpha, omega, rr, prior = kalman_noise(
        r(B, T, H, K), r(B, T, H, K) - 2, r(B, T, H), 0.3 * r(H), 0.5 * r(H * K), r(H)
    )
    x = {
        "q": q, "k": k, "v": r(B, T, H, V), "log_alpha": log_alpha, "omega": omega, "r": rr,
        "memory": 0.5 * r(N, H, K, V), "precision": prior.abs()[None, :, None].expand(N, H, K) + 0.1 * torch.rand(N, H, K, generator=gen, dtype=torch.float64),
    }
    return {n: t.to(dtype).contiguous().requires_grad_(requires_grad) for n, t in x.items()}


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
