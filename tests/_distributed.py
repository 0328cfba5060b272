"""Worker processes on one machine: ``spawn(fn, world)`` runs ``fn(rank, world)`` in
``world`` processes joined by a gloo process group and returns their results."""

from __future__ import annotations

import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# a collective that one rank never reaches fails the test instead of hanging it
TIMEOUT = datetime.timedelta(seconds=120)


def _main(rank, fn, world, folder):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank,
                            world_size=world, timeout=TIMEOUT)
    try:
        import kdn_compile

        kdn_compile.set_backend("reference")
        result = fn(rank, world)
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(folder, f"result{rank}.pt"))


def spawn(fn, world: int) -> list:
    """``[fn(rank, world) for each rank]``, each run in its own process (reference backend,
    one thread); ``fn`` must be importable by name (a module-level function)."""
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_main, args=(fn, world, folder), nprocs=world, join=True)
        return [torch.load(os.path.join(folder, f"result{r}.pt")) for r in range(world)]


def local_slice(x: dict, rank: int, world: int, replicated: tuple) -> dict:
    """Rank ``rank``'s leaves: its slice of the time axis (dim 1), replicated states whole."""
    length = next(t for n, t in x.items() if n not in replicated).shape[1] // world
    return {n: (t if n in replicated else t[:, rank * length:(rank + 1) * length])
            .detach().clone().requires_grad_(t.requires_grad) for n, t in x.items()}
