"""``kdn::scatter_slots``: write rows into a pool at named slots, padding rows skipped.

The layers' serving path (:meth:`kdn_compile.layers.GatedDeltaNet.step` and the
others) writes the new convolution windows and the prefill's final states back into
their pools with it: ``pool[indices[b]] = rows[b]`` for every ``indices[b] >= 0``, in
place, with no data-dependent shape and no host synchronization. Non-negative indices
must be distinct (the callers check them on the device).

* ``kdn::scatter_slots`` (triton_op): the kernel of ``lowering/slots.py`` where it can
  launch (CUDA; the CPU interpreter), else ``kdn::scatter_slots_reference``.
* ``kdn::scatter_slots_reference``: :func:`kdn_compile.reference.pools.scatter_slots`.

Both declare ``pool`` in ``mutates_args`` so functionalization, ``torch.compile`` and
CUDA graphs see the write. Neither is differentiable.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kdn_compile.ops._dispatch import TRITON, can_launch
from kdn_compile.reference.pools import scatter_slots

if TRITON:  # else the op takes its reference (see _dispatch.TRITON)
    from kdn_compile.lowering.slots import scatter_slots_fwd


@torch.library.custom_op("kdn::scatter_slots_reference", mutates_args=("pool",))
def scatter_slots_reference_op(pool: Tensor, indices: Tensor, rows: Tensor) -> None:
    """The reference (:func:`kdn_compile.reference.pools.scatter_slots`)."""
    scatter_slots(pool, indices, rows)


@scatter_slots_reference_op.register_fake
def _fake(pool, indices, rows):
    return None


@torch.library.triton_op("kdn::scatter_slots", mutates_args=("pool",))
def scatter_slots_op(pool: Tensor, indices: Tensor, rows: Tensor) -> None:
    """Rows into pool slots; Triton where it can launch, else the reference op."""
    if not can_launch(rows):
        torch.ops.kdn.scatter_slots_reference(pool, indices, rows)
        return
    scatter_slots_fwd(pool, indices.contiguous(), rows.contiguous())
