"""Building blocks of the ``kdn`` op layer.

Each op family declares two forward ops with one schema:

* ``kdn::<name>``: a :func:`torch.library.triton_op` whose body launches the
  Triton kernels when it can and otherwise calls the reference op; it may
  append to the family's outputs tensors that only its backward reads (the
  kernels' saved tensors, declared once per family as a mapping from name to
  head dimension; see :meth:`FamilyOps.attach_kernels`);
* ``kdn::<name>_reference``: an opaque :func:`torch.library.custom_op` that runs
  the exact PyTorch reference. Its fake implementation reads input shapes only,
  so sequence lengths stay symbolic under ``torch.compile(dynamic=True)`` and
  ``torch.export``; its body may read ``cu_seqlens`` on the CPU.

Gradients of the reference path come from ``kdn::<name>_reference_bwd``, an op
that differentiates the reference with :func:`torch.autograd.grad`. Autograd does
not record inside an op's implementation (the dispatcher excludes the autograd
keys below the autograd layer), so that op re-admits them for the duration of
its body; this is what lets it pass ``opcheck`` and compile like any other op.
"""

from __future__ import annotations

import inspect
from typing import Callable, Mapping, Sequence

import torch
from torch._library.infer_schema import infer_schema

# The thread-local dispatch-key exclusions outside any op (autocast only):
# restored inside reference backward ops so that autograd records there.
_OUTSIDE_OP_EXCLUDE = torch._C._dispatch_tls_local_exclude_set()


def _recording_autograd():
    return torch._C._ForceDispatchKeyGuard(
        torch._C._dispatch_tls_local_include_set(), _OUTSIDE_OP_EXCLUDE
    )


def _fresh(result):
    """Outputs as new contiguous tensors, the layout every fake promises."""
    if isinstance(result, torch.Tensor):
        return result.detach().contiguous().clone()
    return tuple(_fresh(r) for r in result)


class _NoDoubleBackward(torch.autograd.Function):
    """Identity on a gradient that an op's backward formed under ``create_graph=True``;
    differentiating through it raises a ``NotImplementedError`` naming the op.

    The backward kernels are not differentiable (the Triton launches record nothing,
    and the reference backward ops register no autograd of their own), so without this
    node a second backward would fail with PyTorch's generic message, or, where a
    gradient comes from a launch that records nothing, miss that part silently.
    """

    @staticmethod
    def forward(ctx, op_name: str, anchor: torch.Tensor, grad: torch.Tensor):
        ctx.op_name = op_name
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx, _):
        raise NotImplementedError(
            f"kdn::{ctx.op_name} has no double backward: its gradients cannot be "
            "differentiated (create_graph=True, then a backward through them). For "
            "higher-order gradients call the plain-PyTorch references in "
            "kdn_compile.reference (same arguments)"
        )


def refuse_double_backward(op_name: str, inputs: Sequence, grads: Sequence) -> tuple:
    """``grads`` (an op's input gradients) behind :class:`_NoDoubleBackward` when the
    backward runs with ``create_graph=True`` (grad mode on) and something it read
    requires grad; unchanged otherwise."""
    tensors = [x for x in (*inputs, *grads) if isinstance(x, torch.Tensor)]
    anchor = next((x for x in tensors if x.requires_grad), None)
    if not torch.is_grad_enabled() or anchor is None:
        return tuple(grads)
    return tuple(
        g if g is None else _NoDoubleBackward.apply(op_name, anchor, g) for g in grads
    )


# The head "dimension" of a saved tensor that is a flat per-chunk buffer whose per-rank part
# is contiguous: DTensor shards it as Shard(0) (kdn_compile.ops.sharding).
FLAT = "flat"


def check_backward_arguments(bwd_op, leading: Sequence[str], saved: Mapping[str, object],
                             grads: int) -> None:
    """Raise TypeError unless the schema of ``bwd_op`` (a backward op, whose signature
    lists its arguments one by one) takes ``leading``, then one argument per name of
    ``saved`` (a family's declaration of its saved tensors) in its order, then ``grads``
    gradients."""
    names = [a.name for a in bwd_op._opoverload._schema.arguments]
    expected = [*leading, *saved]
    if names[: len(expected)] != expected or len(names) != len(expected) + grads:
        raise TypeError(
            f"{bwd_op._qualname} takes ({', '.join(names)}); its declaration asks for "
            f"({', '.join(expected)}) followed by {grads} gradients")


def saved_placeholders(like: torch.Tensor, n: int, heads: int) -> tuple[torch.Tensor, ...]:
    """``n`` empty tensors ``[heads, heads, heads, 0]`` in place of the saved outputs of a
    ``kdn::<name>`` op on a path that saves nothing (the reference, or a half that runs
    its reference math).

    The kernels' saved tensors hold their heads on dim 0 (a flat per-chunk buffer), 1
    (chunk states) or 2 (per-token tensors), where their DTensor rules shard them
    (:mod:`kdn_compile.ops.sharding`); sized in heads on all three, the placeholders
    take those placements too. DTensor may read an op's output metadata from this branch
    while its ranks run the kernels: it runs the op on fake tensors of the global shapes,
    which torch 2.11 builds on the CPU whatever the mesh's device.
    """
    return tuple(like.new_empty(heads, heads, heads, 0) for _ in range(n))


def fill_placeholders(outputs: Sequence, like: torch.Tensor, heads: int) -> tuple:
    """``outputs`` with a :func:`saved_placeholders` tensor in place of each None."""
    return tuple(saved_placeholders(like, 1, heads)[0] if t is None else t for t in outputs)


def empty_grads(like: torch.Tensor, inputs: Sequence) -> tuple[torch.Tensor, ...]:
    """Uninitialised gradients of ``inputs``, each of its input's shape and dtype; for an
    absent (None) input the empty tensor that stands for its gradient (``like``'s)."""
    return tuple(like.new_empty(0) if x is None else x.new_empty(x.shape) for x in inputs)


def _absent(inputs: dict) -> torch.Tensor:
    """The empty tensor that stands for the gradient of an absent optional input."""
    anchor = next(x for x in inputs.values() if isinstance(x, torch.Tensor))
    return anchor.new_empty(0)


def reference_vjp(reference: Callable, inputs: dict, differentiable: Sequence[str],
                  grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of ``reference(*inputs.values())`` (a tensor or a tuple) with respect to
    its ``differentiable`` inputs, in their order, against ``grads`` (one per output), by
    :func:`torch.autograd.grad`: each in its input's dtype, zeros where no output depends on
    the input, and for an absent (None) input the empty tensor that stands for its
    gradient. Inside an op's body, call it where autograd records
    (``_recording_autograd``)."""
    with torch.enable_grad():
        leaves = {
            n: (x.detach().requires_grad_() if n in differentiable and x is not None else x)
            for n, x in inputs.items()
        }
        outputs = reference(*leaves.values())
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
        wrt = [leaves[n] for n in differentiable if leaves[n] is not None]
        found = (
            torch.autograd.grad(
                [o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True
            )
            if pairs and wrt
            else [None] * len(wrt)
        )
    found = iter(found)
    result = []
    for name in differentiable:
        x = inputs[name]
        if x is None:
            result.append(_absent(inputs))
            continue
        grad = next(found)
        result.append(torch.zeros_like(x) if grad is None
                      else grad.to(x.dtype).contiguous().clone())
    return result


class FamilyOps:
    """The ops of one family and how its autograd is wired.

    Args:
        name: op name without namespace, e.g. ``"chunk_gdn"``.
        signature: a typed Python function whose parameters are the op's
            arguments (tensors, optional tensors, ints, floats, bools) and whose
            return annotation gives its outputs; it is never called.
        reference: runs the exact reference with the op's arguments, returns
            the op's outputs (a tensor or a tuple).
        fake: output metadata from input shapes only (same arguments).
        differentiable: names of the tensor arguments that get gradients.
    """

    def __init__(
        self,
        name: str,
        signature: Callable,
        reference: Callable,
        fake: Callable,
        differentiable: Sequence[str],
    ) -> None:
        self.name = name
        self.params = list(inspect.signature(signature).parameters)
        self.differentiable = tuple(differentiable)
        self.fake = fake
        self.reference = reference
        schema = infer_schema(signature, mutates_args=())
        self.num_outputs = self._count_outputs(schema)

        self.reference_op = torch.library.custom_op(
            f"kdn::{name}_reference",
            lambda *args: _fresh(reference(*args)),
            mutates_args=(),
            schema=schema,
        )
        self.reference_op.register_fake(fake)

        grads = ", ".join(f"Tensor grad_{i}" for i in range(self.num_outputs))
        # one gradient per differentiable input, a fixed tuple (DTensor shards each slot)
        count = len(self.differentiable)
        returns = "Tensor" if count == 1 else "(" + ", ".join(["Tensor"] * count) + ")"
        bwd_schema = schema[: schema.rindex(") ->")] + f", {grads}) -> {returns}"
        self.reference_bwd_op = torch.library.custom_op(
            f"kdn::{name}_reference_bwd",
            self._reference_vjp,
            mutates_args=(),
            schema=bwd_schema,
        )
        self.reference_bwd_op.register_fake(self._fake_grads)
        self.attach_autograd(self.reference_op, self.reference_backward)

    @staticmethod
    def _count_outputs(schema: str) -> int:
        returns = schema[schema.rindex("->") + 2 :].strip()
        return returns.count("Tensor") if returns.startswith("(") else 1

    # -- reference gradients -------------------------------------------------
    def _split(self, args):
        n = len(self.params)
        return dict(zip(self.params, args[:n])), list(args[n:])

    def _fake_grads(self, *args):
        inputs, _ = self._split(args)
        return self._returned(list(empty_grads(_absent(inputs),
                                               [inputs[n] for n in self.differentiable])))

    @staticmethod
    def _returned(grads: list):
        """The backward op's return: a tuple of gradients, or the one gradient alone."""
        return grads[0] if len(grads) == 1 else tuple(grads)

    def _reference_vjp(self, *args):
        inputs, grads = self._split(args)
        with _recording_autograd():
            return self._returned(reference_vjp(self.reference, inputs, self.differentiable,
                                                grads))

    def reference_backward(self, inputs: dict, grads: Sequence[torch.Tensor]) -> dict:
        """Gradients of the differentiable inputs through the reference bwd op."""
        values = self.reference_bwd_op(*(inputs[n] for n in self.params), *grads)
        values = (values,) if isinstance(values, torch.Tensor) else values
        return dict(zip(self.differentiable, values))

    def attach_kernels(self, op, kernel_bwd_op, saved: Mapping[str, object],
                       kernels: Callable[[dict], bool]) -> None:
        """Autograd of the family's kernel op ``op``, which returns the family's outputs
        followed by the tensors that ``saved`` declares (name: head dimension, in order).

        Where ``kernels(inputs)`` (the rule by which ``op`` picks its kernel branch), the
        gradients are ``kernel_bwd_op(*inputs, *saved tensors, *grads)``, one per
        differentiable input in order; elsewhere :meth:`reference_backward`'s. Raises
        TypeError unless ``kernel_bwd_op`` takes exactly those arguments
        (:func:`check_backward_arguments`).
        """
        check_backward_arguments(kernel_bwd_op, self.params, saved, self.num_outputs)

        def backward(inputs: dict, grads: list, saved: dict, path: bool) -> dict:
            if not path:
                return self.reference_backward(inputs, grads)
            found = kernel_bwd_op(*(inputs[n] for n in self.params), *saved.values(), *grads)
            return dict(zip(self.differentiable, found))

        self.attach_autograd(op, backward, saved=saved, path=kernels)

    # -- autograd wiring -----------------------------------------------------
    def attach_autograd(self, op, backward: Callable[..., dict],
                        saved: Mapping[str, object] | None = None,
                        path: Callable[[dict], object] | None = None) -> None:
        """Register autograd for ``op``: ``backward(inputs, grads) -> {name: grad}``.

        With ``saved`` (a family's declaration: name to head dimension, in order), ``op``
        returns the family's outputs followed by one tensor per name that only the backward
        reads (the kernels' saved tensors; the reference path returns placeholders for them):
        they are not differentiable, their gradients are never formed, and the backward
        gets them by name, ``saved={name: tensor}``. With ``path``, ``path(inputs)`` says
        whether the forward ran its kernels: it is evaluated as the forward returns (in
        ``setup_context``, on the inputs as the forward saw them), kept on the autograd
        context, which a traced graph keeps too, and handed to the backward as ``path=``.
        A gradient of an unused output is zeros of the fake's shape, formed here rather
        than by autograd: from the inputs, so that it is a tensor of their kind (a DTensor
        for DTensor inputs, where autograd's zeros would be plain).

        Raises TypeError unless ``op`` returns the family's outputs and one tensor per
        saved name.
        """
        params = self.params
        num_outputs = self.num_outputs
        names = tuple(saved or ())
        returns = len(op._opoverload._schema.returns)
        if returns != num_outputs + len(names):
            raise TypeError(f"{op._qualname} returns {returns} tensors, not the {num_outputs} "
                            f"outputs of kdn::{self.name} and the {len(names)} it saves")

        def setup_context(ctx, inputs, output):
            tensors = [x if isinstance(x, torch.Tensor) else None for x in inputs]
            extra = tuple(output[num_outputs:]) if names else ()
            ctx.save_for_backward(*tensors, *extra)
            ctx.plain = [None if isinstance(x, torch.Tensor) else x for x in inputs]
            ctx.was_tensor = [isinstance(x, torch.Tensor) for x in inputs]
            if path is not None:
                ctx.path = path(dict(zip(params, inputs)))
            if names:
                ctx.mark_non_differentiable(*extra)
            # saved: no zeros as large as the saved tensors; all: see _materialize
            ctx.set_materialize_grads(False)

        def backward_fn(ctx, *grads):
            stored = ctx.saved_tensors
            values = [s if t else p for s, p, t in zip(stored, ctx.plain, ctx.was_tensor)]
            inputs = dict(zip(params, values))
            grads = self._materialize(values, grads[:num_outputs])
            extra = {}
            if names:
                extra["saved"] = dict(zip(names, stored[len(params):]))
            if path is not None:
                extra["path"] = ctx.path
            found = backward(inputs, grads, **extra)
            result = tuple(
                found.get(n) if (n in self.differentiable and inputs[n] is not None) else None
                for n in params
            )
            return refuse_double_backward(self.name, (*values, *grads), result)

        op.register_autograd(backward_fn, setup_context=setup_context)

    def _materialize(self, values, grads) -> list:
        """``grads`` with zeros (of the fake's shapes) in place of missing ones."""
        if all(g is not None for g in grads):
            return list(grads)
        like = self.fake(*values)
        like = (like,) if isinstance(like, torch.Tensor) else like
        return [torch.zeros_like(o) if g is None else g for g, o in zip(grads, like)]
