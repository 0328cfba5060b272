"""Context parallelism: one packed batch split along time over the ranks.

    python -m torch.distributed.run --nproc-per-node 2 examples/context_parallel.py

Gloo on the CPU; NCCL, one GPU per rank, where CUDA is available. Rank 0 prints the
largest difference between the ranks' outputs and final states and those of
kdn_compile.chunk_gdn on the whole sequence in one process.
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import kdn_compile
import kdn_compile.distributed as kd

# one GPU a rank where there are enough, else gloo on the CPU
device = "cuda" if torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"]) else "cpu"
if device == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if device == "cuda" else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()

# the same inputs on every rank: 3 packed sequences of 128 tokens, 4 heads
T, H, K, V = 128, 4, 16, 16
gen = torch.Generator().manual_seed(0)
q = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1).to(device)
k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1).to(device)
v = torch.randn(1, T, H, V, generator=gen).to(device)
g = F.logsigmoid(torch.randn(1, T, H, generator=gen) + 4).to(device)   # log decays <= 0
beta = torch.rand(1, T, H, generator=gen).to(device)
cu_seqlens = torch.tensor([0, 40, 100, 128], device=device)  # the middle one spans ranks
h0 = (0.1 * torch.randn(3, H, K, V, generator=gen)).to(device)  # one initial state a sequence

L = T // world                                        # every rank holds L tokens
mine = slice(rank * L, (rank + 1) * L)
o, state = kd.chunk_gdn(q[:, mine], k[:, mine], v[:, mine], g[:, mine], beta[:, mine],
                        initial_state=h0, cu_seqlens=cu_seqlens)  # o: [1, L, H, V]

parts = [torch.empty_like(o) for _ in range(world)]
dist.all_gather(parts, o)                             # every rank's tokens, for the comparison
if rank == 0:
    o_one, state_one = kdn_compile.chunk_gdn(q, k, v, g, beta, initial_state=h0,
                                             cu_seqlens=cu_seqlens)
    difference = max((torch.cat(parts, dim=1) - o_one).abs().max().item(),
                     (state - state_one).abs().max().item())
    print(f"max difference to one process: {difference:.1e}")
dist.destroy_process_group()
