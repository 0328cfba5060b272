"""The main job: a character-level language model trained under ``torch.compile``.

``kdn-compile demo`` trains a small model made of :mod:`kdn_compile.layers` on
the Python standard library's own source files (no download), then reports
what capture did: loss before/after, graph breaks, recompiles, compile time,
eager vs compiled step time, prefill-then-decode against one full pass, a
``torch.export`` round of one layer, 200 generated characters, and the speed of
greedy generation with the layers' ``step`` over slot caches, eager and compiled.
``--state-qdq`` trains the GDN layers quantization-aware (FP8 state QDQ and a fake
quantizer of ``W``; :func:`kdn_compile.chunk_gdn`).
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from kdn_compile._backend import get_backend
from kdn_compile.layers import DiagKDN, GatedDeltaNet, KimiDeltaAttention
from kdn_compile.quantization import fp8_row_qdq

LAYERS = {"gdn": GatedDeltaNet, "kda": KimiDeltaAttention, "kdn": DiagKDN}
VOCAB = ["\n"] + [chr(c) for c in range(32, 127)]  # printable ASCII; anything else reads as "?"
PROMPT = "def __init__(self"
DECODED = 8  # tokens decoded one by one after the prefill in the exactness check
DECODE_TOLERANCE = 1e-4  # chunked vs token-by-token float32 rounding is ~1e-6 here
PROGRESS_SECONDS = 10.0  # one plain progress line this often when stdout is not a terminal


def load_corpus(max_chars: int = 300_000) -> str:
    """The standard library's public top-level ``.py`` files, sorted, up to ``max_chars``."""
    folder = os.path.dirname(os.__file__)
    parts, total = [], 0
    for path in sorted(glob.glob(os.path.join(folder, "*.py"))):
        if os.path.basename(path).startswith("_"):
            continue
        with open(path, encoding="utf-8", errors="replace") as handle:
            text = handle.read().replace("\t", "    ")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


def encode(text: str) -> torch.Tensor:
    index = {c: i for i, c in enumerate(VOCAB)}
    unknown = index["?"]
    return torch.tensor([index.get(c, unknown) for c in text], dtype=torch.long)


def decode(ids) -> str:
    return "".join(VOCAB[i] for i in ids)


class Block(nn.Module):
    def __init__(self, dim: int, mixer: nn.Module):
        super().__init__()
        self.mixer_norm, self.mixer = nn.RMSNorm(dim), mixer
        self.mlp_norm = nn.RMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, state=None):
        mixed, state = self.mixer(self.mixer_norm(x), state)
        x = x + mixed
        return x + self.mlp(self.mlp_norm(x)), state

    def step(self, x, cache, slots):
        """``forward`` over the slots ``slots`` of the mixer's ``cache``, updated in place."""
        x = x + self.mixer.step(self.mixer_norm(x), cache, slots)
        return x + self.mlp(self.mlp_norm(x))


class CharLM(nn.Module):
    """Embedding, ``depth`` blocks of (RMSNorm, mixer, residual, RMSNorm, MLP, residual), head.

    ``forward(ids [B, T], states=None) -> (logits [B, T, vocab], states)``;
    ``states`` (one per block) continue a sequence across calls. ``quantized`` (GDN only):
    quantization-aware mixers, FP8 state QDQ and :func:`~kdn_compile.quantization.fp8_row_qdq`
    on ``W`` (see :meth:`set_quantized`).
    """

    def __init__(self, layer: str, vocab: int, dim: int = 64, depth: int = 2, heads: int = 2,
                 quantized: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        mixer = LAYERS[layer]
        self.blocks = nn.ModuleList(
            Block(dim, mixer(dim, heads, dim // heads)) for _ in range(depth)
        )
        self.norm, self.head = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.set_quantized(quantized)

    def set_quantized(self, quantized: bool) -> None:
        """Switch the GDN mixers' quantization-aware training on (FP8 state QDQ and the
        per-row E4M3 fake quantizer of ``W``) or off."""
        for block in self.blocks:
            block.mixer.state_qdq = quantized
            block.mixer.w_quantizer = fp8_row_qdq if quantized else None

    def allocate_caches(self, num_slots: int, device=None) -> list[dict]:
        """One slot cache per block (:meth:`GatedDeltaNet.allocate_cache` and the others)."""
        return [block.mixer.allocate_cache(num_slots, device=device) for block in self.blocks]

    def step(self, ids, caches, slots):
        """``ids [B, T]`` continuing the sequences in slots ``slots [B]`` of ``caches``:
        ``logits [B, T, vocab]``; the caches advance in place (a prompt, or decode steps)."""
        x = self.embed(ids)
        for block, cache in zip(self.blocks, caches):
            x = block.step(x, cache, slots)
        return self.head(self.norm(x))

    def forward(self, ids, states=None):
        x = self.embed(ids)
        states = [None] * len(self.blocks) if states is None else states
        new_states = []
        for block, state in zip(self.blocks, states):
            x, state = block(x, state)
            new_states.append(state)
        return self.head(self.norm(x)), new_states


def _loss(model, ids, targets):
    logits, _ = model(ids)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batch(data, batch, length, generator, device):
    starts = torch.randint(0, data.numel() - length - 1, (batch,), generator=generator)
    rows = torch.stack([data[s : s + length + 1] for s in starts.tolist()])
    return rows[:, :-1].to(device), rows[:, 1:].to(device)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _step_times(loss_fns, model, ids, targets, device, repeats=5):
    """Median seconds of one forward + backward for each of ``loss_fns``.

    The functions take turns, so load from elsewhere on the machine falls on
    all of them alike; gradients are discarded.
    """
    times = [[] for _ in loss_fns]
    for _ in range(repeats):
        for fn, bucket in zip(loss_fns, times):
            _sync(device)
            start = time.perf_counter()
            fn(model, ids, targets).backward()
            _sync(device)
            bucket.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    return [statistics.median(bucket) for bucket in times]


@torch.no_grad()
def decode_matches_full_pass(model, prompt_ids, prefill: int) -> float:
    """Max |logits| difference between one pass and prefill + token-by-token decode."""
    full, _ = model(prompt_ids)
    logits, states = model(prompt_ids[:, :prefill])
    pieces = [logits]
    for t in range(prefill, prompt_ids.shape[1]):
        logits, states = model(prompt_ids[:, t : t + 1], states)
        pieces.append(logits)
    return (torch.cat(pieces, dim=1) - full).abs().max().item()


def export_layer(layer: nn.Module, dim: int, device) -> tuple[list[str], float]:
    """Export ``layer`` with a dynamic sequence length, run it at another length.

    Returns the ``kdn`` op targets in the exported graph and the max abs
    difference from the eager layer at the new length.
    """
    length = torch.export.Dim("T", min=2, max=4096)
    example = torch.randn(1, 37, dim, device=device)
    program = torch.export.export(layer, (example,), dynamic_shapes=({1: length},))
    ops = sorted(
        str(node.target) for node in program.graph.nodes
        if node.op == "call_function" and str(node.target).startswith("kdn.")
    )
    other = torch.randn(1, 91, dim, device=device)
    with torch.no_grad():
        got, _ = program.module()(other)
        want, _ = layer(other)
    return ops, (got - want).abs().max().item()


@torch.no_grad()
def generate(model, prompt: str, count: int, generator, device, temperature=0.8) -> str:
    ids = encode(prompt)[None].to(device)
    logits, states = model(ids)
    out = []
    for _ in range(count):
        probs = (logits[0, -1].float() / temperature).softmax(-1).cpu()
        nxt = torch.multinomial(probs, 1, generator=generator).item()
        out.append(nxt)
        logits, states = model(torch.tensor([[nxt]], device=device), states)
    return decode(out)


@torch.no_grad()
def generation_speed(model, tokens: int, device, compile_backend: str | None) -> dict:
    """Greedy generation after ``PROMPT`` with the layers' ``step`` over slot caches.

    The prompt goes in as one step (the chunked ops), then ``tokens`` single-token
    steps (the decode ops), each token picked on the device (no host sync). The decode
    steps run eagerly, and, with ``compile_backend``, through ``torch.compile(fullgraph=
    True)`` (``mode="reduce-overhead"``, CUDA graphs, on CUDA). Returns tokens/s of each
    and whether both picked the same tokens.
    """
    prompt = encode(PROMPT)[None].to(device)
    slots = torch.zeros(1, dtype=torch.long, device=device)
    caches = model.allocate_caches(1, device=device)

    def decode_tokens(step, count):
        for block, cache in zip(model.blocks, caches):
            block.mixer.reset_cache(cache, slots)
        nxt = model.step(prompt, caches, slots)[:, -1:].argmax(-1)
        out = [nxt]
        _sync(device)
        start = time.perf_counter()
        for _ in range(count):
            nxt = step(nxt, caches, slots)[:, -1:].argmax(-1)
            out.append(nxt)
        _sync(device)
        return torch.cat(out, dim=1), count / (time.perf_counter() - start)

    decode_tokens(model.step, 2)  # warm-up
    ids, report = decode_tokens(model.step, tokens)
    report = {"gen_tokens": tokens, "gen_eager_tok_s": report}
    if compile_backend is not None:
        mode = "reduce-overhead" if device.type == "cuda" else None
        step = torch.compile(model.step, fullgraph=True, dynamic=False, mode=mode,
                             backend=compile_backend)
        print("compiling the decode step for generation ...", flush=True)
        decode_tokens(step, 3)  # compile, then (CUDA) warm up and record the graph
        compiled_ids, report["gen_compiled_tok_s"] = decode_tokens(step, tokens)
        report["gen_same_tokens"] = torch.equal(ids, compiled_ids)
        report["gen_mode"] = mode or "default"
    return report


def _dynamo_counts() -> tuple[int, int]:
    """(graph breaks, graphs compiled) so far in this process."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def train(model, loss_fn, train_ids, args, generator, device) -> float:
    """AdamW over random windows; returns the first step's seconds.

    Progress goes to a redrawn bar on a terminal and, when stdout is not one (a log, a
    pipe), to one plain line about every ``PROGRESS_SECONDS`` and after the last step.
    """
    from tqdm import tqdm

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    tokens = args.batch * args.length
    first_step = 0.0
    plain = not sys.stdout.isatty()
    bar = tqdm(range(args.steps), desc="train", unit="step", disable=plain)
    last_line = time.perf_counter()
    for step in bar:
        ids, targets = _batch(train_ids, args.batch, args.length, generator, device)
        _sync(device)
        start = time.perf_counter()
        loss = loss_fn(model, ids, targets)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        elapsed = time.perf_counter() - start
        first_step = elapsed if step == 0 else first_step
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens / elapsed:,.0f}")
        if plain and (time.perf_counter() - last_line >= PROGRESS_SECONDS
                      or step + 1 == args.steps):
            last_line = time.perf_counter()
            print(f"train step {step + 1}/{args.steps}: loss {loss.item():.3f}, "
                  f"{tokens / elapsed:,.0f} tok/s", flush=True)
    bar.close()
    return first_step


def run(args: argparse.Namespace) -> dict:
    """Train, check capture, generate; prints the report and returns its numbers."""
    if args.length <= DECODED:
        raise SystemExit(f"kdn-compile demo: --length must be > {DECODED}, got {args.length}")
    if args.state_qdq and args.layer != "gdn":
        raise SystemExit(f"kdn-compile demo: --state-qdq trains GDN layers (--layer gdn), "
                         f"got --layer {args.layer}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # measured on 2 cores, fwd+bwd of the default model: 1 thread 100 ms, 2 threads
        # 73 ms when idle but 1900 ms while other processes load the machine
        torch.set_num_threads(args.threads)
    try:
        return _run(args, device)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, device: torch.device) -> dict:
    started = time.perf_counter()
    torch.manual_seed(args.seed)
    data = encode(load_corpus())
    split = int(0.95 * data.numel())
    train_ids, held_out = data[:split], data[split:]
    model = CharLM(args.layer, len(VOCAB), dim=args.dim, depth=args.depth,
                   quantized=args.state_qdq).to(device)
    generator = torch.Generator().manual_seed(args.seed)
    eval_ids, eval_targets = _batch(held_out, args.batch, args.length, generator, device)
    compiled = not args.no_compile
    mode = (
        f"torch.compile(fullgraph=True, backend={args.compile_backend!r})" if compiled else "eager"
    )
    print(
        f"kdn-compile demo: {args.layer} x {args.depth} blocks, dim {args.dim}, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters; {len(data):,} chars of "
        f"stdlib source; {args.steps} steps of {args.batch} x {args.length} on {device}; "
        f"{mode}; kdn backend {get_backend()!r}"
        + ("; quantization-aware: FP8 state QDQ and fp8_row_qdq on W" if args.state_qdq else ""),
        flush=True,
    )
    report = {}
    with torch.no_grad():
        report["loss_before"] = _loss(model, eval_ids, eval_targets).item()

    torch._dynamo.reset()
    breaks, graphs = _dynamo_counts()
    loss_fn = (
        torch.compile(_loss, fullgraph=True, backend=args.compile_backend) if compiled else _loss
    )
    if compiled:
        print("compiling the model (first step, about 30-45 s on a 2-core CPU) ...", flush=True)
    first_step = train(model, loss_fn, train_ids, args, generator, device)
    with torch.no_grad():
        report["loss_after"] = _loss(model, eval_ids, eval_targets).item()
    if compiled:
        print("timing eager and compiled steps, checking prefill + decode and torch.export ...",
              flush=True)
        eager, fast = _step_times((_loss, loss_fn), model, eval_ids, eval_targets, device)
        report.update(eager_step_s=eager, compiled_step_s=fast, compile_s=first_step - fast)
        report["graph_breaks"] = _dynamo_counts()[0] - breaks
        report["graphs"] = _dynamo_counts()[1] - graphs
        report["recompiles"] = max(report["graphs"] - 1, 0)
    else:
        (report["eager_step_s"],) = _step_times((_loss,), model, eval_ids, eval_targets, device)

    # Quantization-aware training done: the checks below run the model unquantized (the
    # quantization depends on where chunks and calls start, so prefill + decode would not
    # equal one pass).
    model.set_quantized(False)
    report["quantized_training"] = args.state_qdq
    model.eval()
    prompt = eval_ids[:1, :48]
    report["prefill"], report["decoded"] = prompt.shape[1] - DECODED, DECODED
    report["decode_max_diff"] = decode_matches_full_pass(model, prompt, prefill=report["prefill"])
    report["export_ops"], report["export_max_diff"] = export_layer(
        model.blocks[0].mixer, args.dim, device
    )
    report["sample"] = generate(model, PROMPT, 200, generator, device)
    tokens = args.generate or (256 if device.type == "cuda" else 8)
    report.update(generation_speed(model, tokens, device,
                                   args.compile_backend if compiled else None))
    report["total_s"] = time.perf_counter() - started
    _print_report(report)
    return report


def _print_report(r: dict) -> None:
    ok = lambda good: "ok" if good else "MISMATCH"  # noqa: E731
    print("\n== report ==")
    print(f"loss on a held-out batch: {r['loss_before']:.3f} before, {r['loss_after']:.3f} after")
    if "compiled_step_s" in r:
        print(f"graph breaks: {r['graph_breaks']}   graphs compiled: {r['graphs']}   "
              f"recompiles: {r['recompiles']}")
        print(f"compile time: {r['compile_s']:.1f} s (first step minus a compiled step)")
        speedup = r["eager_step_s"] / r["compiled_step_s"]
        print(f"step (fwd+bwd): eager {1e3 * r['eager_step_s']:.1f} ms, compiled "
              f"{1e3 * r['compiled_step_s']:.1f} ms ({speedup:.2f}x)")
    else:
        print(f"step (fwd+bwd): eager {1e3 * r['eager_step_s']:.1f} ms (--no-compile)")
    if r["quantized_training"]:
        print("trained quantization-aware (FP8 state QDQ, fp8_row_qdq on W); the checks below "
              "run unquantized")
    d = r["decode_max_diff"]
    print(f"prefill {r['prefill']} + decode {r['decoded']} tokens vs one pass: "
          f"max |logit diff| {d:.1e} "
          f"({ok(d < DECODE_TOLERANCE)})")
    e = r["export_max_diff"]
    ops = ", ".join(op.replace(".default", "") for op in r["export_ops"])
    print(f"torch.export of blocks[0].mixer (dynamic T, ops: {ops}), run at T=91: "
          f"max |diff| {e:.1e} ({ok(e < DECODE_TOLERANCE)})")
    if "gen_eager_tok_s" in r:
        line = (f"generation with step over slot caches ({r['gen_tokens']} greedy tokens): "
                f"eager {r['gen_eager_tok_s']:,.0f} tok/s")
        if "gen_compiled_tok_s" in r:
            same = "same tokens" if r["gen_same_tokens"] else "different tokens"
            line += (f", compiled ({r['gen_mode']}) {r['gen_compiled_tok_s']:,.0f} tok/s "
                     f"({r['gen_compiled_tok_s'] / r['gen_eager_tok_s']:.2f}x, {same})")
        print(line)
    print(f"total: {r['total_s']:.0f} s")
    print(f"200 characters sampled after {PROMPT!r}:\n{PROMPT}{r['sample']}")


def _at_least(low: int):
    """An argparse type: an int ``>= low`` (the error names the bound and the value)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--steps", type=_at_least(1), default=150, help="training steps (default 150)")
    add("--device", default=None, help="cpu, cuda, ... (default: cuda when present, else cpu)")
    add("--layer", choices=sorted(LAYERS), default="gdn", help="token mixer (default gdn)")
    add("--no-compile", action="store_true", help="train eagerly instead of torch.compile")
    add("--compile-backend", default="inductor",
        help="torch.compile backend (default inductor; aot_eager skips code generation)")
    add("--seed", type=int, default=0, help="seed of the weights, batches and sampling (default 0)")
    add("--threads", type=_at_least(1), default=1,
        help="CPU threads (default 1: this model is too small to gain much from more, and "
             "spinning threads slow it down many times over on a busy machine)")
    add("--dim", type=_at_least(1), default=64, help="model width (default 64)")
    add("--depth", type=_at_least(1), default=2, help="blocks (default 2)")
    add("--batch", type=_at_least(1), default=16, help="sequences per step (default 16)")
    add("--length", type=_at_least(DECODED + 1), default=128,
        help=f"characters per sequence, > {DECODED} (default 128)")
    add("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    add("--state-qdq", action="store_true",
        help="quantization-aware training of the GDN layers: FP8 E4M3 fake quantization of "
             "the recurrent state and of W (kdn_compile.quantization.fp8_row_qdq); the "
             "inference checks after training run unquantized")
    add("--generate", type=int, default=None,
        help="greedy tokens timed with the layers' step (default 256 on CUDA, 8 on the CPU)")
