"""Continuous batching with a prefix cache and speculative decoding over slot pools, on a
tiny hybrid model.

    python examples/serving.py [--requests 12] [--slots 4] [--draft 3] [--device cpu]

A model of Gated DeltaNet, Kimi Delta Attention and Diagonal KDN layers serves requests
that arrive over time, all starting with one 64-token system prompt: the first is
prefilled whole into a free slot of every layer's cache, keeping the state after the
system prompt in a checkpoint slot; each later one copies that slot into its own (a
prefix-cache hit) and prefills only its own tokens. Then it is decoded greedily with
drafts of ``--draft`` tokens that ``verify`` runs without touching the caches and
``commit`` keeps as far as the model agrees; a finished request frees its slot for the
next. The drafter proposes the tokens the model will produce with probability
0.6 (else a random token), so some drafts are accepted whole and some not at all. At the
end every generation is checked against plain one-token greedy decoding of the same
prompt, and the run prints its tokens per second.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from kdn_compile.layers import DiagKDN, GatedDeltaNet, KimiDeltaAttention

VOCAB, HIDDEN = 64, 32
SYSTEM = 64  # tokens of the shared system prompt: a multiple of the chunk size 64


class TinyHybrid(nn.Module):
    """Embedding, three token-mixing layers with residuals, a tied output head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([
            GatedDeltaNet(HIDDEN, num_heads=2, head_dim=8),
            KimiDeltaAttention(HIDDEN, num_heads=2, head_dim=8),
            DiagKDN(HIDDEN, num_heads=2, head_dim=8),
        ])

    def logits(self, h):
        return h @ self.embed.weight.T

    def step(self, tokens, caches, slots, **checkpoints):
        """Advance the named slots by ``tokens [B, T]``: logits ``[B, T, VOCAB]``;
        ``checkpoints``: ``checkpoint_indices`` and ``checkpoint_every`` of ``step``."""
        h = self.embed(tokens)
        for layer, cache in zip(self.layers, caches):
            h = h + layer.step(h, cache, slots, **checkpoints)
        return self.logits(h)

    def copy_slots(self, caches, source, destination):
        for layer, cache in zip(self.layers, caches):
            layer.copy_slots(cache, source, destination)

    def verify(self, tokens, caches, slots, drafts):
        h = self.embed(tokens)
        for layer, cache, buffers in zip(self.layers, caches, drafts):
            h = h + layer.verify(h, cache, slots, buffers)
        return self.logits(h)

    def commit(self, caches, slots, accepted, drafts):
        for layer, cache, buffers in zip(self.layers, caches, drafts):
            layer.commit(cache, slots, accepted, buffers)


def plain_generation(model, prompt, new_tokens, device):
    """Greedy one-token decoding of one prompt in a one-slot cache."""
    caches = [layer.allocate_cache(1, state_dtype=torch.float64) for layer in model.layers]
    slot = torch.zeros(1, dtype=torch.long, device=device)
    logits = model.step(prompt[None], caches, slot)
    out = [int(logits[0, -1].argmax())]
    while len(out) < new_tokens:
        logits = model.step(torch.tensor([[out[-1]]], device=device), caches, slot)
        out.append(int(logits[0, -1].argmax()))
    return out


def serve(model, requests, expected, num_slots, draft, device, gen):
    """Serves ``requests`` (``(arrival step, prompt, new tokens)``), drafting from
    ``expected`` (each request's plain generation); returns the generations and the
    accepted counts of every verified row."""
    # one slot more than the requests use: the checkpoint after the system prompt
    caches = [layer.allocate_cache(num_slots + 1, state_dtype=torch.float64)
              for layer in model.layers]
    checkpoint, prefix = torch.tensor([num_slots], device=device), None
    buffers = [layer.allocate_drafts(num_slots, draft, state_dtype=torch.float64)
               for layer in model.layers]
    free, active, done, waiting = list(range(num_slots)), {}, {}, sorted(
        range(len(requests)), key=lambda r: requests[r][0])
    step, counts, hits = 0, [], 0
    while waiting or active:
        while waiting and free and requests[waiting[0]][0] <= step:   # admit: prefill
            r = waiting.pop(0)
            slot = free.pop()
            _, prompt, _ = requests[r]
            own = torch.tensor([slot], device=device)
            if prefix is not None and torch.equal(prompt[:SYSTEM], prefix):  # a hit
                model.copy_slots(caches, checkpoint, own)
                logits = model.step(prompt[None, SYSTEM:], caches, own)
                hits += 1
            else:  # the whole prompt, keeping the state after the system prompt
                for cache, layer in zip(caches, model.layers):
                    layer.reset_cache(cache, [slot])
                logits = model.step(prompt[None], caches, own,
                                    checkpoint_indices=checkpoint[None],
                                    checkpoint_every=SYSTEM)
                prefix = prompt[:SYSTEM]
            active[slot] = (r, [int(logits[0, -1].argmax())])
        if active:
            # one verification for every slot, idle ones as padding rows
            slots = torch.full((num_slots,), -1, dtype=torch.long, device=device)
            tokens = torch.zeros(num_slots, draft, dtype=torch.long, device=device)
            for slot, (r, out) in active.items():
                slots[slot] = slot
                guess = expected[r][len(out):] + [0] * draft
                drafted = [guess[i] if torch.rand((), generator=gen) < 0.6
                           else int(torch.randint(VOCAB, (), generator=gen))
                           for i in range(draft - 1)]
                tokens[slot] = torch.tensor([out[-1]] + drafted)
            greedy = model.verify(tokens, caches, slots, buffers).argmax(-1)
            # row accepts its last token and each draft the model would have produced
            agree = (tokens[:, 1:] == greedy[:, :-1]).long().cumprod(-1).sum(-1)
            accepted = torch.where(slots >= 0, 1 + agree, 0)
            model.commit(caches, slots, accepted, buffers)
            counts += accepted[slots >= 0].tolist()
            for slot in list(active):
                r, out = active[slot]
                out += greedy[slot, : int(accepted[slot])].tolist()
                if len(out) >= requests[r][2]:
                    done[r] = out[: requests[r][2]]
                    del active[slot]
                    free.append(slot)
        step += 1
    return [done[r] for r in range(len(requests))], counts, hits


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--draft", type=int, default=3, help="tokens per verification, 1..8")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"seed {args.seed}")
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = TinyHybrid().to(args.device, torch.float64).eval()
    system = torch.randint(VOCAB, (SYSTEM,), generator=gen)         # a shared system prompt
    requests = [(int(torch.randint(0, 8, (), generator=gen)),      # arrival step
                 torch.cat((system, torch.randint(VOCAB, (int(torch.randint(1, 9, (),
                            generator=gen)),), generator=gen))).to(args.device),
                 int(torch.randint(4, 16, (), generator=gen)))     # tokens to generate
                for _ in range(args.requests)]
    with torch.no_grad():
        # the drafter's knowledge, and the check: plain decoding of every prompt
        expected = [plain_generation(model, p, n, args.device) for _, p, n in requests]
        start = time.perf_counter()
        generations, counts, hits = serve(model, requests, expected, args.slots, args.draft,
                                          args.device, gen)
        seconds = time.perf_counter() - start
    tokens = sum(len(g) for g in generations)
    mismatched = [r for r, (g, e) in enumerate(zip(generations, expected)) if g != e]
    print(f"{len(requests)} requests, {tokens} tokens in {seconds:.2f} s ({tokens / seconds:.0f} "
          f"tokens/s), {len(counts)} verified rows accepting {sum(counts) / len(counts):.2f} "
          f"of {args.draft} tokens on average, {hits} prefix-cache hits")
    print("generations equal plain greedy decoding:", not mismatched)
    if mismatched:
        raise SystemExit(f"requests {mismatched} differ from plain decoding")
    return {"accepted": counts, "generations": generations, "hits": hits}


if __name__ == "__main__":
    main()
