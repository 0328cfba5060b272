"""Property-based tests: delta_rule_decode and diag_kdn_decode over state pools against the
float64 token loops (shuffled slots, padding rows, 1 to 8 tokens; the drawing and the
comparison: ``_properties.py``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

import kdn_compile
from _helpers import assert_close, delta_rule_oracle, diag_kdn_oracle
from _properties import (
    DECODE_LAUNCHERS, _backend, _gates, _generator, _kdn_noise, _log_uniform, _qk, _range,
    _tolerance, _uniform, examples, needs_interpreter,
)


def _slots(draw, rows: int):
    """``(S, state_indices)``: distinct slots of a pool of ``S`` in a shuffled order, and
    padding rows (-1)."""
    slots = draw(st.integers(1, 4))
    order = draw(st.permutations(range(slots)))
    picks = [order[i] if i < slots and draw(st.booleans()) else -1 for i in range(rows)]
    dtype = draw(st.sampled_from((torch.int32, torch.int64)))
    return slots, torch.tensor(picks, dtype=dtype)


def _check_pool_step(found_o, pools_before, pools_after, indices, step):
    """``step(row, states) -> (o [T, H, V], new states)`` (float64; ``states`` are the slot's
    rows of ``pools_before``) for each live row: the row's output and its slots within the
    tolerances of their dtypes; padding rows give zeros and slots not named keep their
    bytes."""
    named = set()
    for row, slot in enumerate(indices.tolist()):
        if slot < 0:
            assert not found_o[row].any(), f"padding row {row} has non-zero outputs"
            continue
        named.add(slot)
        o, states = step(row, [pool[slot] for pool in pools_before])
        assert_close(found_o[row], o, _tolerance(0, found_o.dtype), f"o of row {row}")
        for i, (pool, state) in enumerate(zip(pools_after, states)):
            assert_close(pool[slot], state, _tolerance(0, found_o.dtype, pool.dtype),
                         f"pool {i} slot {slot}")
    for before, after in zip(pools_before, pools_after):
        for slot in set(range(before.shape[0])) - named:
            assert torch.equal(after[slot], before[slot]), f"slot {slot} was written"


@st.composite
def decode_inputs(draw, *, kdn: bool, backend: str):
    """``(inputs, memory pool, state_indices, generator)`` of a decode step of ``1..8``
    tokens over a pool of up to four slots: float32 inputs and pool for the kernels;
    float64, or float32 with a float32 or bfloat16 pool, for the reference."""
    gen = _generator(draw)
    rows, t = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    slots, indices = _slots(draw, rows)
    hk = draw(st.integers(1, 2))
    hv = hk if kdn else hk * draw(st.integers(1, 2))
    dk, dv = draw(st.sampled_from((5, 8, 16))), draw(st.sampled_from((5, 8, 16)))
    x = {"q": _qk(gen, (rows, t, hk, dk)), "k": _qk(gen, (rows, t, hk, dk)),
         "v": torch.randn(rows, t, hv, dv, generator=gen, dtype=torch.float64)}
    if kdn:
        x.update(_kdn_noise(draw, gen, rows, t, hv, dk)[0])
    else:
        per_key = draw(st.booleans())
        x["g"] = _gates(draw, gen, (rows, t, hv, dk) if per_key else (rows, t, hv))[0]
        low, top = _range(draw, 1.0)
        x["beta"] = _uniform(gen, (rows, t, hv), low, top)
    dtype, pool_dtype = torch.float32, torch.float32
    if backend == "reference":
        dtype = draw(st.sampled_from((torch.float32, torch.float64)))
        pool_dtype = dtype if dtype == torch.float64 else draw(
            st.sampled_from((torch.float32, torch.bfloat16)))
    pool = torch.randn(slots, hv, dk, dv, generator=gen, dtype=torch.float64).to(pool_dtype)
    return {n: v.to(dtype) for n, v in x.items()}, pool, indices, gen


def _draw_decode(data, **kwargs):
    x, pool, indices, gen = found = data.draw(decode_inputs(**kwargs))
    event(f"{kwargs['backend']} {x['q'].dtype} pool {pool.dtype} T={x['q'].shape[1]} "
          f"slots {indices.tolist()}")
    return found


DECODE_BACKENDS = pytest.mark.parametrize(
    "backend", ["reference", pytest.param("triton", marks=needs_interpreter)])


@DECODE_BACKENDS
@examples(8)
@given(data=st.data())
def test_delta_rule_decode_is_the_token_loop(backend, data):
    x, pool, indices, _ = _draw_decode(data, kdn=False, backend=backend)
    state_v_first = data.draw(st.booleans())
    scale = data.draw(st.one_of(st.none(), st.floats(0.1, 2.0)))
    layout = (lambda s: s.transpose(-1, -2)) if state_v_first else (lambda s: s)
    stored = layout(pool).contiguous()
    before = stored.clone()
    inter = None
    if data.draw(st.booleans()):
        inter_dtype = torch.float64 if pool.dtype == torch.float64 else torch.float32
        inter = torch.zeros((len(indices), x["q"].shape[1]) + layout(pool[0]).shape,
                            dtype=inter_dtype)
    with torch.no_grad(), _backend(backend, DECODE_LAUNCHERS, {"recurrent_delta_fwd"}):
        o = kdn_compile.delta_rule_decode(
            *x.values(), stored, indices, scale=scale, state_v_first=state_v_first,
            intermediate_states=inter)

    def run(row, state, tokens):
        one = {n: v[row:row + 1, :tokens] for n, v in x.items()}
        o, final = delta_rule_oracle(**one, scale=scale, initial_state=state[None],
                                     state_v_first=state_v_first)
        return o[0], [final[0]]

    _check_pool_step(o, [before], [stored], indices,
                     lambda row, states: run(row, states[0], None))
    if inter is not None:  # the state after every token: the loop stopped there
        for row, slot in enumerate(indices.tolist()):
            for t in range(inter.shape[1]) if slot >= 0 else ():
                state = run(row, before[slot], t + 1)[1][0]
                assert_close(inter[row, t], state, _tolerance(0, x["q"].dtype),
                             f"intermediate state {t} of row {row}")


@DECODE_BACKENDS
@examples(8)
@given(data=st.data())
def test_diag_kdn_decode_is_the_token_loop(backend, data):
    x, memory, indices, gen = _draw_decode(data, kdn=True, backend=backend)
    precision_dtype = torch.float64 if memory.dtype == torch.float64 else torch.float32
    precision = _log_uniform(gen, memory.shape[:3], 1e-2, 1e2).to(precision_dtype)
    scale, info_scale = data.draw(st.floats(0.1, 1.0)), data.draw(st.floats(0, 2))
    before = [memory.clone(), precision.clone()]
    with torch.no_grad(), _backend(backend, DECODE_LAUNCHERS, {"recurrent_kdn_fwd"}):
        o = kdn_compile.diag_kdn_decode(*x.values(), memory, precision, indices, scale=scale,
                                        info_scale=info_scale)

    def step(row, states):
        one = {n: v[row:row + 1] for n, v in x.items()}
        o, m, p = diag_kdn_oracle(**one, memory=states[0][None], precision=states[1][None],
                                  scale=scale, info_scale=info_scale)
        return o[0], [m[0], p[0]]

    _check_pool_step(o, before, [memory, precision], indices, step)
