"""Where a kernel op's body decides between launching Triton and the reference."""

from __future__ import annotations

import importlib.util
import os

import torch

from kdn_compile._checks import tracing


def _triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


# Without Triton (macOS, Windows, a bare CPU install) the kernels are not even
# imported and every op runs its reference.
TRITON = _triton_installed()


def plain(x: torch.Tensor) -> bool:
    """``x`` is a tensor as its op runs it: plain, a parameter, or the fake and functional
    tensors of tracing; not a wrapper subclass (a DTensor) whose ops dispatch through
    sharding rules."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return type(x) in (torch.Tensor, torch.nn.Parameter) or isinstance(
        x, (FakeTensor, FunctionalTensor))


def can_launch(x: torch.Tensor) -> bool:
    """True when Triton kernels can run on ``x``'s device in this context.

    Never without Triton installed.
    On CUDA always (fake tensors included: ``wrap_triton`` traces them). On the
    CPU only eagerly under ``TRITON_INTERPRET=1``, for a plain tensor (or parameter)
    and not for bfloat16: interpreted kernels cannot be traced with fake tensors, so
    tracing on the CPU takes the reference, and so does a DTensor (whose sharding
    rules see the op as its fake tensors run it).
    """
    if not TRITON:
        return False
    if x.device.type == "cuda":
        return True
    return (
        x.device.type == "cpu"
        and plain(x)
        and os.environ.get("TRITON_INTERPRET") == "1"
        # The interpreter's bfloat16 tl.dot is wrong (triton 3.9): bf16 stays on the reference.
        and x.dtype != torch.bfloat16
        and not tracing(x)
    )


def metadata_only(x: torch.Tensor) -> bool:
    """True for the fake (or functional) tensors of a trace on a device where the kernels
    cannot launch: there a backward kernel op returns its gradients' metadata alone.

    Such an op is called only where its forward ran the kernels, so these are the fake
    tensors that DTensor runs it on to propagate metadata from the global shapes (built on
    the CPU whatever the mesh's device by torch 2.11), and its saved tensors are the
    forward reference branch's placeholders, from which no kernel computes.
    """
    return tracing(x) and not can_launch(x)


def interpreted_ok(q: torch.Tensor, state_dtypes) -> bool:
    """On the CPU (Triton's interpreter) no bfloat16 state: the interpreter truncates float32
    to bfloat16 where the GPU rounds to nearest even (triton 3.9)."""
    return q.device.type != "cpu" or torch.bfloat16 not in state_dtypes


def eager_cuda(x: torch.Tensor) -> bool:
    """True for a plain CUDA tensor outside any tracing or dispatch mode: there a public
    function may call an op's body (``*_body``) directly, the same code without the
    dispatcher's host time (most of an eager decode step's). Under ``torch.compile``,
    export or a dispatch mode the op itself is called."""
    return (type(x) is torch.Tensor and x.is_cuda and not torch.compiler.is_compiling()
            and torch._C._len_torch_dispatch_stack() == 0)


def serving_op(x: torch.Tensor, kernel_op, reference_op, body):
    """The op a serving function calls on ``x``: ``kernel_op`` where the backend prefers
    kernels on ``x``'s device (called eagerly on plain CUDA tensors: its ``body`` directly,
    the same code without the dispatcher's host time), else ``reference_op``."""
    from kdn_compile._backend import prefer_kernels

    if not prefer_kernels(x.device.type):
        return reference_op
    return body if eager_cuda(x) else kernel_op
