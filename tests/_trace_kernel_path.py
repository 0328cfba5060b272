"""Trace an op's Triton branch on the CPU as ``torch.compile``, opcheck and export do on a GPU.

``python tests/_trace_kernel_path.py export`` exports the GDN, KDA and Diag-KDN layers
with a dynamic length and prints ``exported`` and the ``kdn`` ops of each graph.
``python tests/_trace_kernel_path.py {gdn,gdn-qdq,wy,gain,kda,kdn}`` compiles a call of the op
``kdn::chunk_gdn`` (``gdn``; ``gdn-qdq`` with FP8 state QDQ), ``chunk_gdn`` with a
``w_quantizer`` (``wy``: the two ops of ``kdn_compile.ops.gdn_wy``), ``kdn::diag_kdn`` (gain kernels, memory by the reference math: ``gain``),
``kdn::chunk_kda`` (``kda``) or ``kdn::diag_kdn`` with the memory on the two-key
kernels (``kdn``), all its outputs returned as opcheck's AOT-dispatch test does, with
``fullgraph=True, dynamic=True`` through AOTAutograd: the op's saved outputs,
torch's Triton mutation analysis (given an sm_90 target) and the min-cut
partitioner (Inductor's, and opcheck's) all run, as on the H200. The kernel branch is forced on CPU fake
tensors; the captured graphs are not run. Prints ``counts [forward, backward]``:
the Triton kernel launches in each graph. Run without ``TRITON_INTERPRET``.

Several modes run in turn in one process (``python tests/_trace_kernel_path.py gdn kda``),
each after a line ``== MODE``; a mode that raises prints ``== MODE failed`` and its
traceback, the next modes still run, and the exit status is 1
(:func:`_helpers.trace_kernel_paths` runs it and splits the output by mode).
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import triton
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from triton.backends.compiler import GPUTarget

sys.path.insert(0, os.path.dirname(__file__))

import kdn_compile  # noqa: E402
from _inputs import delta_inputs, kdn_inputs  # noqa: E402
from kdn_compile.ops import gdn as gdn_ops  # noqa: E402
from kdn_compile.ops import gdn_wy as gdn_wy_ops  # noqa: E402
from kdn_compile.ops import kda as kda_ops  # noqa: E402
from kdn_compile.ops import kdn as kdn_ops  # noqa: E402


class _Sm90:  # what torch's Triton mutation analysis asks of the driver
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


class _Captured(Exception):
    pass


def export_layers() -> None:
    import kdn_compile.layers as layers

    for name, cls in (("gdn", layers.GatedDeltaNet), ("kda", layers.KimiDeltaAttention),
                      ("kdn", layers.DiagKDN)):
        torch.manual_seed(0)
        layer = cls(256, 2, 64).eval()
        seq = torch.export.Dim("seq", min=2, max=4096)
        with torch.no_grad(), kdn_compile.use_backend("triton"):
            program = torch.export.export(layer, (torch.randn(1, 192, 256),),
                                          dynamic_shapes=({1: seq},))
        print("exported", name, sorted({str(n.target) for n in program.graph.nodes
                                        if str(n.target).startswith("kdn.")}))


def main(which: str) -> None:
    triton.runtime.driver.set_active(_Sm90())
    for ops in (gdn_ops, gdn_wy_ops, kda_ops, kdn_ops):  # as on CUDA fake tensors
        ops.can_launch = lambda x: True
        ops.metadata_only = lambda x: False
    kdn_ops.kalman_gain_kernel_supports = lambda *args: True
    if which == "export":
        return export_layers()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes])

        def run(*args):
            raise _Captured
        return run

    if which in ("gdn", "gdn-qdq"):  # gdn-qdq: FP8 state QDQ, recomputed in the backward
        x = delta_inputs(B=2, T=70, Hk=1, Hv=2, K=16, V=16, dtype=torch.float32)

        def step(q, k, v, g, beta, initial_state):
            return torch.ops.kdn.chunk_gdn(q, k, v, g, beta, initial_state, None, 64, 0.25,
                                           False, which == "gdn-qdq", 64)
    elif which == "wy":  # chunk_gdn with a w_quantizer: two ops, a PyTorch callable between
        x = delta_inputs(B=2, T=70, Hk=1, Hv=2, K=16, V=16, dtype=torch.float32)

        def step(q, k, v, g, beta, initial_state):
            return kdn_compile.chunk_gdn(q, k, v, g, beta, initial_state=initial_state,
                                         w_quantizer=lambda w: w.clamp(-0.5, 0.5))
    elif which == "kda":
        x = delta_inputs(B=2, T=70, Hk=1, Hv=2, K=16, V=16, per_key=True, dtype=torch.float32)

        def step(q, k, v, g, beta, initial_state):
            # the op itself, as opcheck calls it: its saved tensors are outputs of the graph
            return torch.ops.kdn.chunk_kda(q, k, v, g, beta, initial_state, None, 64, 0.25,
                                           False)
    else:
        # gain: the memory by the reference math, traced chunk by chunk (symbolic shapes make
        # each chunk costly): 40 tokens are two chunks of 16 and a partial one
        x = kdn_inputs(B=2, T=40 if which == "gain" else 70, H=2, K=16, V=16,
                       dtype=torch.float32)
        chunk = 16 if which == "gain" else 64  # 64: the memory on the two-key kernels

        def step(*args):
            return torch.ops.kdn.diag_kdn(*args, None, 0.5, 0.8, chunk)

    @torch.compile(fullgraph=True, dynamic=True,
                   backend=aot_autograd(fw_compiler=capture, bw_compiler=capture,
                                        partition_fn=min_cut_rematerialization_partition))
    def f(*args):
        with kdn_compile.use_backend("triton"):
            return step(*args)

    try:
        f(*(t.requires_grad_() for t in x.values()))
    except _Captured:
        pass
    print("counts", [sum("triton_kernel_wrapper" in t for t in g) for g in graphs])


if __name__ == "__main__":
    failed = False
    for mode in sys.argv[1:]:
        print(f"== {mode}", flush=True)
        torch._dynamo.reset()
        try:
            main(mode)
        except Exception:  # noqa: BLE001 - report it under its mode, run the next
            failed = True
            print(f"== {mode} failed\n{traceback.format_exc()}", flush=True)
    sys.exit(1 if failed else 0)
