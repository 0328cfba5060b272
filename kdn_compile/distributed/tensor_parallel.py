"""Tensor parallelism of the layers over heads, on ``torch.distributed.tensor.parallel``.

``parallelize_module(layer, mesh, tensor_parallel_plan(layer))`` shards a
:class:`~kdn_compile.layers.GatedDeltaNet`, :class:`~kdn_compile.layers.KimiDeltaAttention`
or :class:`~kdn_compile.layers.DiagKDN` over the heads: each rank of the mesh holds
``1 / R`` of the heads, runs their recurrences (the ``kdn`` ops' DTensor rules keep
them head-sharded, no communication) and the output projection sums the ranks'
parts (one all-reduce of ``[B, T, D]`` per layer, as in any row-wise linear layer).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from kdn_compile.layers import DiagKDN, GatedDeltaNet, KimiDeltaAttention

__all__ = ["tensor_parallel_plan", "HeadParallel"]


def _replicate_plain(module, inputs, mesh):
    """Plain tensors among a module's inputs (a caller's convolution window) as replicated
    DTensors, so they meet the module's replicated parameters; ``cu_seqlens`` stays plain."""
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if i == 1 and x is not None and not isinstance(x, DTensor) else x
        for i, x in enumerate(inputs))


class Replicated(ParallelStyle):
    """Every parameter of the module replicated (a norm's or the short convolution's
    per-channel weights, which act on head-sharded inputs elementwise)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=_replicate_plain)


class HeadParallel(ParallelStyle):
    """The plan of one layer: :attr:`plan` (submodule name -> style, for
    :func:`~torch.distributed.tensor.parallel.parallelize_module`) and the layer's own
    per-head parameters :attr:`head_parameters`, sharded on dim 0.

    Raises (when applied):
        ValueError: the layer's key or value heads do not split evenly over the mesh.
    """

    def __init__(self, plan: dict[str, ParallelStyle], head_parameters: tuple[str, ...],
                 heads: tuple[int, ...]):
        super().__init__()
        self.plan, self.head_parameters, self.heads = plan, head_parameters, heads

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        size = device_mesh.size()
        if any(h % size for h in self.heads):
            raise ValueError(f"tensor parallelism over {size} ranks needs head counts that "
                             f"split evenly, got {self.heads} (key, value heads)")
        parallelize_module(module, device_mesh, self.plan)
        for name in self.head_parameters:
            param = getattr(module, name)
            sharded = distribute_tensor(param.detach(), device_mesh, [Shard(0)])
            module.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
        return module


def tensor_parallel_plan(layer: nn.Module) -> HeadParallel:
    """How :func:`~torch.distributed.tensor.parallel.parallelize_module` shards ``layer``
    over heads.

    * Column-wise (:class:`~torch.distributed.tensor.parallel.ColwiseParallel`, outputs
      kept as DTensors sharded on their heads): the q, k, v projections and every
      per-head projection (GDN: ``a_proj``, ``b_proj``, ``gate_proj``; KDA: ``b_proj``
      and the second, per-head halves of the low-rank ``f_proj``, ``g_proj``; Diag-KDN:
      ``retention_proj``, ``omega_proj``, ``r_proj``, ``gate_proj``). The first,
      shared halves of KDA's low-rank projections stay as they are (replicated
      ``[D, V]``).
    * Replicated (:class:`Replicated`): the short convolution (q, k and v are
      convolved as separate blocks, each sharded on its heads) and the gated RMSNorm
      (one weight shared by the heads).
    * Sharded on dim 0: the layer's per-head parameters (``A_log``, ``dt_bias``, and
      Diag-KDN's ``initial_precision_param``).
    * Row-wise (:class:`~torch.distributed.tensor.parallel.RowwiseParallel`): ``o_proj``,
      whose all-reduce returns the layer's output as a plain, replicated tensor.

    The recurrences run on the head shards through the ``kdn`` ops' DTensor rules
    (:mod:`kdn_compile.ops.sharding`). The returned state is DTensors: the recurrent
    state sharded on heads, the convolution window replicated (its q, k, v blocks
    gathered: ``3 x (conv_size - 1)`` positions of every channel per row). Fixed-length
    batches; packed sequences (``cu_seqlens``) and the serving entry points
    (``step``) are not covered.

    Args:
        layer: a :class:`~kdn_compile.layers.GatedDeltaNet`,
            :class:`~kdn_compile.layers.KimiDeltaAttention` or
            :class:`~kdn_compile.layers.DiagKDN`.

    Returns:
        A :class:`HeadParallel`: pass it to ``parallelize_module(layer, mesh, plan)``, or
        as the value of the layer's name in a model's plan; ``plan.plan`` lists the
        submodules' styles.

    Raises:
        TypeError: ``layer`` is not one of those layers.

    Example (on each rank of a 1-D mesh)::

        mesh = torch.distributed.device_mesh.init_device_mesh("cuda", (world,))
        parallelize_module(layer, mesh, tensor_parallel_plan(layer))
        y, state = torch.compile(layer, fullgraph=True)(x)  # x, y: [B, T, D]
    """
    colwise = ["q_proj", "k_proj", "v_proj"]
    if isinstance(layer, KimiDeltaAttention):
        colwise += ["b_proj", "f_proj.1", "g_proj.1"]
        head_parameters, heads = ("A_log", "dt_bias"), (layer.num_heads, layer.num_v_heads)
    elif isinstance(layer, GatedDeltaNet):
        colwise += ["a_proj", "b_proj", "gate_proj"]
        head_parameters, heads = ("A_log", "dt_bias"), (layer.num_heads, layer.num_v_heads)
    elif isinstance(layer, DiagKDN):
        colwise += ["retention_proj", "omega_proj", "r_proj", "gate_proj"]
        head_parameters = ("A_log", "dt_bias", "initial_precision_param")
        heads = (layer.num_heads,)
    else:
        raise TypeError(f"tensor_parallel_plan takes a GatedDeltaNet, KimiDeltaAttention or "
                        f"DiagKDN layer, got {type(layer).__name__}")
    plan: dict[str, ParallelStyle] = {name: ColwiseParallel(use_local_output=False)
                                      for name in colwise}
    plan.update({"conv": Replicated(), "norm": Replicated(), "o_proj": RowwiseParallel()})
    return HeadParallel(plan, head_parameters, heads)
