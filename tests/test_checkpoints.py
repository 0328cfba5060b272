"""Prefix-cache checkpoints (:func:`kdn_compile.chunk_checkpoints`): the prefill's outputs
are the chunked op's, each kept slot holds the state of its sequence's prefix, nothing
else in the pool moves, and a prompt resumed from a checkpoint continues the whole one.
On the CPU: the references and the kernels in Triton's interpreter, eager and compiled;
argument errors. The bit-for-bit resume on CUDA: tests/test_checkpoints_gpu.py."""

from __future__ import annotations

import pytest
import torch

import kdn_compile
from _helpers import assert_close, interpreting
from _inputs import delta_inputs
from kdn_compile.reference import chunk_gdn_reference, chunk_kda_reference
from kdn_compile.reference.checkpoints import chunk_checkpoints_reference
from kdn_compile.reference.fp8 import dequantize_state_fp8

FP8 = torch.float8_e4m3fn
HK, HV, K, V, S = 2, 4, 16, 16, 14
CU = [0, 64, 64, 200, 329]  # an empty sequence, one of exactly one checkpoint, ragged ends
SLOTS = [[0, 1, 2], [3, 4, -1], [5, 6, 7], [8, 9, 10]]
EVERY = 64


def _inputs(per_key, seed, dtype=torch.float32):
    print(f"seed {seed}")
    x = delta_inputs(B=1, T=CU[-1], Hk=HK, Hv=HV, K=K, V=V, per_key=per_key, dtype=dtype,
                     with_state=False, seed=seed)
    h0 = torch.randn(len(CU) - 1, HV, K, V, generator=torch.Generator().manual_seed(seed),
                     dtype=dtype)
    return x, h0


def _pool(dtype, seed):
    gen = torch.Generator().manual_seed(seed + 1)
    pool = torch.randn(S, HV, K, V, generator=gen)
    if dtype == FP8:
        return pool.to(FP8), torch.rand(S, HV, 1, generator=gen) + 0.5
    return pool.to(dtype), None


def _prefix_state(x, h0, n, tokens):
    """float64 state of sequence ``n`` after its first ``tokens`` tokens, run alone."""
    run = chunk_kda_reference if x["g"].dim() == 4 else chunk_gdn_reference
    part = {name: t[:, CU[n]:CU[n] + tokens].double() for name, t in x.items()}
    return run(*part.values(), initial_state=h0[n:n + 1].double())[1][0]


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, FP8],
                         ids=["f32", "bf16", "fp8"])
@pytest.mark.parametrize("per_key", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_checkpoints_hold_each_prefix_state(backend, per_key, pool_dtype, seed):
    if backend == "triton" and not (interpreting() or torch.cuda.is_available()):
        pytest.skip("the kernels need CUDA or TRITON_INTERPRET=1")
    x, h0 = _inputs(per_key, seed)
    pool, scales = _pool(pool_dtype, seed)
    before = pool.clone()
    slots = torch.tensor(SLOTS)
    cu = torch.tensor(CU)
    plain = kdn_compile.chunk_kda if per_key else kdn_compile.chunk_gdn
    with kdn_compile.use_backend(backend), torch.no_grad():
        o, final = kdn_compile.chunk_checkpoints(
            *x.values(), pool, slots, checkpoint_every=EVERY, initial_state=h0,
            cu_seqlens=cu, pool_scales=scales)
        o_plain, final_plain = plain(*x.values(), initial_state=h0, cu_seqlens=cu)
    assert torch.equal(o, o_plain) and torch.equal(final, final_plain)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -8, FP8: 0.07}[pool_dtype]
    kept = set()
    for n, row in enumerate(SLOTS):
        for c, slot in enumerate(row):
            if slot < 0 or (c + 1) * EVERY > CU[n + 1] - CU[n]:
                continue
            kept.add(slot)
            got = (dequantize_state_fp8(pool[slot:slot + 1], scales[slot:slot + 1])[0]
                   if pool_dtype == FP8 else pool[slot].double())
            assert_close(got, _prefix_state(x, h0, n, (c + 1) * EVERY), tol, f"slot {slot}")
    assert kept == {0, 5, 6, 8, 9}
    for slot in set(range(S)) - kept:
        assert torch.equal(pool[slot].view(torch.uint8), before[slot].view(torch.uint8)), slot


@pytest.mark.parametrize("per_key", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_prompt_resumed_from_a_checkpoint_continues_the_whole_one(backend, per_key, seed):
    if backend == "triton" and not (interpreting() or torch.cuda.is_available()):
        pytest.skip("the kernels need CUDA or TRITON_INTERPRET=1")
    x, h0 = _inputs(per_key, seed)
    pool, _ = _pool(torch.float32, seed)
    plain = kdn_compile.chunk_kda if per_key else kdn_compile.chunk_gdn
    with kdn_compile.use_backend(backend), torch.no_grad():
        o, final = kdn_compile.chunk_checkpoints(
            *x.values(), pool, torch.tensor(SLOTS), checkpoint_every=EVERY,
            initial_state=h0, cu_seqlens=torch.tensor(CU))
        # sequence 3 (tokens 200..329) resumed after 128 tokens, from slot 9
        rest = {name: t[:, CU[3] + 128:CU[4]] for name, t in x.items()}
        o_rest, final_rest = plain(*rest.values(), initial_state=pool[9:10])
    assert_close(o_rest, o[:, CU[3] + 128:CU[4]], 1e-5, "outputs")
    assert_close(final_rest[0], final[3], 1e-5, "final state")


def test_reference_keeps_the_chunked_outputs_and_zeros_past_the_end(seed):
    x, h0 = _inputs(True, seed, torch.float64)
    cu = torch.tensor(CU)
    o, final, states = chunk_checkpoints_reference(
        *x.values(), checkpoint_every=128, checkpoints=2, initial_state=h0, cu_seqlens=cu)
    o_plain, final_plain = chunk_kda_reference(*x.values(), initial_state=h0, cu_seqlens=cu)
    assert torch.equal(o, o_plain) and torch.equal(final, final_plain)
    assert states.shape == (4, 2, HV, K, V) and states.dtype == torch.float64
    assert_close(states[2, 0], _prefix_state(x, h0, 2, 128), 1e-12, "sequence 2")
    assert_close(states[3, 0], _prefix_state(x, h0, 3, 128), 1e-12, "sequence 3")
    for n, c in ((0, 0), (0, 1), (1, 0), (1, 1), (2, 1), (3, 1)):
        assert not states[n, c].any(), (n, c)


def test_compiles_fullgraph_without_host_syncs(seed):
    x, h0 = _inputs(False, seed)
    pool, _ = _pool(torch.float32, seed)
    slots, cu = torch.tensor(SLOTS), torch.tensor(CU)

    def prefill(pool, q, k, v, g, beta):
        return kdn_compile.chunk_checkpoints(q, k, v, g, beta, pool, slots,
                                             checkpoint_every=EVERY, initial_state=h0,
                                             cu_seqlens=cu)

    compiled = torch.compile(prefill, fullgraph=True, dynamic=True)
    with torch.no_grad():
        eager_pool, compiled_pool = pool.clone(), pool.clone()
        o, final = prefill(eager_pool, *x.values())
        o_c, final_c = compiled(compiled_pool, *x.values())
    assert_close(o_c, o, 1e-6, "outputs")
    assert_close(final_c, final, 1e-6, "final state")
    assert_close(compiled_pool, eager_pool, 1e-6, "pool")


@pytest.mark.parametrize("change,error,match", [
    (dict(checkpoint_every=100), ValueError, "checkpoint_every must be a positive multiple"),
    (dict(checkpoint_every=0), ValueError, "checkpoint_every must be a positive multiple"),
    (dict(checkpoint_every=2**70), ValueError, r"below 2\*\*31"),
    (dict(checkpoint_every=64.0), TypeError, "checkpoint_every must be an int"),
    (dict(checkpoint_indices=torch.zeros(3, 2, dtype=torch.int64)), ValueError,
     r"checkpoint_indices must be \[N, C\] with N = 4"),
    (dict(checkpoint_indices=torch.zeros(4, 2)), TypeError,
     "checkpoint_indices must be int32 or int64"),
    (dict(checkpoint_indices=[[0]]), TypeError, "checkpoint_indices must be a torch.Tensor"),
    (dict(state_pool=torch.zeros(S, HV, K, V + 1)), ValueError, "state_pool"),
])
def test_argument_errors_name_the_argument(change, error, match):
    x, h0 = _inputs(False, 0)
    args = dict(state_pool=torch.zeros(S, HV, K, V), checkpoint_indices=torch.tensor(SLOTS),
                checkpoint_every=EVERY)
    args.update(change)
    with pytest.raises(error, match=match), torch.no_grad():
        kdn_compile.chunk_checkpoints(*x.values(), args.pop("state_pool"),
                                      args.pop("checkpoint_indices"), initial_state=h0,
                                      cu_seqlens=torch.tensor(CU), **args)


def test_refuses_inputs_that_require_grad():
    x, h0 = _inputs(False, 0)
    x["v"].requires_grad_()
    with pytest.raises(RuntimeError, match="inference only"):
        kdn_compile.chunk_checkpoints(*x.values(), torch.zeros(S, HV, K, V),
                                      torch.tensor(SLOTS), checkpoint_every=EVERY,
                                      initial_state=h0, cu_seqlens=torch.tensor(CU))


def test_repeated_slots_fail_on_the_device():
    x, h0 = _inputs(False, 0)
    slots = torch.tensor([[0, 1, 2], [3, 4, -1], [5, 0, 7], [8, 9, 10]])
    with pytest.raises(RuntimeError, match="must not repeat"), torch.no_grad():
        kdn_compile.chunk_checkpoints(*x.values(), torch.zeros(S, HV, K, V), slots,
                                      checkpoint_every=EVERY, initial_state=h0,
                                      cu_seqlens=torch.tensor(CU))


# -- the layers' step --------------------------------------------------------------------

D = 24


def _layer(name, dtype=torch.float64):
    from kdn_compile.layers import DiagKDN, GatedDeltaNet, KimiDeltaAttention

    torch.manual_seed(0)
    make = {"gdn": lambda: GatedDeltaNet(D, 2, 8, num_v_heads=4, head_v_dim=6),
            "kda": lambda: KimiDeltaAttention(D, 2, 8, head_v_dim=6),
            "kdn": lambda: DiagKDN(D, 2, 8, head_v_dim=6)}[name]
    return make().to(dtype)


@pytest.mark.parametrize("state_dtype", [torch.float64, torch.bfloat16], ids=["f64", "bf16"])
@pytest.mark.parametrize("name", ["gdn", "kda", "kdn"])
def test_layer_step_keeps_checkpoints_that_resume_the_prompt(name, state_dtype, seed):
    print(f"seed {seed}")
    layer = _layer(name)
    x = torch.randn(1, CU[-1], D, generator=torch.Generator().manual_seed(seed),
                    dtype=torch.float64)
    cu = torch.tensor(CU)
    with torch.no_grad():
        cache = layer.allocate_cache(S, state_dtype=state_dtype)
        plain = {n: p.clone() for n, p in cache.items()}
        own = torch.tensor([11, 12, -1, 13])  # sequence 2 is a padding row
        y = layer.step(x, cache, own, cu, checkpoint_indices=torch.tensor(SLOTS),
                       checkpoint_every=EVERY)
        y_plain = layer.step(x, plain, own, cu)
        assert torch.equal(y, y_plain)
        for n, p in cache.items():  # the sequences' own slots as without checkpoints
            assert torch.equal(p[[11, 12, 13]], plain[n][[11, 12, 13]]), n
        # kept: sequence 0 after 64 tokens (slot 0), sequence 3 after 64 and 128 (8, 9)
        for slot in set(range(11)) - {0, 8, 9}:
            for n, p in cache.items():
                assert torch.equal(p[slot], plain[n][slot]), (n, slot)
        # sequence 3 resumed from slot 9 in slot 10: the rest of its prompt
        layer.copy_slots(cache, torch.tensor([9]), torch.tensor([10]))
        a = CU[3] + 2 * EVERY
        y_rest = layer.step(x[:, a:CU[4]], cache, torch.tensor([10]))
    tol = 1e-12 if state_dtype == torch.float64 else 2e-2
    if name == "kdn" and state_dtype == torch.bfloat16:
        tol = 5e-2  # a bfloat16 memory pool; the precision pool stays float32
    assert_close(y_rest, y[:, a:CU[4]], tol, "resumed outputs")
    for n, p in cache.items():
        assert_close(p[10].double(), p[13].double(), tol, f"resumed {n}")


def test_quantized_layers_keep_no_checkpoints_and_say_so():
    from kdn_compile.layers import GatedDeltaNet

    x = torch.randn(1, 64, D, dtype=torch.float64)
    layer = GatedDeltaNet(D, 2, 8, num_v_heads=4, head_v_dim=6, state_qdq=True).double()
    cache = layer.allocate_cache(4)
    with pytest.raises(NotImplementedError, match="keeps no prefix-cache checkpoints"):
        layer.step(x, cache, torch.tensor([0]), checkpoint_indices=torch.tensor([[1]]),
                   checkpoint_every=64)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_diag_kdn_checkpoints_hold_each_prefix_state(backend, seed):
    if backend == "triton" and not (interpreting() or torch.cuda.is_available()):
        pytest.skip("the kernels need CUDA or TRITON_INTERPRET=1")
    from _inputs import kdn_inputs
    from kdn_compile.checkpoints import diag_kdn_prefill_states
    from kdn_compile.reference import diag_kdn_reference

    print(f"seed {seed}")
    kd = kdn_inputs(B=1, T=CU[-1], H=2, K=16, V=16, dtype=torch.float32, N=4, seed=seed)
    args = [kd[n] for n in ("q", "k", "v", "log_alpha", "omega", "r", "memory", "precision")]
    cu = torch.tensor(CU)
    with kdn_compile.use_backend(backend), torch.no_grad():
        o, memory, precision, memories, precisions = diag_kdn_prefill_states(
            *args, checkpoint_every=EVERY, checkpoints=3, scale=0.25, info_scale=0.8,
            cu_seqlens=cu)
        o_plain, memory_plain, precision_plain = kdn_compile.diag_kdn(
            *args, scale=0.25, info_scale=0.8, cu_seqlens=cu)
    assert torch.equal(o, o_plain) and torch.equal(memory, memory_plain)
    assert torch.equal(precision, precision_plain)
    memories, precisions = memories.view(4, 3, 2, 16, 16), precisions.view(4, 3, 2, 16)
    for n, c in ((0, 0), (2, 0), (2, 1), (3, 0), (3, 1)):
        m = (c + 1) * EVERY
        head = [t[:, CU[n]:CU[n] + m].double() for t in args[:6]]
        _, m64, p64 = diag_kdn_reference(*head, args[6][n:n + 1].double(),
                                         args[7][n:n + 1].double(), scale=0.25, info_scale=0.8)
        assert_close(memories[n, c], m64[0], 1e-5, f"memory {n}, {c}")
        assert_close(precisions[n, c], p64[0], 1e-5, f"precision {n}, {c}")
    for n, c in ((0, 1), (0, 2), (1, 0), (2, 2), (3, 2)):
        assert not memories[n, c].any() and not precisions[n, c].any(), (n, c)


@pytest.mark.parametrize("change,error,match", [
    (dict(checkpoint_every=None), ValueError, "go together"),
    (dict(checkpoint_indices=None), ValueError, "go together"),
    (dict(checkpoint_every=32), ValueError, "checkpoint_every must be a positive multiple"),
    (dict(checkpoint_indices=torch.tensor([[0, 1]])), ValueError, "N = 2 sequences"),
])
def test_layer_checkpoint_arguments_are_checked(change, error, match):
    layer = _layer("gdn")
    cache = layer.allocate_cache(6)
    args = dict(checkpoint_indices=torch.tensor([[2], [3]]), checkpoint_every=64)
    args.update(change)
    with pytest.raises(error, match=match):
        layer.step(torch.zeros(2, 64, D, dtype=torch.float64), cache, torch.tensor([0, 1]),
                   **args)


def test_a_checkpoint_slot_may_not_be_a_sequence_slot():
    layer = _layer("gdn")
    cache = layer.allocate_cache(6)
    with pytest.raises(RuntimeError, match=r"checkpoint_indices \(with state_indices\) must be <"):
        layer.step(torch.zeros(2, 64, D, dtype=torch.float64), cache, torch.tensor([0, 1]),
                   checkpoint_indices=torch.tensor([[2], [0]]), checkpoint_every=64)


def test_compiled_layer_step_with_checkpoints_equals_eager(seed):
    layer = _layer("kda", torch.float32)
    x = torch.randn(1, CU[-1], D, generator=torch.Generator().manual_seed(seed))
    cu, own, slots = torch.tensor(CU), torch.tensor([11, 12, 13, 10]), torch.tensor(SLOTS)
    step = torch.compile(layer.step, fullgraph=True, dynamic=True)
    with torch.no_grad():
        eager, compiled = layer.allocate_cache(S), layer.allocate_cache(S)
        y = layer.step(x, eager, own, cu, checkpoint_indices=slots, checkpoint_every=EVERY)
        y_c = step(x, compiled, own, cu, checkpoint_indices=slots, checkpoint_every=EVERY)
    assert_close(y_c, y, 1e-5, "outputs")
    for n in eager:
        assert_close(compiled[n], eager[n], 1e-5, n)


def test_no_checkpoint_columns_write_nothing():
    x = delta_inputs(B=2, T=130, Hk=HK, Hv=HV, K=K, V=V, with_state=False, seed=3,
                     dtype=torch.float32)
    pool = torch.randn(S, HV, K, V)
    before = pool.clone()
    with torch.no_grad():
        o, final = kdn_compile.chunk_checkpoints(*x.values(), pool,
                                                 torch.zeros(2, 0, dtype=torch.int64),
                                                 checkpoint_every=EVERY)
        o_plain, final_plain = kdn_compile.chunk_gdn(*x.values())
    assert torch.equal(o, o_plain) and torch.equal(final, final_plain)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("scale,error", [(float("nan"), ValueError), (True, TypeError),
                                         ("a", TypeError)])
def test_scale_is_checked(scale, error):
    x, h0 = _inputs(False, 0)
    with pytest.raises(error, match="scale"), torch.no_grad():
        kdn_compile.chunk_checkpoints(*x.values(), torch.zeros(S, HV, K, V),
                                      torch.tensor(SLOTS), checkpoint_every=EVERY,
                                      initial_state=h0, cu_seqlens=torch.tensor(CU),
                                      scale=scale)


def test_a_window_longer_than_the_checkpoint_spacing_is_refused():
    from kdn_compile.layers import GatedDeltaNet

    layer = GatedDeltaNet(D, 2, 8, num_v_heads=4, head_v_dim=6, conv_size=66).double()
    cache = layer.allocate_cache(4)
    with pytest.raises(ValueError, match="checkpoint_every must be at least the convolution"):
        layer.step(torch.zeros(1, 128, D, dtype=torch.float64), cache, torch.tensor([0]),
                   checkpoint_indices=torch.tensor([[1]]), checkpoint_every=64)
