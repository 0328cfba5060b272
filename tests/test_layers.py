"""Layers: shapes, prefill + decode == one pass, packed sequences, compile and export."""

from __future__ import annotations

import io

import pytest
import torch

import kdn_compile
from _helpers import assert_close
from kdn_compile.layers import DiagKDN, GatedDeltaNet, KimiDeltaAttention, LayerState
from kdn_compile.layers._common import ShortConv

# the export tests' inline expectations (./dev.sh test installs it; a GPU machine may not have it)
expecttest = pytest.importorskip("expecttest")

D = 24
LAYERS = {
    "gdn": lambda: GatedDeltaNet(D, 2, 8, num_v_heads=4, head_v_dim=6, chunk_size=8),
    "kda": lambda: KimiDeltaAttention(D, 2, 8, head_v_dim=6, chunk_size=8),
    "kdn": lambda: DiagKDN(D, 2, 8, head_v_dim=6, chunk_size=8),
}
STATE_SHAPES = {  # N = 3 rows; conv [N, 3, 2 * Hk * K + Hv * V]
    "gdn": {"conv": (3, 3, 56), "recurrent": (3, 4, 8, 6)},
    "kda": {"conv": (3, 3, 44), "recurrent": (3, 2, 8, 6)},
    "kdn": {"conv": (3, 3, 44), "memory": (3, 2, 8, 6), "precision": (3, 2, 8)},
}


def make_layer(name, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return LAYERS[name]().to(dtype)


def inputs(B, T, dtype=torch.float64, seed=1):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def assert_states_close(a, b, tol, what):
    assert a.keys() == b.keys(), what
    for key in a:
        assert_close(a[key], b[key], tol, f"{what} state {key}")


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_shapes_and_state(name):
    layer = make_layer(name, torch.float32)
    y, state = layer(inputs(3, 13, torch.float32))
    assert y.shape == (3, 13, D) and y.dtype == torch.float32
    assert {k: tuple(v.shape) for k, v in state.items()} == STATE_SHAPES[name]
    assert all(s.dtype == torch.float32 for k, s in state.items() if k != "conv")


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_bfloat16_output_with_float32_state(name):
    layer = make_layer(name, torch.bfloat16)
    x = inputs(2, 11, torch.bfloat16).requires_grad_()
    y, state = layer(x)
    y.float().square().sum().backward()
    assert y.dtype == torch.bfloat16 and state["conv"].dtype == torch.bfloat16
    assert all(s.dtype == torch.float32 for k, s in state.items() if k != "conv")
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_x_in_another_dtype_than_the_parameters(name, seed):
    """Outside autocast ``x`` must be in the parameters' dtype (forward and step, a
    TypeError naming ``x`` and both dtypes); under ``torch.autocast``, which casts the
    projections' operands, a float32 layer takes bfloat16 ``x``, eagerly and compiled."""
    layer = make_layer(name, torch.float32)
    x = inputs(2, 11, torch.bfloat16, seed=seed)
    message = rf"x must be torch.float32, the dtype of this {type(layer).__name__}'s parameters, "
    with pytest.raises(TypeError, match=message + "got torch.bfloat16"):
        layer(x)
    with pytest.raises(TypeError, match=message + "got torch.float64"):
        layer.step(x.double(), layer.allocate_cache(2), torch.tensor([0, 1]))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = layer(x)
        compiled, _ = torch.compile(layer, fullgraph=True, backend="eager")(x)
    assert y.shape == (2, 11, D) and torch.isfinite(y.float()).all()
    assert_close(compiled.float(), y.float(), 1e-2, f"{name} compiled under autocast")


def test_grouped_value_heads_must_divide():
    with pytest.raises(ValueError, match="num_v_heads"):
        GatedDeltaNet(D, 3, 8, num_v_heads=4)


@pytest.mark.parametrize("cls", [GatedDeltaNet, KimiDeltaAttention, DiagKDN])
@pytest.mark.parametrize("bad,name", [({"num_heads": 0}, "num_heads"), ({"head_dim": -8}, "head_dim"),
                                      ({"conv_size": 1}, "conv_size"), ({"hidden_size": 2.5}, "hidden_size"),
                                      ({"chunk_size": 0}, "chunk_size")])
def test_bad_sizes_are_rejected_by_name(cls, bad, name):
    sizes = {"hidden_size": D, "num_heads": 2, "head_dim": 8, **bad}
    kwargs = {n: sizes.pop(n) for n in ("conv_size", "chunk_size") if n in sizes}
    with pytest.raises(ValueError, match=f"{name} must be an int >= "):
        cls(sizes["hidden_size"], sizes["num_heads"], sizes["head_dim"], **kwargs)


def test_gated_norm_refuses_an_unknown_activation():
    from kdn_compile.layers._common import GatedRMSNorm

    with pytest.raises(ValueError, match=r"activation must be one of \['sigmoid', 'silu'\], got 'relu'"):
        GatedRMSNorm(4, activation="relu")


def test_kda_layer_is_kimi_linear_anatomy():
    """KimiDeltaAttention has Kimi Linear's (and fla.layers.KimiDeltaAttention's) gates:
    low-rank decay and output-gate projections through V, a bias on the latter, a
    sigmoid output gate; its output spelled out with the reference op equals the layer's."""
    import torch.nn.functional as F

    from kdn_compile.layers._common import convolved_qkv
    from kdn_compile.reference import chunk_kda_reference

    layer = KimiDeltaAttention(D, 2, 8, num_v_heads=4, head_v_dim=6, chunk_size=8).double()
    shapes = {n: tuple(t.shape) for n, t in layer.state_dict().items() if n[:6] in ("f_proj", "g_proj")}
    assert shapes == {"f_proj.0.weight": (6, D), "f_proj.1.weight": (4 * 8, 6),
                      "g_proj.0.weight": (6, D), "g_proj.1.weight": (4 * 6, 6),
                      "g_proj.1.bias": (4 * 6,)}
    assert not hasattr(layer, "a_proj") and not hasattr(layer, "gate_proj")
    with torch.no_grad():
        layer.g_proj[1].bias.normal_()  # nonzero, so that a missing bias would show
    x = inputs(2, 19)
    y, _ = layer(x)
    q, k, v, _ = convolved_qkv(layer, x, None, None, 4)
    raw = layer.f_proj[1](layer.f_proj[0](x)).view(2, 19, 4, 8) + layer.dt_bias.view(4, 8)
    g = -layer.A_log.exp()[:, None] * F.softplus(raw)
    beta = layer.b_proj(x).sigmoid()
    q, k = (t / (t.square().sum(-1, keepdim=True) + 1e-6).sqrt() for t in (q, k))
    o, _ = chunk_kda_reference(q, k, v, g, beta, chunk_size=8)
    gate = torch.sigmoid(layer.g_proj[1](layer.g_proj[0](x))).view(2, 19, 4, 6)
    normed = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + layer.norm.eps)
    want = layer.o_proj((normed * layer.norm.weight * gate).flatten(-2))
    assert_close(y, want, 1e-12, "KDA layer spelled out")


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_projections_run_as_modules(name):
    """q, k, v come from calling q_proj, k_proj, v_proj (so hooks and adapters that wrap
    them, e.g. LoRA, take effect), not from their weights read directly."""
    layer, x = make_layer(name), inputs(2, 5)
    calls = []
    for proj in ("q_proj", "k_proj", "v_proj"):
        getattr(layer, proj).register_forward_hook(lambda m, i, o, p=proj: calls.append(p))
    y, _ = layer(x)
    assert sorted(calls) == ["k_proj", "q_proj", "v_proj"]
    # an adapter's extra term reaches the output
    layer.q_proj.register_forward_hook(lambda m, i, o: o + 1.0)
    assert not torch.equal(layer(x)[0], y)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_prefill_then_decode_equals_one_pass(name):
    layer, x = make_layer(name), inputs(2, 21)
    full, full_state = layer(x)
    y, state = layer(x[:, :13])
    pieces = [y]
    for t in range(13, 21):
        y, state = layer(x[:, t : t + 1], state)
        pieces.append(y)
    assert_close(torch.cat(pieces, dim=1), full, 1e-12, f"{name} prefill + decode")
    assert_states_close(state, full_state, 1e-12, name)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_packed_sequences_equal_separate(name):
    # lengths 5, 0, 2 (shorter than the conv window), 14; then a second call continues each
    layer = make_layer(name)
    cu = torch.tensor([0, 5, 5, 7, 21])
    first, second = inputs(1, 21, seed=2), inputs(1, 21, seed=3)
    packed1, state1 = layer(first, cu_seqlens=cu)
    packed2, state2 = layer(second, state1, cu_seqlens=cu)
    rows = [n for n in range(4) if cu[n + 1] > cu[n]]
    for n in rows:
        span = slice(int(cu[n]), int(cu[n + 1]))
        y1, s1 = layer(first[:, span])
        y2, s2 = layer(second[:, span], s1)
        assert_close(packed1[:, span], y1, 1e-12, f"{name} sequence {n}, first call")
        assert_close(packed2[:, span], y2, 1e-12, f"{name} sequence {n}, second call")
        assert_states_close({k: v[n : n + 1] for k, v in state2.items()}, s2, 1e-12, name)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_bad_state_or_input_rank_is_rejected_by_name(name):
    # named by the layer, not by an error inside torch.cat ("Sizes of tensors must match")
    layer = make_layer(name)
    _, state = layer(inputs(2, 6))
    with pytest.raises(ValueError, match=r'state\["conv"\] must have shape \(1, 3, \d+\), got \(2, 3, \d+\)'):
        layer(inputs(1, 1), state)
    _, packed = layer(inputs(1, 9), cu_seqlens=torch.tensor([0, 2, 5, 9]))
    with pytest.raises(ValueError, match=r'state\["conv"\] must have shape \(2, 3, \d+\), got \(3, 3, \d+\)'):
        layer(inputs(1, 9), packed, cu_seqlens=torch.tensor([0, 4, 9]))
    # a recurrent state of another batch (conv cache right): named as the layer's state entry
    rec = "memory" if name == "kdn" else "recurrent"
    wrong = dict(state)
    wrong["conv"] = state["conv"][:1]
    with pytest.raises(ValueError, match=rf'state\["{rec}"\] must have shape \(1, '):
        layer(inputs(1, 1), wrong)
    # an unbatched [T, D] input: named by the layer, not by an error inside torch.cat
    with pytest.raises(ValueError, match=r"x must be \[B, T, D\] \(3 dims\), got shape \(6, 24\)"):
        layer(inputs(1, 6)[0])
    # another hidden size: named by the layer, not by an error inside a projection
    with pytest.raises(ValueError, match=r"x must be \[B, T, D\] with D = hidden_size = 24, "
                                         r"got shape \(1, 6, 23\)"):
        layer(inputs(1, 6)[..., :23])


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_state_records_its_layer(name):
    """The state names the layer type and sizes; it survives saving and pytree maps, and a
    detached plain copy (truncated backpropagation) continues the sequence as the state does."""
    layer = make_layer(name)
    x = inputs(2, 5)
    _, state = layer(x)
    assert isinstance(state, LayerState) and state.made_by == layer.state_signature
    assert state.made_by.startswith(type(layer).__name__ + "(hidden_size=24, num_heads=2, ")
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)  # weights_only
    assert isinstance(loaded, LayerState) and loaded.made_by == state.made_by
    mapped = torch.utils._pytree.tree_map(lambda t: t.detach(), state)
    assert isinstance(mapped, LayerState) and mapped.made_by == state.made_by
    want, _ = layer(x, state)
    got, _ = layer(x, {k: v.detach() for k, v in state.items()})
    assert torch.equal(got, want)
    other = LayerState(state.made_by.replace("hidden_size=24", "hidden_size=32"), state)
    with pytest.raises(ValueError, match=r"state was made by .*\(hidden_size=32, .*; this layer "
                                         r"is .*\(hidden_size=24, "):
        layer(x, other)


def test_conv_does_not_leak_across_sequences():
    conv = ShortConv(3).double()
    cu = torch.tensor([0, 4, 9])
    x = torch.randn(1, 9, 3, dtype=torch.float64)
    poked = x.clone()
    poked[:, :4] += 100.0  # change only the first sequence
    y, _ = conv(x, cu_seqlens=cu)
    y_poked, _ = conv(poked, cu_seqlens=cu)
    assert torch.equal(y[:, 4:], y_poked[:, 4:])
    assert not torch.equal(y[:, :4], y_poked[:, :4])


def _compile_over_lengths(name, backend, lengths=(17, 33, 50), layer=None):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    layer = make_layer(name, torch.float32) if layer is None else layer
    compiled = torch.compile(layer, backend=backend, fullgraph=True, dynamic=True)
    for i, T in enumerate(lengths):
        x = inputs(2, T, torch.float32, seed=T)
        y_eager, s_eager = layer(x)
        grads_eager = torch.autograd.grad(y_eager.square().sum(), list(layer.parameters()))
        # after the first length, a recompile raises instead of compiling again
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            y_comp, s_comp = compiled(x)
        grads_comp = torch.autograd.grad(y_comp.square().sum(), list(layer.parameters()))
        assert_close(y_comp, y_eager, 1e-5, f"{name} compiled value T={T}")
        assert_states_close(s_comp, s_eager, 1e-5, f"{name} compiled T={T}")
        assert isinstance(s_comp, LayerState) and s_comp.made_by == layer.state_signature
        for (pname, _), a, b in zip(layer.named_parameters(), grads_comp, grads_eager):
            assert_close(a, b, 1e-4, f"{name} compiled grad {pname} T={T}")
    assert not counters["graph_break"], counters["graph_break"]


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_compile_fullgraph_dynamic(name):
    # aot_eager: Dynamo + AOTAutograd over fake tensors, without Inductor's C++ build time
    _compile_over_lengths(name, "aot_eager")


@pytest.mark.parametrize("name", ["gdn", "kdn"])
def test_compile_packed_prefill_and_continuation(name):
    # cu_seqlens (conv gathers built on the device) and a carried state, over three lengths
    torch._dynamo.reset()
    layer = make_layer(name, torch.float32)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)
    for i, T in enumerate((17, 33, 50)):
        cu, x = torch.tensor([0, 3, T // 2, T]), inputs(1, T, torch.float32, seed=T)
        y1, s1 = layer(x, cu_seqlens=cu)
        y2, s2 = layer(x, s1, cu_seqlens=cu)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            c1, t1 = compiled(x, cu_seqlens=cu)
            c2, t2 = compiled(x, t1, cu_seqlens=cu)
        assert_close(c1, y1, 1e-6, f"{name} packed prefill T={T}")
        assert_close(c2, y2, 1e-6, f"{name} packed continuation T={T}")
        assert_states_close(t2, s2, 1e-6, f"{name} packed T={T}")


def test_compile_fullgraph_dynamic_inductor():
    _compile_over_lengths("gdn", "inductor")


def _qat_layer(**options):
    torch.manual_seed(0)
    return GatedDeltaNet(D, 2, 8, num_v_heads=4, head_v_dim=6, chunk_size=8, **options).float()


def test_gdn_layer_quantization_aware_training(monkeypatch):
    """state_qdq and w_quantizer reach chunk_gdn at every length (a decode length too: the
    quantization is defined on the chunked form) and change the output."""
    from kdn_compile.layers import gdn
    from kdn_compile.quantization import fp8_row_qdq

    layer = _qat_layer(state_qdq=True, state_qdq_block_v=4, w_quantizer=fp8_row_qdq)
    plain = _qat_layer()
    seen = []
    real = gdn.chunk_gdn
    monkeypatch.setattr(gdn, "chunk_gdn", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    layer(inputs(2, 5, torch.float32))  # one chunk from a zero state: nothing to quantize
    x = inputs(2, 19, torch.float32)
    assert (layer(x)[0] - plain(x)[0]).abs().max() > 1e-4
    assert len(seen) == 3 and all(  # then the plain layer's call
        kw["state_qdq"] and kw["state_qdq_block_v"] == 4 and kw["w_quantizer"] is fp8_row_qdq
        for kw in seen[:2])
    with pytest.raises(TypeError, match="state_qdq must be a bool, got str"):
        GatedDeltaNet(D, 2, 8, state_qdq="yes")
    with pytest.raises(TypeError, match="w_quantizer must be None or callable, got int"):
        GatedDeltaNet(D, 2, 8, w_quantizer=3)
    with pytest.raises(ValueError, match="state_qdq_block_v must be an int >= 1, got 0"):
        GatedDeltaNet(D, 2, 8, state_qdq_block_v=0)
    with pytest.raises(ValueError, match="KimiDeltaAttention takes no state_qdq or w_quantizer"):
        KimiDeltaAttention(D, 2, 8, state_qdq=True)


def test_compile_fullgraph_quantization_aware_layer():
    """A GDN layer with FP8 state QDQ and the example fake quantizer of W (ordinary PyTorch,
    traced between the two ops) compiles with fullgraph=True and dynamic lengths: no graph
    break, values and gradients as eager."""
    from kdn_compile.quantization import fp8_row_qdq

    layer = _qat_layer(state_qdq=True, state_qdq_block_v=4, w_quantizer=fp8_row_qdq)
    _compile_over_lengths("gdn-qat", "aot_eager", layer=layer)


class TestExport(expecttest.TestCase):
    def _export_round_trip(self, name):
        layer = make_layer(name, torch.float32)
        length = torch.export.Dim("T", min=2, max=1024)
        with kdn_compile.use_backend("reference"):
            program = torch.export.export(layer, (inputs(1, 19, torch.float32),),
                                          dynamic_shapes=({1: length},))
            buffer = io.BytesIO()
            torch.export.save(program, buffer)
            buffer.seek(0)
            loaded = torch.export.load(buffer)
            x = inputs(1, 45, torch.float32, seed=4)
            want, want_state = layer(x)
        for prog in (program, loaded):
            got, got_state = prog.module()(x)
            assert_close(got, want, 1e-6, f"exported {name} at T=45")
            assert_states_close(got_state, want_state, 1e-6, f"exported {name}")
            assert isinstance(got_state, LayerState) and got_state.made_by == layer.state_signature
        return sorted(
            str(node.target) for node in program.graph.nodes
            if node.op == "call_function" and str(node.target).startswith("kdn.")
        )

    def test_export_gdn(self):
        ops = self._export_round_trip("gdn")
        self.assertExpectedInline(str(ops), """['kdn.chunk_gdn_reference.default']""")

    def test_export_kda(self):
        ops = self._export_round_trip("kda")
        self.assertExpectedInline(str(ops), """['kdn.chunk_kda_reference.default']""")

    def test_export_kdn(self):
        ops = self._export_round_trip("kdn")
        self.assertExpectedInline(str(ops), """['kdn.diag_kdn_reference.default']""")

    def test_export_packed_sequences(self):
        # dynamic T and dynamic number of sequences (cu_seqlens has N + 1 >= 3 entries)
        layer = make_layer("gdn", torch.float32)
        shapes = {"x": {1: torch.export.Dim("T", min=2, max=1024)},
                  "cu_seqlens": {0: torch.export.Dim("N1", min=3, max=64)}}
        with kdn_compile.use_backend("reference"):
            example = (inputs(1, 40, torch.float32),), {"cu_seqlens": torch.tensor([0, 7, 40])}
            program = torch.export.export(layer, *example, dynamic_shapes=shapes)
            x, cu = inputs(1, 77, torch.float32, seed=5), torch.tensor([0, 5, 6, 30, 77])
            want, want_state = layer(x, cu_seqlens=cu)
        got, got_state = program.module()(x, cu_seqlens=cu)
        assert_close(got, want, 1e-6, "exported packed gdn")
        assert_states_close(got_state, want_state, 1e-6, "exported packed gdn")


@pytest.mark.parametrize("change", ["precision-bf16", "memory-f16", "transposed"])
def test_diag_kdn_short_step_without_gradients_takes_any_state(change):
    """Up to 8 tokens without gradients Diag-KDN decodes over a copy of the state; a state
    the decode pools do not take (another precision dtype, float16 memory, a transposed
    view) gives what the same step with gradients gives."""
    layer = make_layer("kdn", torch.float32)
    with torch.no_grad():
        _, state = layer(inputs(2, 11, torch.float32))
    state = dict(state)
    if change == "precision-bf16":
        state["precision"] = state["precision"].bfloat16()
    elif change == "memory-f16":
        state["memory"] = state["memory"].half()
    else:
        state["memory"] = state["memory"].transpose(-1, -2).contiguous().transpose(-1, -2)
    x = inputs(2, 3, torch.float32, seed=2)
    with torch.no_grad():
        y, new = layer(x, state)
    y_grad, new_grad = layer(x, state)  # parameters require grad: the chunked op
    assert_close(y, y_grad, 1e-5, f"y, {change}")
    assert_states_close({k: new[k] for k in ("memory", "precision")},
                        {k: new_grad[k].detach() for k in ("memory", "precision")}, 1e-5, change)
