"""Speculative decoding over state pools: a verification that leaves the pool as it is
(``delta_rule_decode(..., update_state=False)``) and :func:`kdn_compile.commit_states`,
which writes each row's state after its accepted tokens. On the CPU: the kernels in
Triton's interpreter and the references, eager and compiled; argument errors."""

from __future__ import annotations

import pytest
import torch

import kdn_compile
from _inputs import delta_inputs
from kdn_compile.reference.fp8 import quantize_state_fp8

FP8 = torch.float8_e4m3fn
B, T, HK, HV, K, V, S = 4, 3, 1, 2, 8, 80, 6


def _pool(dtype, state_v_first, seed, K=K, V=V):
    gen = torch.Generator().manual_seed(seed)
    state = torch.randn(S, HV, K, V, generator=gen, dtype=torch.float64)
    scales = None
    if dtype == FP8:
        pool, scales = quantize_state_fp8(state.float())
    else:
        pool = state.to(dtype)
    if state_v_first:
        pool = pool.transpose(-1, -2).contiguous()
    return pool, scales


def _clone(t):
    return None if t is None else t.clone()


def _decode(x, pool, scales, idx, **kw):
    return kdn_compile.delta_rule_decode(x["q"], x["k"], x["v"], x["g"], x["beta"], pool, idx,
                                         pool_scales=scales, **kw)


def check_commit(backend, per_key, pool_dtype, state_v_first, device="cpu", K=K, V=V):
    """Verify T tokens without updating the pool, then commit: each slot holds, bit for bit,
    what one decode step of the row's accepted tokens leaves (accepted 0: its state from
    before), the verification's outputs are bit for bit the updating step's, and padding
    rows and slots not named stay as they were."""

    def same(a, b):
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    seed = 11 + per_key + 2 * state_v_first
    print(f"seed {seed}")
    work = torch.float64 if pool_dtype == torch.float64 else torch.float32
    x = delta_inputs(B=B, T=T, Hk=HK, Hv=HV, K=K, V=V, per_key=per_key, dtype=work,
                     with_state=False, seed=seed, device=device)
    pool, scales = _pool(pool_dtype, state_v_first, seed, K, V)
    pool, scales = pool.to(device), None if scales is None else scales.to(device)
    idx = torch.tensor([4, -1, 1, 2], device=device)
    accepted = torch.tensor([2, 1, 0, 3], device=device)
    inter = torch.zeros((B, T, HV) + tuple(pool.shape[2:]), dtype=work, device=device)
    with kdn_compile.use_backend(backend), torch.no_grad():
        p, s = pool.clone(), _clone(scales)
        o = _decode(x, p, s, idx, state_v_first=state_v_first, intermediate_states=inter,
                    update_state=False)
        assert torch.equal(p.view(torch.uint8), pool.view(torch.uint8)), "verify wrote the pool"
        if scales is not None:
            assert torch.equal(s, scales), "verify wrote the pool's scales"
        o_updating = _decode(x, pool.clone(), _clone(scales), idx, state_v_first=state_v_first)
        assert same(o, o_updating), "update_state changes the outputs"
        kdn_compile.commit_states(p, idx, inter, accepted, pool_scales=s,
                                  state_v_first=state_v_first)
        for row, slot in enumerate(idx.tolist()):
            if slot < 0:
                continue
            a = int(accepted[row])
            expected, expected_scales = pool.clone(), _clone(scales)
            if a > 0:
                head = {n: t[row:row + 1, :a] for n, t in x.items()}
                _decode(head, expected, expected_scales, idx[row:row + 1],
                        state_v_first=state_v_first)
            assert same(p[slot], expected[slot]), f"slot {slot} after committing {a} of {T} tokens"
            if scales is not None:
                assert same(s[slot], expected_scales[slot]), f"slot {slot}'s scales"
    for slot in (0, 3, 5):  # not named
        assert torch.equal(p[slot].view(torch.uint8), pool[slot].view(torch.uint8)), slot


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("per_key", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, FP8, torch.float64],
                         ids=["f32", "bf16", "fp8", "f64"])
@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
def test_commit_equals_decoding_the_accepted_tokens(backend, per_key, pool_dtype, state_v_first):
    if pool_dtype == torch.float64 and backend == "triton":
        pytest.skip("float64 pools run the reference")
    check_commit(backend, per_key, pool_dtype, state_v_first)


def check_kdn_commit(backend, memory_dtype, device="cpu", K=K, V=V):
    """Diag-KDN: verify T tokens without updating the pools, then commit: memory and
    precision of each slot bit for bit what one decode step of its accepted tokens leaves."""
    from _inputs import kdn_inputs

    seed = 31
    print(f"seed {seed}")
    work = torch.float64 if memory_dtype == torch.float64 else torch.float32
    x = kdn_inputs(B=B, T=T, H=HV, K=K, V=V, dtype=work, seed=seed, device=device)
    x = {n: x[n] for n in ("q", "k", "v", "log_alpha", "omega", "r")}
    gen = torch.Generator().manual_seed(seed)
    memory = torch.randn(S, HV, K, V, generator=gen, dtype=torch.float64).to(memory_dtype)
    precision = (torch.rand(S, HV, K, generator=gen, dtype=torch.float64) + 0.5).to(work)
    memory, precision = memory.to(device), precision.to(device)
    idx = torch.tensor([4, -1, 1, 2], device=device)
    accepted = torch.tensor([2, 1, 0, 3], device=device)
    inter_m = torch.zeros(B, T, HV, K, V, dtype=work, device=device)
    inter_p = torch.zeros(B, T, HV, K, dtype=work, device=device)

    def decode(x, m, p, idx, **kw):
        return kdn_compile.diag_kdn_decode(*x.values(), m, p, idx, scale=K ** -0.5,
                                           info_scale=0.7, **kw)

    with kdn_compile.use_backend(backend), torch.no_grad():
        m, p = memory.clone(), precision.clone()
        o = decode(x, m, p, idx, intermediate_memory=inter_m, intermediate_precision=inter_p,
                   update_state=False)
        assert torch.equal(m, memory) and torch.equal(p, precision), "verify wrote a pool"
        assert torch.equal(o, decode(x, memory.clone(), precision.clone(), idx))
        kdn_compile.commit_diag_kdn_states(m, p, idx, inter_m, inter_p, accepted)
        for row, slot in enumerate(idx.tolist()):
            if slot < 0:
                continue
            a = int(accepted[row])
            em, ep = memory.clone(), precision.clone()
            if a > 0:
                decode({n: t[row:row + 1, :a] for n, t in x.items()}, em, ep, idx[row:row + 1])
            assert torch.equal(m[slot], em[slot]), f"memory slot {slot}, {a} of {T} accepted"
            assert torch.equal(p[slot], ep[slot]), f"precision slot {slot}, {a} of {T} accepted"
    for slot in (0, 3, 5):
        assert torch.equal(m[slot], memory[slot]) and torch.equal(p[slot], precision[slot])


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("memory_dtype", [torch.float32, torch.bfloat16, torch.float64],
                         ids=["f32", "bf16", "f64"])
def test_diag_kdn_commit_equals_decoding_the_accepted_tokens(backend, memory_dtype):
    if memory_dtype == torch.float64 and backend == "triton":
        pytest.skip("float64 pools run the reference")
    check_kdn_commit(backend, memory_dtype)


def test_verify_and_commit_compile_fullgraph():
    """A verification and its commit under torch.compile(fullgraph=True) write what they
    write eagerly."""
    x = delta_inputs(B=B, T=T, Hk=HK, Hv=HV, K=K, V=V, per_key=True, dtype=torch.float32,
                     with_state=False, seed=5)
    pool, _ = _pool(torch.float32, False, 5)
    idx, accepted = torch.tensor([0, 3, -1, 5]), torch.tensor([3, 0, 2, 1])

    def verify_commit(x, pool, idx, inter, accepted):
        o = _decode(x, pool, None, idx, intermediate_states=inter, update_state=False)
        kdn_compile.commit_states(pool, idx, inter, accepted)
        return o

    results = []
    for fn in (verify_commit, torch.compile(verify_commit, fullgraph=True)):
        p, inter = pool.clone(), torch.zeros(B, T, HV, K, V)
        with torch.no_grad():
            o = fn(x, p, idx, inter, accepted)
        results.append((o, p, inter))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


def _commit_args(**change):
    args = dict(state_pool=torch.zeros(S, HV, K, V), state_indices=torch.tensor([0, 2, -1, 4]),
                intermediate_states=torch.zeros(B, T, HV, K, V),
                accepted=torch.tensor([0, 1, 2, 3]))
    args.update(change)
    return args


@pytest.mark.parametrize("change,error,match", [
    (dict(accepted=torch.tensor([0, 1, 2, 4])), RuntimeError, r"accepted must be in 0\.\.T, T the tokens"),
    (dict(accepted=torch.tensor([0, 1, -1, 2])), RuntimeError, "accepted must be in"),
    (dict(accepted=torch.tensor([0.0, 1, 2, 3])), TypeError, "accepted must be int32 or int64"),
    (dict(accepted=torch.tensor([0, 1, 2])), ValueError, r"accepted must be \[B\]"),
    (dict(state_indices=torch.tensor([0, 0, -1, 4])), RuntimeError, "must not repeat"),
    (dict(state_indices=torch.tensor([0, 2, -1, 6])), RuntimeError, "state_indices must be < "),
    (dict(intermediate_states=torch.zeros(B, T, HV, K)), ValueError, "intermediate_states must be"),
    (dict(intermediate_states=torch.zeros(B, T, HV, K, V + 1)), ValueError, "state_pool"),
    (dict(intermediate_states=torch.zeros(B, T, HV, K, V, dtype=torch.float16)), TypeError,
     "intermediate_states"),
    (dict(state_pool=torch.zeros(S, HV, K, V, dtype=FP8)), ValueError, "pool_scales"),
    (dict(pool_scales=torch.ones(S, HV, 2)), ValueError, "pool_scales"),
    (dict(state_pool=[0.0]), TypeError, "state_pool"),
])
def test_commit_errors_name_the_argument(change, error, match):
    with pytest.raises(error, match=match):
        kdn_compile.commit_states(**_commit_args(**change))


def test_update_state_must_be_a_bool():
    x = delta_inputs(B=1, T=1, Hk=1, Hv=1, K=4, V=4, dtype=torch.float32, with_state=False)
    with pytest.raises(TypeError, match="update_state must be a bool"):
        _decode(x, torch.zeros(2, 1, 4, 4), None, torch.tensor([0]), update_state=0)


# -- the layers: verify, then commit ------------------------------------------------------

def _layer(kind, dtype, seed):
    from kdn_compile.layers import DiagKDN, GatedDeltaNet, KimiDeltaAttention

    torch.manual_seed(seed)
    cls = {"gdn": GatedDeltaNet, "kda": KimiDeltaAttention, "kdn": DiagKDN}[kind]
    return cls(32, num_heads=2, head_dim=8, conv_size=4).to(dtype).eval()


@pytest.mark.parametrize("kind,dtype,steps,tol", [
    ("kda", torch.float64, 1000, 1e-12), ("gdn", torch.float32, 200, 2e-5),
    ("kdn", torch.float64, 300, 1e-12), ("kdn", torch.float32, 100, 2e-5)])
def test_layer_speculative_run_equals_plain_decoding(kind, dtype, steps, tol):
    """``steps`` rounds of verify-then-commit with random drafts (1 to 4 tokens) and random
    acceptance (0 to all), padding rows and slots recycled along the way, against plain
    one-token ``step``s of the accepted tokens: the same outputs and, at the end, the same
    pools (up to the projections' rounding over T rows at once)."""
    seed = 1000 + steps
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    layer = _layer(kind, dtype, seed)
    batch, slots = 3, 5
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    spec, plain = (layer.allocate_cache(slots, state_dtype=state_dtype) for _ in range(2))
    drafts = {t: layer.allocate_drafts(batch, t, state_dtype=state_dtype) for t in range(1, 5)}
    idx = torch.tensor([0, 3, 4])
    worst = 0.0
    with torch.no_grad():
        prompt = torch.randn(batch, 7, 32, generator=gen, dtype=dtype)
        for cache in (spec, plain):
            layer.step(prompt, cache, idx)
        for step in range(steps):
            t = int(torch.randint(1, 5, (), generator=gen))
            x = torch.randn(batch, t, 32, generator=gen, dtype=dtype)
            rows = torch.where(torch.rand(batch, generator=gen) < 0.1, -1, idx)  # some padding
            accepted = torch.randint(0, t + 1, (batch,), generator=gen)
            y = layer.verify(x, spec, rows, drafts[t])
            layer.commit(spec, rows, accepted, drafts[t])
            for j in range(int(accepted.max())):
                taking = torch.where(accepted > j, rows, -1)
                y_plain = layer.step(x[:, j:j + 1], plain, taking)
                kept = (taking >= 0)[:, None, None]
                worst = max(worst, float((torch.where(kept, y[:, j:j + 1] - y_plain, 0)).abs().max()))
            if step % 97 == 96:  # a sequence ends, its slot starts a new one
                for cache in (spec, plain):
                    layer.reset_cache(cache, [int(idx[1])])
    assert worst <= tol, f"outputs differ by {worst:.2e}"
    for name in spec:
        diff = float((spec[name].double() - plain[name].double()).abs().max())
        assert diff <= tol, f'cache["{name}"] differs by {diff:.2e}'


def test_layer_verify_leaves_the_cache_and_errors_name_the_argument():
    layer = _layer("gdn", torch.float32, 3)
    cache = layer.allocate_cache(4)
    drafts = layer.allocate_drafts(2, 3)
    idx = torch.tensor([1, 2])
    with torch.no_grad():
        layer.step(torch.randn(2, 5, 32), cache, idx)
        before = {n: t.clone() for n, t in cache.items()}
        layer.verify(torch.randn(2, 3, 32), cache, idx, drafts)
    for name in cache:
        assert torch.equal(cache[name], before[name]), f"verify wrote cache[{name!r}]"
    with pytest.raises(ValueError, match=r"T = 2 \(the tokens of x\)"):
        layer.verify(torch.randn(2, 2, 32), cache, idx, drafts)
    with pytest.raises(ValueError, match="drafts must be the dict of allocate_drafts"):
        layer.verify(torch.randn(2, 3, 32), cache, idx, {"conv": drafts["conv"]})
    with pytest.raises(ValueError, match=r"tokens must be an int in 1\.\.8"):
        layer.allocate_drafts(2, 9)
    with pytest.raises(TypeError, match="accepted must be int32 or int64"):
        layer.commit(cache, idx, torch.tensor([0.5, 1.0]), drafts)
    with pytest.raises(RuntimeError, match=r"accepted must be in 0\.\.T, T the tokens"):
        layer.commit(cache, idx, torch.tensor([0, 4]), drafts)
    with pytest.raises(RuntimeError, match="state_indices must be those of the verification"):
        layer.commit(cache, torch.tensor([1, 3]), torch.tensor([1, 1]), drafts)
    with pytest.raises(RuntimeError, match="state_indices must be those of the verification"):
        layer.commit(cache, idx, torch.tensor([1, 1]), layer.allocate_drafts(2, 3))  # unfilled
    with pytest.raises(ValueError, match="must be contiguous: call"):
        kdn_compile.commit_states(cache["recurrent"], idx,
                                  torch.zeros(3, 2, 2, 8, 8).transpose(0, 1), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="T >= 1 tokens"):
        kdn_compile.commit_states(cache["recurrent"], idx, torch.zeros(2, 0, 2, 8, 8),
                                  torch.tensor([0, 0]))


def test_layer_verify_and_commit_compile_fullgraph():
    """verify and commit under torch.compile(fullgraph=True) give the eager outputs and pools."""
    layer = _layer("kda", torch.float32, 4)
    idx, accepted = torch.tensor([2, -1, 0]), torch.tensor([1, 2, 3])
    x = torch.randn(3, 3, 32, generator=torch.Generator().manual_seed(4))
    results = []
    for verify, commit in ((layer.verify, layer.commit),
                           (torch.compile(layer.verify, fullgraph=True),
                            torch.compile(layer.commit, fullgraph=True))):
        cache, drafts = layer.allocate_cache(3), layer.allocate_drafts(3, 3)
        with torch.no_grad():
            layer.step(torch.randn(3, 6, 32, generator=torch.Generator().manual_seed(5)), cache,
                       idx)
            y = verify(x, cache, idx, drafts)
            commit(cache, idx, accepted, drafts)
        results.append((y, dict(cache)))
    (y1, c1), (y2, c2) = results
    torch.testing.assert_close(y2, y1, rtol=1e-5, atol=1e-5)
    for name in c1:
        torch.testing.assert_close(c2[name], c1[name], rtol=1e-5, atol=1e-5)


def test_drafts_of_another_dtype_name_the_cache_state_dtype():
    from kdn_compile.layers import KimiDeltaAttention

    layer = KimiDeltaAttention(32, num_heads=2, head_dim=8).double()
    cache = layer.allocate_cache(4, state_dtype=torch.float64)
    drafts = layer.allocate_drafts(2, 3)  # float32 states: not this cache's
    with pytest.raises(TypeError, match=r"allocate_drafts\(\.\.\., state_dtype=torch.float64\)"):
        with torch.no_grad():
            layer.verify(torch.randn(2, 3, 32, dtype=torch.float64), cache, torch.tensor([1, 3]),
                         drafts)
