"""The layers' serving path: slot pools, ``step`` (prefill, packed prefill, decode), padding
rows, reset, low-precision pools, ``torch.compile``, and the slot-writing op."""

from __future__ import annotations

import io

import pytest
import torch

import kdn_compile
from _helpers import assert_close, rel_error
from kdn_compile.layers import DiagKDN, GatedDeltaNet, KimiDeltaAttention, LayerCache
from kdn_compile.reference.pools import scatter_slots

D = 24
LAYERS = {
    "gdn": lambda: GatedDeltaNet(D, 2, 8, num_v_heads=4, head_v_dim=6, chunk_size=8),
    "kda": lambda: KimiDeltaAttention(D, 2, 8, head_v_dim=6, chunk_size=8),
    "kdn": lambda: DiagKDN(D, 2, 8, head_v_dim=6, chunk_size=8),
}
NAMES = sorted(LAYERS)


def make_layer(name, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return LAYERS[name]().to(dtype)


def inputs(B, T, dtype=torch.float64, seed=1):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def clone(cache):
    return {name: pool.clone() for name, pool in cache.items()}


def run_steps(layer, x, cache, indices, cuts):
    """``step`` over ``x [B, T, D]`` cut at ``cuts`` (a prefill, then decode steps)."""
    bounds = [0, *cuts, x.shape[1]]
    return torch.cat([layer.step(x[:, a:b], cache, indices) for a, b in zip(bounds, bounds[1:])],
                     dim=1)


# prefill of 13 (chunked), then 1, 3 and 1 tokens (decode steps), over 4 slots
CUTS = (13, 14, 17)


@pytest.mark.parametrize("name", NAMES)
def test_prefill_then_decode_steps_equal_one_pass(name):
    layer, x = make_layer(name), inputs(2, 18)
    with torch.no_grad():
        full, state = layer(x)
        cache = layer.allocate_cache(4, state_dtype=torch.float64)
        fresh = clone(cache)
        got = run_steps(layer, x, cache, torch.tensor([2, 0]), CUTS)
    assert_close(got, full, 1e-12, f"{name} step")
    key = "recurrent" if name != "kdn" else "memory"
    assert_close(cache[key][[2, 0]], state[key], 1e-12, f"{name} pooled state")
    if name == "kdn":
        assert_close(cache["precision"][[2, 0]], state["precision"], 1e-12, "precision")
    assert_close(cache["conv"][[2, 0]], state["conv"], 1e-12, f"{name} pooled conv window")
    for slot in (1, 3):  # never named: untouched
        for pool, before in zip(cache.values(), fresh.values()):
            assert torch.equal(pool[slot], before[slot]), f"{name} slot {slot} written"


@pytest.mark.parametrize("name", NAMES)
def test_kernels_in_the_interpreter_equal_one_pass(name):
    # float32 through the Triton kernels (interpreted on the CPU), int32 indices
    layer, x = make_layer(name, torch.float32), inputs(2, 18, torch.float32)
    with torch.no_grad(), kdn_compile.use_backend("triton"):
        full, _ = layer(x)
        cache = layer.allocate_cache(3)
        got = run_steps(layer, x, cache, torch.tensor([1, 2], dtype=torch.int32), CUTS)
    assert_close(got, full, 1e-5, f"{name} step on the kernels")


@pytest.mark.parametrize("name", NAMES)
def test_packed_prefill_then_decode(name):
    # lengths 5, 2 (shorter than the conv window) and 9 into slots 3, 0, 1; then one token each
    layer = make_layer(name)
    cu, slots = torch.tensor([0, 5, 7, 16]), torch.tensor([3, 0, 1])
    prompts, nxt = inputs(1, 16, seed=2), inputs(3, 1, seed=3)
    with torch.no_grad():
        cache = layer.allocate_cache(4, state_dtype=torch.float64)
        packed = layer.step(prompts, cache, slots, cu_seqlens=cu)
        decoded = layer.step(nxt, cache, slots)
        for n in range(3):
            span = slice(int(cu[n]), int(cu[n + 1]))
            want, state = layer(prompts[:, span])
            assert_close(packed[:, span], want, 1e-12, f"{name} packed sequence {n}")
            want, _ = layer(nxt[n : n + 1], state)
            assert_close(decoded[n : n + 1], want, 1e-12, f"{name} decode after packed {n}")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("length", [1, 11])
def test_padding_rows_give_zeros_and_touch_no_slot(name, length):
    layer, x = make_layer(name), inputs(3, length)
    slots = torch.tensor([2, -1, 0])
    with torch.no_grad():
        cache = layer.allocate_cache(4, state_dtype=torch.float64)
        layer.step(inputs(3, 5, seed=7), cache, torch.tensor([0, 1, 2]))  # not fresh
        before = clone(cache)
        y = layer.step(x, cache, slots)
        alone = layer.step(x[[0, 2]], before, slots[[0, 2]])
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    assert_close(y[[0, 2]], alone, 1e-12, f"{name} rows beside a padding row")
    for name_, pool in cache.items():
        assert torch.equal(pool[[1, 3]], before[name_][[1, 3]]), f"{name_}: unnamed slot written"


@pytest.mark.parametrize("name", NAMES)
def test_packed_padding_sequence(name):
    layer, x, cu = make_layer(name), inputs(1, 12), torch.tensor([0, 4, 9, 12])
    with torch.no_grad():
        cache = layer.allocate_cache(2, state_dtype=torch.float64)
        before = clone(cache)
        y = layer.step(x, cache, torch.tensor([1, -1, 0]), cu_seqlens=cu)
        want, _ = layer(x[:, 9:])
    assert torch.equal(y[:, 4:9], torch.zeros_like(y[:, 4:9]))
    assert_close(y[:, 9:], want, 1e-12, f"{name} packed sequence beside a padding one")
    assert not torch.equal(cache["conv"][0], before["conv"][0])


@pytest.mark.parametrize("name", NAMES)
def test_reset_gives_a_fresh_slot(name):
    layer, x = make_layer(name), inputs(2, 9)
    with torch.no_grad():
        cache = layer.allocate_cache(3, state_dtype=torch.float64)
        fresh = clone(cache)
        first = layer.step(x, cache, torch.tensor([0, 2]))
        layer.reset_cache(cache, [2])
        layer.reset_cache(cache, torch.tensor([0], dtype=torch.int32))
        for name_, pool in cache.items():
            assert torch.equal(pool, fresh[name_]), f"{name} {name_} after reset"
        again = layer.step(x, cache, torch.tensor([0, 2]))
    assert torch.equal(first, again)


def test_fresh_precision_is_the_learned_prior():
    layer = make_layer("kdn", torch.float32)
    with torch.no_grad():
        layer.initial_precision_param.copy_(torch.tensor([0.3, -1.2]))
        _, state = layer(inputs(2, 3, torch.float32))
        cache = layer.allocate_cache(2)
    from kdn_compile.reference import INITIAL_PRECISION_FLOOR
    want = INITIAL_PRECISION_FLOOR + torch.nn.functional.softplus(torch.tensor([0.3, -1.2]))
    assert cache["precision"].dtype == torch.float32
    assert torch.equal(cache["precision"], want[None, :, None].expand(2, 2, 8))


@pytest.mark.parametrize("name", NAMES)
def test_low_precision_pools_stay_close_to_float32(name):
    layer, x = make_layer(name, torch.float32), inputs(2, 18, torch.float32)
    dtypes = {torch.bfloat16: 2e-2}
    if name != "kdn":
        dtypes[torch.float8_e4m3fn] = 1e-1
    with torch.no_grad():
        want = run_steps(layer, x, layer.allocate_cache(2), torch.tensor([0, 1]), CUTS)
        for dtype, tol in dtypes.items():
            cache = layer.allocate_cache(2, state_dtype=dtype)
            got = run_steps(layer, x, cache, torch.tensor([0, 1]), CUTS)
            assert cache["recurrent" if name != "kdn" else "memory"].dtype == dtype
            assert_close(got, want, tol, f"{name} {dtype} pool")
            assert rel_error(got, want) > 0  # the pool really rounds


def test_float8_pool_layout():
    layer = make_layer("gdn", torch.float32)
    cache = layer.allocate_cache(3, state_dtype=torch.float8_e4m3fn)
    assert {n: (tuple(p.shape), p.dtype) for n, p in cache.items()} == {
        "conv": ((3, 3, 56), torch.float32),
        "recurrent": ((3, 4, 8, 6), torch.float8_e4m3fn),
        "recurrent_scales": ((3, 4, 1), torch.float32),
    }
    assert torch.equal(cache["recurrent_scales"], torch.ones(3, 4, 1))


def test_pools_are_static_addresses():
    for name in NAMES:
        cache = make_layer(name, torch.float32).allocate_cache(2)
        assert all(p._dynamo_static_input_type == "unguarded" for p in cache.values())


@pytest.mark.parametrize("name", NAMES)
def test_compiled_step_equals_eager(name):
    # fullgraph: no graph break; prefill and decode steps, a padding row; one graph per shape
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    layer, x = make_layer(name, torch.float32), inputs(3, 14, torch.float32)
    slots = torch.tensor([1, -1, 0])
    step = torch.compile(layer.step, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        eager_cache, compiled_cache = layer.allocate_cache(2), layer.allocate_cache(2)
        for a, b in ((0, 9), (9, 10), (10, 11), (11, 12), (12, 14)):
            want = layer.step(x[:, a:b], eager_cache, slots)
            got = step(x[:, a:b], compiled_cache, slots)
            assert_close(got, want, 1e-6, f"{name} compiled step {a}:{b}")
    for pool, other in zip(compiled_cache.values(), eager_cache.values()):
        assert_close(pool.float(), other.float(), 1e-6, f"{name} compiled pools")
    assert not counters["graph_break"], counters["graph_break"]


def test_compiled_decode_step_inductor():
    torch._dynamo.reset()
    layer, x = make_layer("gdn", torch.float32), inputs(2, 3, torch.float32)
    step = torch.compile(layer.step, fullgraph=True)
    slots = torch.tensor([0, 1])
    with torch.no_grad():
        eager_cache, compiled_cache = layer.allocate_cache(2), layer.allocate_cache(2)
        for t in range(3):
            want = layer.step(x[:, t : t + 1], eager_cache, slots)
            got = step(x[:, t : t + 1], compiled_cache, slots)
            assert_close(got, want, 1e-6, f"inductor decode step {t}")
    assert_close(compiled_cache["recurrent"], eager_cache["recurrent"], 1e-6, "pool")


@pytest.mark.parametrize("name", NAMES)
def test_forward_with_a_short_x_equals_the_chunked_path(name):
    # a short continuation (token recurrence / decode op) equals one chunked pass
    layer, x = make_layer(name), inputs(2, 20)
    with torch.no_grad():
        full, full_state = layer(x)
        head, state = layer(x[:, :14])
        tail, state = layer(x[:, 14:], state)
    assert_close(torch.cat((head, tail), 1), full, 1e-12, f"{name} short forward")
    for key in state:
        assert_close(state[key], full_state[key], 1e-12, f"{name} state {key}")


def test_kdn_short_forward_with_gradients_keeps_the_chunked_op():
    layer, x = make_layer("kdn"), inputs(2, 5)
    with torch.no_grad():
        want, want_state = layer(x)
    y, state = layer(x.requires_grad_())
    y.sum().backward()
    assert_close(y, want, 1e-12, "short forward with gradients")
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for key in state:
        assert_close(state[key], want_state[key], 1e-12, key)


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_bad_arguments_are_rejected_by_name(name):
    layer, x = make_layer(name, torch.float32), inputs(2, 1, torch.float32)
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match=f"num_slots must be an int >= 1, got {bad!r}"):
            layer.allocate_cache(bad)
    with pytest.raises(TypeError, match="state_dtype of a .* must be one of .*got torch.float16"):
        layer.allocate_cache(2, state_dtype=torch.float16)
    cache = layer.allocate_cache(3)
    idx = torch.tensor([0, 1])
    with pytest.raises(TypeError, match="cache must be the dict of allocate_cache"):
        layer.step(x, list(cache.values()), idx)
    with pytest.raises(ValueError, match="cache must be the pools"):
        layer.step(x, {k: v for k, v in cache.items() if k != "conv"}, idx)
    with pytest.raises(ValueError, match=r'cache\["conv"\] must be \[S, 3'):
        layer.step(x, dict(cache, conv=cache["conv"][:, :2].contiguous()), idx)
    with pytest.raises(ValueError, match="must be .* = \\(3,"):  # pools of different S
        layer.step(x, {k: v[:2] if k != "conv" else v for k, v in cache.items()}, idx)
    with pytest.raises(TypeError, match="state_indices must be int32 or int64, got torch.float32"):
        layer.step(x, cache, idx.float())
    with pytest.raises(ValueError, match=r"state_indices must be \[B\] = \(2,\)"):
        layer.step(x, cache, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="must not repeat"):
        layer.step(x, cache, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"x must be \[B, T, D\]"):
        layer.step(x[0], cache, idx)
    with pytest.raises(ValueError, match="state_indices is on meta but x is on cpu"):
        layer.step(x, cache, idx.to("meta"))
    with pytest.raises(TypeError, match="slots must be a 1-d int tensor"):
        layer.reset_cache(cache, [0.5])
    for slots, got in ((None, "got NoneType"), ("0", "got str"), ([2**70], "got \\[")):
        with pytest.raises(TypeError, match="slots must be a 1-d int tensor or a list of ints.*"
                                            + got):
            layer.reset_cache(cache, slots)
    with pytest.raises(RuntimeError, match="slots must be < the pool's slots S"):
        layer.reset_cache(cache, [3])


def test_cache_records_its_layer(seed):
    """A cache names the layer that allocated it: ``step`` and ``reset_cache`` of a layer of
    another type refuse it, though its pools have the same shapes (KDA's in a GDN layer of
    the same sizes); a plain dict copy of the pools is taken; the record survives
    ``torch.save`` and pytree maps."""
    torch.manual_seed(seed)
    gdn = GatedDeltaNet(D, 2, 8, head_v_dim=6, chunk_size=8)  # the KDA layer's sizes
    kda, kdn = make_layer("kda", torch.float32, seed), make_layer("kdn", torch.float32, seed)
    x, idx = inputs(2, 3, torch.float32, seed), torch.tensor([0, 2])
    cache = kda.allocate_cache(3)
    assert isinstance(cache, LayerCache) and cache.made_by == kda.state_signature
    assert {k: v.shape for k, v in cache.items()} == {
        k: v.shape for k, v in gdn.allocate_cache(3).items()}
    refused = (r"cache was allocated by KimiDeltaAttention\(hidden_size=24, num_heads=2, "
               r"head_dim=8, num_v_heads=2, head_v_dim=6, conv_size=4\); this layer is "
               r"GatedDeltaNet\(hidden_size=24, num_heads=2, head_dim=8, num_v_heads=2, "
               r"head_v_dim=6, conv_size=4\)")
    before = clone(cache)
    with torch.no_grad():
        with pytest.raises(ValueError, match=refused):
            gdn.step(x, cache, idx)
        with pytest.raises(ValueError, match=refused):
            gdn.reset_cache(cache, [0])
        with pytest.raises(ValueError, match=r"cache was allocated by DiagKDN\(hidden_size=24, "
                                             r".*\); this layer is KimiDeltaAttention\("):
            kda.step(x, kdn.allocate_cache(3), idx)
        for key in cache:
            assert torch.equal(cache[key], before[key]), key
        assert gdn.step(x, clone(cache), idx).shape == (2, 3, D)  # records no layer
        buffer = io.BytesIO()
        torch.save(cache, buffer)
        buffer.seek(0)
        for kept in (torch.load(buffer, weights_only=True),
                     torch.utils._pytree.tree_map(torch.clone, cache)):
            assert isinstance(kept, LayerCache) and kept.made_by == cache.made_by
            assert kda.step(x, kept, idx).shape == (2, 3, D)


@pytest.mark.parametrize("name", NAMES)
def test_empty_steps_and_resets_change_nothing(name):
    """No tokens (``T == 0``), no rows, and an empty list of slots to reset."""
    layer = make_layer(name)
    cache = layer.allocate_cache(3, state_dtype=torch.float64)
    before = clone(cache)
    with torch.no_grad():
        assert layer.step(inputs(2, 0), cache, torch.tensor([0, 2])).shape == (2, 0, D)
        assert layer.step(inputs(0, 1), cache, torch.tensor([], dtype=torch.long)).shape == (0, 1, D)
    layer.reset_cache(cache, [])
    for key in cache:
        assert torch.equal(cache[key], before[key]), key


@pytest.mark.parametrize("name", NAMES)
def test_decode_kernels_name_an_out_of_range_slot(name):
    """On the kernel path the decode op checks the slots; the layer's own reads of the pools
    before it (the convolution windows) must not fault first with an indexing error."""
    layer, x = make_layer(name, torch.float32), inputs(2, 1, torch.float32)
    cache = layer.allocate_cache(3)
    with torch.no_grad(), kdn_compile.use_backend("triton"):
        with pytest.raises(RuntimeError, match="state_indices must be < the pool's slots S"):
            layer.step(x, cache, torch.tensor([0, 3]))


def test_kdn_has_no_float8_pool():
    with pytest.raises(TypeError, match="DiagKDN cache must be one of float32, bfloat16, "
                                        "float64, got torch.float8_e4m3fn"):
        make_layer("kdn", torch.float32).allocate_cache(2, state_dtype=torch.float8_e4m3fn)


# -- the slot-writing op ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_scatter_slots_writes_named_rows_only(dtype, backend):
    from kdn_compile.layers._serving import write_slots

    pool = torch.randn(5, 3, 7).to(dtype)
    rows = torch.randn(4, 3, 7).to(dtype)
    indices = torch.tensor([3, -1, 0, -2])
    want = pool.clone()
    want.view(torch.uint8)[[3, 0]] = rows.view(torch.uint8)[[0, 2]]
    with kdn_compile.use_backend(backend):
        write_slots(pool, indices, rows)
    assert torch.equal(pool.view(torch.uint8), want.view(torch.uint8))
    reference = want.clone()
    scatter_slots(reference, indices, rows)
    assert torch.equal(reference.view(torch.uint8), want.view(torch.uint8))


# -- pool drift -----------------------------------------------------------------------------


def test_pool_drift_reports_each_dtype(capsys):
    from kdn_compile.serving_drift import main, pool_drift

    table = pool_drift("kdn", steps=3, batch=2, hidden=16, heads=2, head_dim=8, device="cpu")
    assert set(table) == {"bfloat16"} and 0 < table["bfloat16"]["all"] < 0.1
    main(["--layer", "gdn", "--steps", "3", "--batch", "2", "--hidden", "16", "--heads", "2",
          "--head-dim", "8", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "bfloat16" in out and "float8_e4m3fn" in out, out


def test_decode_reference_outputs_have_the_fakes_layout():
    # a compiled graph views o as the fake promised it (contiguous), at T > 1 too
    from _inputs import delta_inputs, kdn_inputs

    x = delta_inputs(B=2, T=3, Hk=1, Hv=2, K=4, V=3, dtype=torch.float32, with_state=False)
    o = torch.ops.kdn.delta_rule_decode_reference(
        x["q"], x["k"], x["v"], x["g"], x["beta"], torch.zeros(2, 2, 4, 3),
        torch.tensor([1, 0]), 0.5, False, None, None)
    kd = kdn_inputs(B=2, T=3, H=2, K=4, V=3, dtype=torch.float32)
    o2 = torch.ops.kdn.diag_kdn_decode_reference(
        kd["q"], kd["k"], kd["v"], kd["log_alpha"], kd["omega"], kd["r"], kd["memory"],
        kd["precision"], torch.tensor([1, 0]), 0.5, 1.0, None, None)
    assert o.is_contiguous() and o2.is_contiguous()
