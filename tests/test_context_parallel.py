"""Context parallelism (kdn_compile.distributed.chunk_gdn / chunk_kda / diag_kdn).

The math, rank by rank in one process (float64, every rank's slice work and the
chaining the exchange ops run): outputs, final states and every gradient equal the
single-device function's. Then the real thing, 2 and 4 gloo processes on the CPU
(float32): the same against the single-device function, and a compiled training
step with fullgraph=True.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _context_parallel import emulate_delta, emulate_kdn
from _distributed import local_slice, spawn
from _helpers import assert_close
from _inputs import delta_inputs, family_inputs, kdn_inputs

import kdn_compile
import kdn_compile.distributed as kd

T = 24  # tokens of the whole sequence; every world size below divides it
KDN_OPTIONS = dict(scale=0.35, info_scale=0.7)
# Packed sequences: an empty one, a sequence across every boundary of 2, 3 and 4 ranks
# (12; 8 and 16; 6, 12 and 18), an empty one at the end
PACKED = [0, 5, 5, 10, 13, 24, 24]
# sequences that end and start on the boundaries of 4 ranks (6, 12), one across 18
BOUNDARIES = [0, 6, 12, 20, 24]


def _grads(loss, x):
    names = [n for n, t in x.items() if t.requires_grad]
    return dict(zip(names, torch.autograd.grad(loss, [x[n] for n in names])))


def _slow(x: dict, gate: str) -> dict:
    """``x`` with its decays ``x[gate]`` a fifth as fast: each rank's state reaches the next
    ranks' outputs with more weight."""
    return {n: (t.detach() * 0.2).requires_grad_(t.requires_grad) if n == gate else t
            for n, t in x.items()}


def _weights(*like, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype) for t in like]


# -- the math, one process --------------------------------------------------------------


@pytest.mark.parametrize("family", ["gdn", "kda"])
@pytest.mark.parametrize("world, cu_seqlens, state_v_first", [
    (2, None, False), (3, PACKED, True), (4, PACKED, False), (4, BOUNDARIES, False),
    (4, [0, 1, 24], False)],
    ids=["fixed-2", "packed-3-v-first", "packed-4", "boundaries-4", "spans-all-4"])
def test_emulated_delta_rule_equals_one_device(family, world, cu_seqlens, state_v_first):
    run = kdn_compile.chunk_kda if family == "kda" else kdn_compile.chunk_gdn
    packed = cu_seqlens is not None
    x = _slow(delta_inputs(B=1 if packed else 2, T=T, N=len(cu_seqlens) - 1 if packed else None,
                           per_key=family == "kda", requires_grad=True,
                           state_v_first=state_v_first), "g")
    options = dict(chunk_size=4, state_v_first=state_v_first,
                   cu_seqlens=torch.tensor(cu_seqlens) if packed else None)
    o, state = run(**x, **options)
    w, wf = _weights(o, state)
    # every rank adds the final-state term: once per rank on the single device
    expected = _grads((o * w).sum() + world * (state * wf).sum(), x)
    o_cp, states = emulate_delta(run, world, **x, **options)
    assert_close(o_cp, o, 1e-13, "o")
    for rank, s in enumerate(states):
        assert_close(s, state, 1e-13, f"final state on rank {rank}")
    found = _grads((o_cp * w).sum() + sum((s * wf).sum() for s in states), x)
    for name, grad in expected.items():
        assert_close(found[name], grad, 1e-12, f"d{name}")


@pytest.mark.parametrize("world, cu_seqlens", [
    (2, None), (4, PACKED), (4, BOUNDARIES), (3, [0, 1, 23, 24])],
    ids=["fixed-2", "packed-4", "boundaries-4", "short-ends-3"])
def test_emulated_diag_kdn_equals_one_device(world, cu_seqlens):
    packed = cu_seqlens is not None
    x = _slow(kdn_inputs(B=1 if packed else 2, T=T, N=len(cu_seqlens) - 1 if packed else None,
                         requires_grad=True), "log_alpha")
    options = dict(KDN_OPTIONS, chunk_size=4,
                   cu_seqlens=torch.tensor(cu_seqlens) if packed else None)
    o, memory, precision = kdn_compile.diag_kdn(**x, **options)
    w, wm, wp = _weights(o, memory, precision)
    expected = _grads((o * w).sum() + world * ((memory * wm).sum() + (precision * wp).sum()), x)
    o_cp, memories, precisions = emulate_kdn(world, **x, **options)
    assert_close(o_cp, o, 1e-13, "o")
    for rank, (m, p) in enumerate(zip(memories, precisions)):
        assert_close(m, memory, 1e-13, f"memory on rank {rank}")
        assert_close(p, precision, 1e-13, f"precision on rank {rank}")
    loss = (o_cp * w).sum() + sum((m * wm).sum() + (p * wp).sum()
                                  for m, p in zip(memories, precisions))
    found = _grads(loss, x)
    for name, grad in expected.items():
        assert_close(found[name], grad, 1e-11, f"d{name}")


# -- argument checks and the exchange ops, in a one-rank group ----------------------------


@pytest.mark.parametrize("function", [kd.chunk_gdn, kd.chunk_kda, kd.diag_kdn],
                         ids=lambda function: function.__name__)
def test_same_cu_seqlens_on_every_rank_is_a_documented_unchecked_contract(function):
    """Comparing the ranks' cu_seqlens would take a collective and a host sync on every call:
    the docstrings and the distributed page say that every rank must pass the same ones and
    that this is not checked."""
    doc = " ".join(function.__doc__.split())
    assert "Every rank must pass the same cu_seqlens (the same ``N`` and the same values)" in doc
    assert "the ranks' tensors are not compared" in doc
    assert "without an error" in doc
    page = " ".join((Path(__file__).parent.parent / "docs" / "distributed.md").read_text().split())
    assert "Every rank must pass the same `cu_seqlens`, and this is not checked." in page


def test_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    x = delta_inputs(B=1, T=4, with_state=False)
    with pytest.raises(RuntimeError, match="init_process_group"):
        kd.chunk_gdn(**x)


@pytest.fixture
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}",
                                rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def test_bad_arguments_are_refused(one_rank_group):
    x = delta_inputs(B=1, T=8, N=2)
    with pytest.raises(ValueError, match="state_qdq"):
        kd.chunk_gdn(**x, cu_seqlens=torch.tensor([0, 3, 8]), state_qdq=True)
    with pytest.raises(TypeError, match="ProcessGroup"):
        kd.chunk_gdn(**x, cu_seqlens=torch.tensor([0, 3, 8]), group="world")
    with pytest.raises(ValueError, match="end at T = 8"):  # the global length, R L
        kd.chunk_gdn(**x, cu_seqlens=torch.tensor([0, 3, 7]))
    with pytest.raises(ValueError, match="initial_state must have shape"):
        kd.chunk_kda(**delta_inputs(B=1, T=8, N=3, per_key=True),
                     cu_seqlens=torch.tensor([0, 3, 8]))
    with pytest.raises(TypeError, match="state_qdq must be a bool, got int"):
        kd.chunk_gdn(**x, cu_seqlens=torch.tensor([0, 3, 8]), state_qdq=0)


@pytest.mark.parametrize("change,error,message", [
    ({"state_qdq": True}, ValueError, "does not take state_qdq=True"),
    ({"group": "world"}, TypeError,
     "group must be a torch.distributed.ProcessGroup or None, got str"),
])
def test_bad_arguments_are_refused_compiled(one_rank_group, change, error, message):
    """Under ``torch.compile(fullgraph=True)`` the same errors, message first."""
    x = delta_inputs(B=1, T=8, N=2)
    torch._dynamo.reset()
    call = torch.compile(lambda **kw: kd.chunk_gdn(**kw), fullgraph=True, backend="eager")
    with pytest.raises(error, match=message):
        call(**x, cu_seqlens=torch.tensor([0, 3, 8]), **change)


def test_exchange_ops_pass_opcheck(one_rank_group):
    name = one_rank_group.group_name
    gen = torch.Generator().manual_seed(0)
    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)

    # the packed description of one rank: no sequence continues into it
    chain = (torch.tensor([0]), torch.tensor([False]), torch.tensor([[False, False]]))
    state_args = (r(1, 5, 2, 3), None, r(2, 2, 4, 3), r(1, 2, 4, 4), r(2, 2, 4), *chain, name)
    torch.library.opcheck(torch.ops.kdn.context_state_exchange.default, state_args)
    maps = r(1, 2, 4, 4)
    torch.library.opcheck(torch.ops.kdn.context_covariance_exchange.default,
                          (maps, r(2, 2, 4), *chain[:2], name))


def test_one_rank_equals_the_plain_function(one_rank_group):
    x = kdn_inputs(B=1, T=8, N=2, dtype=torch.float32)
    cu_seqlens = torch.tensor([0, 3, 8])
    expected = kdn_compile.diag_kdn(**x, **KDN_OPTIONS, cu_seqlens=cu_seqlens)
    found = kd.diag_kdn(**x, **KDN_OPTIONS, cu_seqlens=cu_seqlens, group=one_rank_group)
    for a, b, what in zip(found, expected, ("o", "memory", "precision")):
        assert_close(a, b, 1e-6, what)


# -- gloo processes ------------------------------------------------------------------------


def _call(module, family, x, packed, group=None):
    cu_seqlens = torch.tensor(PACKED) if packed else None
    extra = {} if group is None else {"group": group}
    if family == "kdn":
        return module.diag_kdn(**x, **KDN_OPTIONS, chunk_size=4, cu_seqlens=cu_seqlens, **extra)
    run = module.chunk_kda if family == "kda" else module.chunk_gdn
    return run(**x, chunk_size=4, cu_seqlens=cu_seqlens, **extra)


def _loss(outputs, weights, final_scale=1.0):
    o, *finals = outputs
    return (o * weights[0]).sum() + final_scale * sum(
        (f * w).sum() for f, w in zip(finals, weights[1:]))


REPLICATED = ("initial_state", "memory", "precision")


def _errors_against_one_device(rank, world, family, packed, compiled=None):
    """Relative errors of this rank's outputs, final states and gradients."""
    from _helpers import rel_error

    x = _slow(family_inputs(family, 1 if packed else 2, T, N=len(PACKED) - 1 if packed else None,
                            dtype=torch.float32, requires_grad=True),
              "log_alpha" if family == "kdn" else "g")
    expected = _call(kdn_compile, family, x, packed)
    weights = _weights(*expected)
    expected_grads = _grads(_loss(expected, weights, final_scale=world), x)

    local = local_slice(x, rank, world, REPLICATED)
    length = T // world
    here = slice(rank * length, (rank + 1) * length)
    local_weights = [weights[0][:, here]] + weights[1:]

    def step(**leaves):
        outputs = _call(kd, family, leaves, packed)
        return outputs, _loss(outputs, local_weights)

    if compiled is not None:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        step = torch.compile(step, fullgraph=True, backend=compiled)
    outputs, loss = step(**local)
    grads = _grads(loss, local)
    errors = {"o": rel_error(outputs[0], expected[0][:, here])}
    errors.update({f"final {i}": rel_error(a, b) for i, (a, b) in
                   enumerate(zip(outputs[1:], expected[1:]))})
    for name, grad in grads.items():
        if name in REPLICATED:
            dist.all_reduce(grad)  # each rank's share of a replicated input's gradient
            errors[f"d{name}"] = rel_error(grad, expected_grads[name])
        else:
            errors[f"d{name}"] = rel_error(grad, expected_grads[name][:, here])
    if compiled is not None:
        errors["graph breaks"] = float(sum(torch._dynamo.utils.counters["graph_break"].values()))
    return errors


TWO_RANK_CASES = {f"{family}-{'packed' if packed else 'fixed'}": (family, packed, None)
                  for family in ("gdn", "kda", "kdn") for packed in (False, True)}
TWO_RANK_CASES.update({"gdn-fixed-compiled": ("gdn", False, "inductor"),
                       "kdn-packed-compiled": ("kdn", True, "aot_eager")})
FOUR_RANK_CASES = {"gdn-packed": ("gdn", True, None), "kdn-packed": ("kdn", True, None)}


def two_rank_worker(rank, world):
    return {name: _errors_against_one_device(rank, world, *case)
            for name, case in TWO_RANK_CASES.items()}


def four_rank_worker(rank, world):
    return {name: _errors_against_one_device(rank, world, *case)
            for name, case in FOUR_RANK_CASES.items()}


@pytest.fixture(scope="module")
def two_ranks():
    return spawn(two_rank_worker, 2)


@pytest.fixture(scope="module")
def four_ranks():
    return spawn(four_rank_worker, 4)


def _check(results, case):
    for rank, by_case in enumerate(results):
        for what, error in by_case[case].items():
            limit = 0.0 if what == "graph breaks" else 2e-5  # float32 rounding
            assert error <= limit, f"rank {rank}, {case}: {what} off by {error:.2e}"


@pytest.mark.parametrize("case", list(TWO_RANK_CASES))
def test_two_gloo_ranks_equal_one_device(two_ranks, case):
    _check(two_ranks, case)


@pytest.mark.parametrize("case", list(FOUR_RANK_CASES))
def test_four_gloo_ranks_equal_one_device(four_ranks, case):
    _check(four_ranks, case)
