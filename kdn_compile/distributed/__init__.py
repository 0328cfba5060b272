"""Past one device, on PyTorch's own distributed engine.

* Tensor parallelism over heads: every ``torch.ops.kdn`` op has DTensor sharding rules
  (:mod:`kdn_compile.ops.sharding`, registered on ``import kdn_compile``), and
  :func:`tensor_parallel_plan` shards a layer with ``parallelize_module``.
* Context parallelism (:mod:`kdn_compile.distributed.context`):
  :func:`chunk_gdn`, :func:`chunk_kda` and :func:`diag_kdn` take the single-device
  function's arguments plus ``group`` and run a sequence split along time across the
  group's ranks, through functional collectives inside ``kdn`` ops that
  ``torch.compile`` traces. Every rank must pass the same ``cu_seqlens`` (and initial
  states); that is not checked across ranks (it would take a collective and a host sync).

The math and the cost per rank are in :doc:`/distributed`.
"""

from kdn_compile.distributed.context import chunk_gdn, chunk_kda, diag_kdn
from kdn_compile.distributed.tensor_parallel import tensor_parallel_plan

__all__ = ["chunk_gdn", "chunk_kda", "diag_kdn", "tensor_parallel_plan"]
