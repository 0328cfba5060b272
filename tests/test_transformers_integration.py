"""kdn_compile.integrations.transformers.use_kdn on a tiny random model of every layer
it routes (Gated DeltaNet: Qwen3-Next, Qwen3.5, Qwen3.5-MoE, Qwen4-Exp, Olmo Hybrid;
KDA: Kimi Linear, GLM-5.3-Flash): the same logits, gradients and greedy tokens as
transformers' own PyTorch path, packed sequences, a training step compiled with
fullgraph=True, and export. On CPU the kdn ops run their references; with CUDA the same
tests run again on the Triton kernels."""

import copy
import functools
import importlib
import inspect
import io
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (test extra)")

from kdn_compile.integrations.transformers import use_kdn  # noqa: E402

VOCAB = 97


# Tiny random models: hidden 32, one linear-attention layer and one full-attention layer;
# mixture-of-experts layers as small as their configs allow where a model has no dense ones.
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=8)
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
              layer_types=["linear_attention", "full_attention"],
              pad_token_id=0, bos_token_id=1, eos_token_id=None)
EXPERTS = dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
               shared_expert_intermediate_size=16)


def tiny(config, model, **kwargs):
    """A builder of ``transformers.<model>(transformers.<config>(**COMMON, **kwargs))``."""
    return lambda: getattr(transformers, model)(getattr(transformers, config)(**COMMON, **kwargs))


def glm5_next():
    # Text and vision model (transformers has no text-only one); its full attention is
    # MLA with a DSA token indexer; its KDA decay has linear_lower_bound -5 (the default).
    text = dict(**COMMON, intermediate_size=64, num_key_value_heads=2, kv_lora_rank=16,
                q_lora_rank=16, qk_rope_head_dim=0, qk_nope_head_dim=16, v_head_dim=16,
                index_topk=16, index_head_dim=16, index_n_heads=2, index_kpool=4, hc_mult=2,
                linear_head_dim=16, linear_num_heads=2, mlp_layer_types=["dense", "dense"])
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16,
                  out_hidden_size=32, projection_intermediate_size=16)
    config = transformers.Glm5NextConfig(text_config=text, vision_config=vision)
    return transformers.Glm5NextForConditionalGeneration(config)


MODELS = {
    "qwen3_next": tiny("Qwen3NextConfig", "Qwen3NextForCausalLM", **LINEAR, intermediate_size=64,
                       num_key_value_heads=1, head_dim=16, num_experts=0),
    "qwen3_5": tiny("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", **LINEAR, intermediate_size=64,
                    num_key_value_heads=1, head_dim=16),
    "qwen3_5_moe": tiny("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", **LINEAR, **EXPERTS,
                        num_key_value_heads=1, head_dim=16),
    # Two hyper-connection streams; its full attention is QSA, with a tiny token indexer.
    "qwen4_exp": tiny("Qwen4ExpTextConfig", "Qwen4ExpForCausalLM", **LINEAR, **EXPERTS,
                      num_key_value_heads=1, head_dim=16, hc_count=2, hc_lowrank=4,
                      indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                      indexer_budget=16, indexer_compress_ratio=4),
    # linear_allow_neg_eigval (its default): beta = 2 * sigmoid(b).
    "olmo_hybrid": tiny("OlmoHybridConfig", "OlmoHybridForCausalLM", **LINEAR,
                        intermediate_size=64, num_key_value_heads=1),
    "kimi_linear": tiny("KimiLinearConfig", "KimiLinearForCausalLM", intermediate_size=64,
                        num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        linear_head_dim=16, linear_num_heads=2,
                        mlp_layer_types=["dense", "dense"]),
    "glm5_next": glm5_next,
}
DEVICES = ["cpu", pytest.param("cuda", marks=(pytest.mark.gpu, pytest.mark.slow))]
# float32 kernels against transformers' own float32 loops: the kernels' chunked sums round
# differently from the loops (CPU runs the exact references).
TOLERANCE = {"cpu": dict(rtol=1e-4, atol=1e-5), "cuda": dict(rtol=1e-3, atol=1e-4)}
LINEAR_LAYER = {"qwen3_next": "Qwen3NextGatedDeltaNet", "qwen3_5": "Qwen3_5GatedDeltaNet",
                "qwen3_5_moe": "Qwen3_5MoeGatedDeltaNet", "qwen4_exp": "Qwen4ExpTextGatedDeltaNet",
                "olmo_hybrid": "OlmoHybridGatedDeltaNet", "kimi_linear": "KimiLinearDeltaAttention",
                "glm5_next": "Glm5NextTextLinearAttention"}
KDA = ("kimi_linear", "glm5_next")


# transformers binds these to FLA's Triton kernels at import when FLA is installed, whatever
# the device: CPU runs need its PyTorch loops back.
FLA_BOUND = {name: ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention") if name in KDA
             else ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
             for name in MODELS}


@pytest.fixture(autouse=True)
def torch_loops_on_cpu(request, monkeypatch):
    params = getattr(request.node, "callspec", None)
    if params is None or params.params.get("device", "cpu") != "cpu":
        return
    for name, functions in FLA_BOUND.items():
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        for function in functions:
            monkeypatch.setattr(module, function, inspect.unwrap(getattr(module, function)))


def build(name, device="cpu"):
    torch.manual_seed(0)
    model = MODELS[name]().float().eval().to(device)
    return model, use_kdn(copy.deepcopy(model))


def linear_layers(model, name):
    return [m for m in model.modules() if type(m).__name__ == LINEAR_LAYER[name]]


def tokens(batch=2, length=37, seed=1, device="cpu"):
    ids = torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    return ids.to(device)


def test_import_does_not_import_transformers():
    code = ("import sys, kdn_compile, kdn_compile.fla, kdn_compile.integrations.transformers; "
            "sys.exit('transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("name", MODELS)
def test_routes_only_linear_layers_and_is_idempotent(name):
    model, kdn = build(name)
    patched = [m for m in kdn.modules() if "forward" in m.__dict__]
    assert patched == linear_layers(kdn, name) and patched
    forwards = [m.forward for m in patched]
    assert use_kdn(kdn) is kdn
    assert [m.forward for m in patched] == forwards
    assert not [m for m in model.modules() if "forward" in m.__dict__]


def test_a_forward_set_on_the_instance_is_kept_or_refused():
    """A layer whose instance already has its own ``forward`` (hooks such as accelerate's
    set one: a ``functools.partial`` wrapping the old one): use_kdn under it is left as it
    is; anything else is refused, naming the layer, rather than dropped."""
    def hook(model):
        layer = linear_layers(model, "qwen3_next")[0]
        inner = layer.forward
        hooked = functools.partial(lambda module, *args, **kwargs: inner(*args, **kwargs), layer)
        layer.forward = functools.update_wrapper(hooked, inner)
        return layer

    model, kdn = build("qwen3_next")
    hooked = hook(kdn).forward
    hook(model)
    assert use_kdn(kdn) is kdn and linear_layers(kdn, "qwen3_next")[0].forward is hooked
    with pytest.raises(RuntimeError, match=r"use_kdn cannot route model\.layers\.0\.linear_attn "
                                           r"\(Qwen3NextGatedDeltaNet\): its instance has its "
                                           r"own forward, a functools\.partial"):
        use_kdn(model)
    assert not [m for m in model.modules() if getattr(m.forward, "__kdn_compile__", False)]
    ids = tokens(length=9)
    with torch.no_grad():
        torch.testing.assert_close(kdn(ids).logits, model(ids).logits, **TOLERANCE["cpu"])


def test_routes_again_after_torch_load():
    """Pickled, a routed layer's forward comes back as transformers' own: use_kdn routes it."""
    _, kdn = build("qwen3_next")
    buffer = io.BytesIO()
    torch.save(kdn, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    layer = linear_layers(loaded, "qwen3_next")[0]
    assert not getattr(layer.forward, "__kdn_compile__", False)
    assert getattr(use_kdn(loaded) and layer.forward, "__kdn_compile__", False)


def test_no_such_layer_is_an_error():
    with pytest.raises(ValueError, match="no layer to route in Linear: it looks for .*"
                                         + ".*".join(LINEAR_LAYER.values())):
        use_kdn(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("model,received", [(None, "NoneType"), (torch.zeros(2), "torch.Tensor"),
                                            ("Qwen/Qwen3-Next-80B-A3B-Instruct", "str")])
def test_a_model_that_is_not_a_module_is_a_type_error(model, received):
    with pytest.raises(TypeError, match=rf"^use_kdn: model must be a torch\.nn\.Module, "
                                        rf"got {received}$"):
        use_kdn(model)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", MODELS)
def test_logits_equal_transformers(name, device):
    model, kdn = build(name, device)
    ids = tokens(device=device)
    with torch.no_grad():
        expected = model(ids).logits
        got = kdn(ids).logits
    torch.testing.assert_close(got, expected, **TOLERANCE[device])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", MODELS)
def test_packed_sequences_equal_separate_calls(name, device):
    """Sequences packed in one row with transformers' ``cu_seq_lens_q`` (an empty one
    included) give each sequence's own outputs, convolution and recurrence, eager and
    compiled; transformers' own layer lets the convolution run across the boundaries."""
    model, kdn = build(name, device)
    layer, theirs = linear_layers(kdn, name)[0], linear_layers(model, name)[0]
    hidden = torch.randn(1, 33, 32, device=device)
    cu = torch.tensor([0, 13, 13, 33], dtype=torch.int32, device=device)
    with torch.no_grad():
        separate = torch.cat([layer(hidden[:, :13]), layer(hidden[:, 13:])], 1)
        torch.testing.assert_close(layer(hidden, cu_seq_lens_q=cu), separate, **TOLERANCE[device])
        compiled = torch.compile(layer, fullgraph=True, dynamic=True)
        torch.testing.assert_close(compiled(hidden, cu_seq_lens_q=cu), separate,
                                   **TOLERANCE[device])
        assert not torch.allclose(theirs(hidden, cu_seq_lens_q=cu)[:, 13:], separate[:, 13:],
                                  **TOLERANCE[device])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", MODELS)
def test_greedy_generate_equals_transformers(name, device):
    model, kdn = build(name, device)
    ids = tokens(batch=2, length=11, seed=2, device=device)
    kwargs = dict(max_new_tokens=20, do_sample=False, min_new_tokens=20)
    expected = model.generate(ids, **kwargs)
    got = kdn.generate(ids, **kwargs)
    assert got.shape == (2, 31)
    assert torch.equal(got, expected)


# One model per recurrence family: every model's layer compiles in the packed-sequence test.
# Of the others, Qwen3.5-MoE's training step stops in transformers' mixture-of-experts
# backward and Qwen4-Exp's in its QSA token indexer (both data-dependent), not in a kdn op.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["qwen3_next", "kimi_linear"])
def test_compiled_training_step_fullgraph(name, device):
    model, kdn = build(name, device)
    if device == "cuda":
        # With FLA installed, transformers' own Qwen3-Next path is FLA, whose GDN backward
        # refuses Hopper GPUs under Triton < 3.7.1: compare with our kernels run eagerly.
        model = use_kdn(model)
    model.train(), kdn.train()
    ids = tokens(length=29, seed=3, device=device)
    # On CUDA through Inductor, which launches the kernels from its own code.
    compiled = torch.compile(kdn, fullgraph=True,
                             backend="inductor" if device == "cuda" else "aot_eager")
    torch._dynamo.reset()
    compiled(ids, labels=ids, use_cache=False).loss.backward()
    model(ids, labels=ids, use_cache=False).loss.backward()
    for (p_name, p), q in zip(model.named_parameters(), kdn.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **TOLERANCE[device],
                                   msg=lambda m: f"{p_name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", MODELS)
def test_export_linear_layer_keeps_kdn_ops(name, device):
    model, kdn = build(name, device)
    layer, reference = linear_layers(kdn, name)[0], linear_layers(model, name)[0]
    hidden = torch.randn(2, 24, 32, device=device)
    length = torch.export.Dim("T", min=2, max=512)
    program = torch.export.export(layer, (hidden,), dynamic_shapes=({1: length},))
    ops = sorted({str(n.target) for n in program.graph.nodes
                  if n.op == "call_function" and str(n.target).startswith("kdn.")})
    assert ops == exported_ops(device, name)
    other = torch.randn(2, 45, 32, device=device)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(other), reference(other), **TOLERANCE[device])


def exported_ops(device, name):
    """Exported on CPU, the layers keep the reference op; on CUDA the kernel's triton_op."""
    op = "chunk_kda" if name in KDA else "chunk_gdn"
    return [f"kdn.{op}{'_reference' if device == 'cpu' else ''}.default"]
