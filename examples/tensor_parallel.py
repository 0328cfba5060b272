"""Tensor parallelism: a GatedDeltaNet layer's heads split over the ranks.

    python -m torch.distributed.run --nproc-per-node 2 examples/tensor_parallel.py

Gloo on the CPU; NCCL, one GPU per rank, where CUDA is available. Rank 0 prints the
largest difference between the sharded layer's output and the same layer's on one process.
"""

import copy
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from kdn_compile.distributed import tensor_parallel_plan
from kdn_compile.layers import GatedDeltaNet

# one GPU a rank where there are enough, else gloo on the CPU
device = "cuda" if torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"]) else "cpu"
if device == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if device == "cuda" else "gloo")
mesh = init_device_mesh(device, (dist.get_world_size(),))

torch.manual_seed(0)                                  # the same weights and input on every rank
layer = GatedDeltaNet(64, num_heads=4, head_dim=16).to(device)
single = copy.deepcopy(layer)                         # unsharded, for the comparison
x = torch.randn(2, 100, 64, device=device)            # [B, T, D]

# each rank keeps 4 / R heads; in a model, the plan is the layer's entry in the model's plan
parallelize_module(layer, mesh, tensor_parallel_plan(layer))
step = torch.compile(layer, fullgraph=True)
y, state = step(x)                                    # y: [B, T, D], a plain tensor

if dist.get_rank() == 0:
    with torch.no_grad():
        expected, _ = single(x)
    print(f"max difference to one process: {(y - expected).abs().max().item():.1e}")
dist.destroy_process_group()
