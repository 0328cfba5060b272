"""One training step (forward + backward of the language-model loss) of a small Qwen3-Next
from Hugging Face transformers: transformers + FLA eager against transformers +
kdn_compile (:func:`~kdn_compile.integrations.transformers.use_kdn`) compiled with
``torch.compile(fullgraph=True)``.

The model: 4 decoder layers (3 Gated DeltaNet, 1 full attention, the real model's 3:1
pattern), hidden size 2048, dense feed-forward layers of 5120, vocabulary 8192, bf16; its
linear-attention layers have the real model's shape: the shape's ``H`` key heads (16 by
default) and ``2 H`` value heads of 128. The FLA row is transformers' own layer code with
FLA's ``chunk_gated_delta_rule`` as its recurrence, run eagerly (FLA's functions break
graphs under ``torch.compile``). Rows also give the graph breaks Dynamo finds in each model
(``torch._dynamo.explain`` on a short input). Needs transformers (the ``test`` extra).
"""

from __future__ import annotations

import copy

import torch

from kdn_compile.bench.timing import Shape, median_ms, peak_mib, relative_error, require_close

TITLE = ("Qwen3-Next training step (4 layers, hidden 2048, linear attention H key / 2H value "
         "heads of 128, bf16): transformers + kdn_compile compiled (fullgraph) vs transformers + FLA eager")
DEFAULT_SHAPES = (Shape(2, 4096, 16),)
CHECK_SHAPE = Shape(2, 256, 2)
TOLERANCE = 2e-2  # float32 logits, ours against FLA's recurrence (measured on tiny models: ~1e-5 on CPU)


def model(heads: int, hidden: int = 2048, layers: int = 4, vocab: int = 8192):
    """A randomly initialized ``Qwen3NextForCausalLM`` on CUDA (float32)."""
    import transformers

    head_dim = 128
    config = transformers.Qwen3NextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=5120 * hidden // 2048,
        num_hidden_layers=layers, num_attention_heads=hidden // 128, num_key_value_heads=2,
        head_dim=head_dim, linear_num_key_heads=heads, linear_num_value_heads=2 * heads,
        linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
        layer_types=["full_attention" if i % 4 == 3 or i == layers - 1 else "linear_attention"
                     for i in range(layers)],
        num_experts=0, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    torch.manual_seed(0)
    return transformers.Qwen3NextForCausalLM(config).cuda()


def with_fla(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with transformers' Qwen3-Next module calling FLA's functions as its
    recurrence, as transformers does where FLA is its kernel (a module-wide change: a
    model routed by ``use_kdn`` keeps kdn ops).

    fla-core 0.6.0 refuses its GDN backward on Hopper with Triton < 3.7.1 (a miscompiled
    gated kernel); the refusal is lifted so that it can be timed.
    """
    import fla.ops.common.chunk_o as chunk_o
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from transformers.models.qwen3_next import modeling_qwen3_next

    from kdn_compile.integrations.transformers import _taking_own_arguments

    chunk_o.TRITON_ABOVE_3_7_1 = True
    modeling_qwen3_next.torch_chunk_gated_delta_rule = _taking_own_arguments(chunk_gated_delta_rule)
    modeling_qwen3_next.torch_recurrent_gated_delta_rule = _taking_own_arguments(
        fused_recurrent_gated_delta_rule)
    return model


def _pair(heads: int, dtype: torch.dtype, **sizes):
    from kdn_compile.integrations.transformers import use_kdn

    base = model(heads, **sizes).to(dtype)
    return use_kdn(copy.deepcopy(base)), with_fla(base)


def _tokens(shape: Shape, vocab: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(1)
    return torch.randint(2, vocab, (shape.batch, shape.length), device="cuda", generator=generator)


def check(against_fla: bool) -> dict[str, float]:
    """A two-layer model's float32 logits, ours (kernels) against FLA's recurrence when
    ``against_fla``, else against kdn_compile's references in float64."""
    from kdn_compile._backend import use_backend

    ours, fla_model = _pair(CHECK_SHAPE.heads, torch.float32, hidden=256, layers=2, vocab=512)
    tokens = _tokens(CHECK_SHAPE, 512)
    with torch.no_grad():
        logits = ours(tokens, use_cache=False).logits
        if against_fla:
            expected = fla_model(tokens, use_cache=False).logits
        else:
            with use_backend("reference"):
                expected = ours.double()(tokens, use_cache=False).logits
    return require_close({"logits": relative_error(logits, expected)}, TOLERANCE, "qwen3next")


def _graph_breaks(fn, tokens: torch.Tensor) -> int:
    """Graph breaks Dynamo finds in ``fn`` on the first 64 tokens."""
    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(tokens[:, :64]).graph_break_count


def measure(shape: Shape, against_fla: bool) -> list[dict]:
    ours, fla_model = _pair(shape.heads, torch.bfloat16)
    vocab = ours.config.vocab_size
    tokens = _tokens(shape, vocab)

    def loss_of(m):
        return lambda t: m(input_ids=t, labels=t, use_cache=False).loss

    impls = {"ours": (torch.compile(loss_of(ours), fullgraph=True), loss_of(ours))}
    if against_fla:
        impls["FLA"] = (loss_of(fla_model), loss_of(fla_model))
    else:
        del fla_model
    # Dynamo's explain first: it resets Dynamo, which would drop a compiled model.
    breaks = {impl: _graph_breaks(traced, tokens) for impl, (_, traced) in impls.items()}
    torch._dynamo.reset()
    rows = []
    for impl, (fn, _) in impls.items():
        def step(fn=fn):
            fn(tokens).backward()

        rows.append({"case": "train step", "impl": impl, "ms": median_ms(step),
                     "peak_mib": peak_mib(step), "graph_breaks": breaks[impl]})
        torch.cuda.empty_cache()
    return rows
