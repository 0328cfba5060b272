"""The eager launcher's cache key against Triton's own specialization (CPU).

:class:`kdn_compile.lowering._direct.DirectKernel` reuses a compiled kernel for every
call with the same :func:`~kdn_compile.lowering._direct.launch_key`. That is only right
if calls that Triton specializes differently never share a key: checked here against
the binder Triton builds for an sm_90 target, over tensors of every alignment, integers
around the values Triton singles out, floats and None.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from kdn_compile.lowering._direct import launch_key  # noqa: E402


def _kernel(x, y, n, m, s, BLOCK: "triton.language.constexpr"):  # signature only
    pass


def _specialization(args, kwargs):
    fn = JITFunction(_kernel)
    binder = create_function_from_signature(fn.signature, fn.params,
                                            make_backend(GPUTarget("cuda", 90, 32)))
    _, spec, options = binder(*args, **kwargs)
    return str(spec) + str(options)


def test_calls_that_triton_specializes_apart_never_share_a_key():
    seed = random.randrange(2**31)
    print("seed", seed)
    rng = random.Random(seed)
    storage = torch.zeros(64, dtype=torch.bfloat16)
    tensors = [storage[i:] for i in (0, 1, 4, 8)] + [storage.float(), None]
    ints = [0, 1, 2, 15, 16, 17, 48, 2**31 - 16, 2**31, 2**32, 2**63, -1, -16, -(2**31) - 16]
    calls = []
    for x, y in itertools.product(tensors, repeat=2):
        n, m = rng.choice(ints), rng.choice(ints)
        kwargs = {"BLOCK": rng.choice((16, 32)), "num_warps": rng.choice((1, 4))}
        calls.append(((x, y, n, m, rng.choice((0.5, 1.0, 3.0))), kwargs))
    calls += [((tensors[0], tensors[1], n, 16, 1.0), {"BLOCK": 16, "num_warps": 1}) for n in ints]
    by_key: dict = {}
    for args, kwargs in calls:
        by_key.setdefault(launch_key(args, kwargs), set()).add(_specialization(args, kwargs))
    shared = {k: v for k, v in by_key.items() if len(v) > 1}
    assert not shared, f"one key for several Triton specializations: {shared}"
    # and the key is not trivially fine: distinct specializations did occur
    assert len(set().union(*by_key.values())) > 10


def test_direct_launches_only_where_no_launch_hook_is_installed(monkeypatch):
    from triton import knobs

    from kdn_compile.lowering._direct import launch_hooked

    assert not launch_hooked()  # Triton's default: an empty chain
    chain = knobs.runtime.launch_enter_hook
    monkeypatch.setattr(chain, "calls", [lambda metadata: None])
    assert launch_hooked()
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    assert not launch_hooked()
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
    assert launch_hooked()
