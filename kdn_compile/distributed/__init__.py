"""Past one device, on PyTorch's own distributed engine.

* Context parallelism (:mod:`kdn_compile.distributed.context`):
  :func:`chunk_gdn`, :func:`chunk_kda` and :func:`diag_kdn` take the single-device
  function's arguments plus ``group`` and run a sequence split along time across the
  group's ranks, through functional collectives that ``torch.compile`` traces.

The math and the cost per rank are in :doc:`/distributed`.
"""

from kdn_compile.distributed.context import chunk_gdn, chunk_kda, diag_kdn

__all__ = ["chunk_gdn", "chunk_kda", "diag_kdn"]
