"""The tests' random inputs: one factory for each family, the same values for the same seed.

Every factory draws in float64 from ``seed`` (an int, or a ``torch.Generator`` the caller
goes on drawing from, for cotangents after the inputs) and casts the result to ``dtype``
on ``device`` (float64 on the CPU by default):

* :func:`delta_inputs`: the gated delta rules', GDN's (a gate per value head) or, with
  ``per_key``, KDA's (a gate per key channel);
* :func:`kdn_inputs`: Diag-KDN's, through the spec's own noise map and normalization;
* :func:`family_inputs`: one of the three by name (``"gdn"``, ``"kda"``, ``"kdn"``);
* :func:`two_key_inputs`, :func:`gain_inputs`: the arguments of the kernels beneath KDA and
  Diag-KDN (``lowering/two_key*.py``, ``lowering/kalman_gain*.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _generator(seed) -> torch.Generator:
    return seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)


def _drawing(gen):
    """Standard normal and uniform ``[0, 1)`` float64 draws from ``gen``."""
    def normal(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def uniform(*shape):
        return torch.rand(*shape, generator=gen, dtype=torch.float64)

    return normal, uniform


def delta_inputs(B=2, T=37, Hk=2, Hv=4, K=8, V=6, *, per_key=False, seed=0,
                 dtype=torch.float64, device="cpu", requires_grad=False, gate_scale=1.0,
                 with_state=True, state_v_first=False, N=None, raw=False):
    """GDN's inputs, or KDA's with ``per_key``: unit-norm ``q, k [B, T, Hk, K]`` (``Hv``
    value heads share them in groups), ``v [B, T, Hv, V]``, log decays ``g`` in
    ``(-gate_scale, 0]``, ``[B, T, Hv]`` or, ``per_key``, ``[B, T, Hv, K]``, ``beta`` in
    ``[0, 1)``; with ``with_state`` an ``initial_state`` of ``N`` (default ``B``) rows,
    ``[N, Hv, K, V]`` or, ``state_v_first``, ``[N, Hv, V, K]``.

    ``raw``: the pre-activation inputs FLA's functions also take: ``q, k`` not normalized,
    ``g`` (a gate's input) and ``beta`` (logits) standard normal.
    """
    normal, uniform = _drawing(_generator(seed))
    gate = (B, T, Hv, K) if per_key else (B, T, Hv)
    q, k, v = normal(B, T, Hk, K), normal(B, T, Hk, K), normal(B, T, Hv, V)
    if raw:
        x = {"q": q, "k": k, "v": v, "g": normal(*gate), "beta": normal(B, T, Hv)}
    else:
        x = {"q": F.normalize(q, dim=-1), "k": F.normalize(k, dim=-1), "v": v,
             "g": -gate_scale * uniform(*gate), "beta": uniform(B, T, Hv)}
    if with_state:
        N = B if N is None else N
        x["initial_state"] = normal(N, Hv, V, K) if state_v_first else normal(N, Hv, K, V)
    return {n: t.to(device=device, dtype=dtype).requires_grad_(requires_grad)
            for n, t in x.items()}


def kdn_inputs(B=2, T=29, H=2, K=8, V=6, *, seed=0, dtype=torch.float64, device="cpu",
               requires_grad=False, N=None):
    """Diag-KDN's inputs through the spec's own noise map and normalization: ``q, k, v``,
    ``log_alpha, omega, r`` and the states ``memory [N, H, K, V]``, ``precision [N, H, K]``
    of ``N`` (default ``B``) rows."""
    from kdn_compile.reference import kalman_noise, normalize_query_key

    gen = _generator(seed)
    normal, uniform = _drawing(gen)
    N = B if N is None else N
    q, k = normalize_query_key(normal(B, T, H, K), normal(B, T, H, K))
    log_alpha, omega, r, prior = kalman_noise(
        normal(B, T, H, K), normal(B, T, H, K) - 2, normal(B, T, H), 0.3 * normal(H),
        0.5 * normal(H * K), normal(H)
    )
    x = {
        "q": q, "k": k, "v": normal(B, T, H, V), "log_alpha": log_alpha, "omega": omega, "r": r,
        "memory": 0.5 * normal(N, H, K, V),
        "precision": prior.abs()[None, :, None].expand(N, H, K) + 0.1 * uniform(N, H, K),
    }
    return {n: t.to(device=device, dtype=dtype).contiguous().requires_grad_(requires_grad)
            for n, t in x.items()}


def family_inputs(family: str, B, T, *, heads=2, K=8, V=6, **options):
    """:func:`delta_inputs` (``"gdn"``, ``"kda"``: ``heads`` query-key heads, twice as many
    value heads) or :func:`kdn_inputs` (``"kdn"``: ``heads`` heads); ``options`` go to it."""
    if family == "kdn":
        return kdn_inputs(B, T, heads, K, V, **options)
    return delta_inputs(B, T, heads, 2 * heads, K, V, per_key=family == "kda", **options)


def two_key_inputs(B, T, Hk, Hv, K, V, *, N=None, seed=0, gate_min=-1.0, floor_share=0.0,
                   with_state=True, state_v_first=False):
    """float64 arguments of the two-key kernels: unit ``q, k``, ``w = beta k`` (per value
    head), ``log_decay`` in ``(gate_min, 0]``, ``initial_state`` (None without
    ``with_state``).

    A ``floor_share`` of the gates sits exactly at ``gate_min`` (the safety bound).
    """
    normal, uniform = _drawing(_generator(seed))
    q = F.normalize(normal(B, T, Hk, K), dim=-1)
    k = F.normalize(normal(B, T, Hk, K), dim=-1)
    w = k.repeat_interleave(Hv // Hk, 2) * uniform(B, T, Hv, 1)
    g = gate_min * uniform(B, T, Hv, K)
    g = torch.where(uniform(B, T, Hv, K) < floor_share, torch.full_like(g, gate_min), g)
    n = B if N is None else N
    state = None
    if with_state:
        state = normal(n, Hv, V, K) if state_v_first else normal(n, Hv, K, V)
    return {"q": q, "k": k, "w": w, "v": normal(B, T, Hv, V), "log_decay": g,
            "initial_state": state}


def gain_inputs(B, T, H, K, *, N=None, seed=0, log_alpha_min=-3.0, r_min=0.01):
    """float64 arguments ``(k, log_alpha, omega, r, precision)`` of the Kalman gain kernels:
    unit ``k``, ``log_alpha`` in ``(log_alpha_min, 0]``, ``r`` from ``r_min``, ``precision``
    of ``N`` (default ``B``) rows."""
    normal, uniform = _drawing(_generator(seed))
    k = F.normalize(normal(B, T, H, K), dim=-1)
    log_alpha = log_alpha_min * uniform(B, T, H, K)
    omega = 2.0 * uniform(B, T, H, K)
    r = r_min + uniform(B, T, H)
    precision = 0.1 + 2.0 * uniform(N or B, H, K)
    return k, log_alpha, omega, r, precision
