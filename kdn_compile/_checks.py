"""Argument validation shared by the public functions and the references.

Every check raises, through :func:`fail`, a ``ValueError`` (shapes, values) or
``TypeError`` (dtypes, types) whose message names the argument, what was expected
and what arrived. Checks read shapes, dtypes and devices only, never tensor values,
so they trace under ``torch.compile`` without graph breaks or host syncs, and their
messages are built from concrete sizes (:func:`dims`, :func:`shown`) so that they
read the same eagerly and compiled, static or dynamic shapes alike.
"""

from __future__ import annotations

import math
import operator
import sys
from typing import NoReturn

import torch

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class ArgumentValueError(ValueError, AssertionError):
    """A ``ValueError`` of kdn_compile: an argument's shape or value is not the expected one.

    It is an ``AssertionError`` as well so that ``torch.compile`` lets it out unchanged:
    Dynamo passes an ``AssertionError`` raised while it traces through to the caller,
    where it reports any other exception as ``torch._dynamo.exc.Unsupported``.
    """


class ArgumentTypeError(TypeError, AssertionError):
    """A ``TypeError`` of kdn_compile (an argument of the wrong type or dtype); an
    ``AssertionError`` as well, as :class:`ArgumentValueError`."""


class ArgumentRuntimeError(RuntimeError, AssertionError):
    """A ``RuntimeError`` of kdn_compile (an argument that the call cannot take in the
    current mode, e.g. one requiring grad in an inference-only step); an
    ``AssertionError`` as well, as :class:`ArgumentValueError`."""


_RAISED = {
    ValueError: ArgumentValueError,
    TypeError: ArgumentTypeError,
    RuntimeError: ArgumentRuntimeError,
}


@torch.compiler.assume_constant_result
def fail(kind: type, message: str) -> NoReturn:
    """Raise ``kind`` (``ValueError``, ``TypeError`` or ``RuntimeError``) as the matching
    ``Argument*Error`` with ``message``.

    Marked with :func:`torch.compiler.assume_constant_result`: Dynamo calls it while
    tracing (its arguments are constants) instead of tracing its ``raise``, which it
    would report as a graph break (``Unsupported: Observed exception``, under
    ``fullgraph=True`` an error that buries the message). Raised from the call, the
    exception leaves ``torch.compile`` as itself, message first.
    """
    raise _RAISED[kind](message)


def dims(shape) -> str:
    """``shape`` as Python prints a tuple, ``(2, 8, 4)``, in concrete sizes.

    Under ``torch.compile`` with dynamic shapes a size is symbolic; ``operator.index``
    turns it into its value (specializing it, which only the failing path does), so the
    message shows ``(2, 8, 4)``, never ``(s0, s1, s2)``, and Dynamo never has to trace
    ``str`` of a tuple, which it cannot.
    """
    sizes = [str(operator.index(size)) for size in shape]
    return "(" + ", ".join(sizes) + ("," if len(sizes) == 1 else "") + ")"


def shown(value) -> str:
    """A received value for a message: an int or float (symbolic or not) as its value
    (a float to six decimals while compiling), a tensor as its dtype and shape, ``None``,
    bools and strings as ``repr`` does, anything else by its type."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return repr(value)
    if isinstance(value, float):
        if torch.compiler.is_compiling() and -math.inf < value < math.inf:
            # Dynamo formats no symbolic float; the floor of an int is one it can read
            if -1e300 < value < 1e300:
                return str(operator.index(math.floor(value * 1e6)) / 1e6)
            return "a float >= 1e300" if value > 0 else "a float <= -1e300"
        return str(value)
    if isinstance(value, int):
        return str(operator.index(value))
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {dims(value.shape)}"
    return f"a {type_name(value)}"


def type_name(value) -> str:
    """The type of ``value`` for a message: builtins by name (``list``), others qualified
    by their module (``numpy.bool``, which a bare name would show as ``bool``)."""
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"


def listed(names) -> str:
    """Strings as Python prints their sorted list, ``['conv', 'recurrent']``."""
    return "[" + ", ".join(repr(name) for name in sorted(names)) + "]"


def check_tensor(name: str, t, *, layout: str | None = None, floating: bool = True) -> None:
    """A tensor, of rank ``len(layout)`` when ``layout`` (e.g. ``"BTHK"``) is given, and a
    float dtype when ``floating``."""
    if not isinstance(t, torch.Tensor):
        fail(TypeError, f"{name} must be a torch.Tensor, got {type_name(t)}")
    if layout is not None and t.dim() != len(layout):
        fail(ValueError, f"{name} must have {len(layout)} dims, [{', '.join(layout)}], "
                         f"got shape {dims(t.shape)}")
    if floating and t.dtype not in _FLOATS:
        fail(TypeError, f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")


def check_same_device(**tensors) -> None:
    first_name = first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if first is None:
            first_name, first = name, t.device
        elif t.device != first:
            fail(ValueError, f"{name} is on {t.device} but {first_name} is on {first}: "
                             "all tensors must share one device")


class _NotChunked:
    """Type of :data:`NOT_CHUNKED`."""


# Default ``chunk_size`` of the input checks: the caller has no chunks (a token loop).
# A caller's ``chunk_size=None`` is checked like any other value. Tested by isinstance,
# not ``is``: Dynamo (torch 2.11) cannot compare a symbolic int with an object by identity.
NOT_CHUNKED = _NotChunked()


def check_chunk_size(chunk_size) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, float)):
        fail(TypeError, f"chunk_size must be a positive int, got {type(chunk_size).__name__}")
    # comparisons, not math.isfinite: under torch.compile a float argument may be symbolic
    if isinstance(chunk_size, float) and not -math.inf < chunk_size < math.inf:
        fail(ValueError, f"chunk_size must be a positive finite int, got {shown(chunk_size)}")
    if chunk_size != int(chunk_size) or chunk_size < 1:
        fail(ValueError, f"chunk_size must be a positive finite int, got {shown(chunk_size)}")
    if chunk_size >= 2**63:  # the ops take int64
        fail(ValueError, f"chunk_size must be below 2**63, got {shown(chunk_size)}")


def tracing(x: torch.Tensor | None = None) -> bool:
    """Whether this runs under tracing: ``torch.compile``, ``torch.export``, a fake tensor
    mode, or with ``x`` a fake or functional tensor (a trace's tensor, also outside those
    modes). There no tensor value can be read on the host, and a Triton kernel launches
    through ``wrap_triton``."""
    if torch.compiler.is_compiling():
        return True
    if (type(x) in _PLAIN or x is None) and torch._C._len_torch_dispatch_stack() == 0 \
            and torch._guards.TracingContext.try_get() is None:
        return False  # plain eager: what follows finds no fake mode either (a few us less)
    if x is not None:
        from torch._subclasses.fake_tensor import FakeTensor
        from torch._subclasses.functional_tensor import FunctionalTensor

        if isinstance(x, (FakeTensor, FunctionalTensor)):
            return True
    return torch._guards.detect_fake_mode() is not None


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def check_cu_seqlens_values(cu_seqlens: torch.Tensor, length) -> None:
    """Boundaries must start at 0, never decrease and end at ``T``.

    CPU tensors in eager mode are read and raise ``ValueError`` with the values (a
    replicated DTensor, under tensor parallelism, through its full value). Elsewhere
    (CUDA, or while tracing) a device-side assert checks the same without a host sync:
    it fails the next synchronizing call with this message.
    """
    if cu_seqlens.device.type == "cpu" and not tracing():
        full = getattr(cu_seqlens, "full_tensor", None)  # a DTensor
        bounds = (cu_seqlens if full is None else full()).tolist()
        steps_ok = all(a <= b for a, b in zip(bounds, bounds[1:]))
        if bounds[0] != 0 or bounds[-1] != length or not steps_ok:
            fail(ValueError,
                 f"cu_seqlens must start at 0, never decrease and end at T = {length}, "
                 f"got {bounds if len(bounds) <= 12 else bounds[:6] + ['...'] + bounds[-3:]}")
        return
    valid = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == length) & (cu_seqlens.diff() >= 0).all()
    torch._assert_async(valid, "cu_seqlens must start at 0, never decrease and end at T")


def check_cu_seqlens(cu_seqlens, batch: int, device: torch.device, length) -> None:
    if cu_seqlens is None:
        return
    if not isinstance(cu_seqlens, torch.Tensor):
        fail(TypeError, f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        fail(TypeError, f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        fail(ValueError, f"cu_seqlens must be [N + 1] with N >= 1, "
                         f"got shape {dims(cu_seqlens.shape)}")
    if batch != 1:
        fail(ValueError, f"with cu_seqlens the batch size must be 1, got B = {shown(batch)}")
    if cu_seqlens.device != device:
        fail(ValueError, f"cu_seqlens is on {cu_seqlens.device} but q is on {device}")
    if device.type != "meta":
        check_cu_seqlens_values(cu_seqlens, length)


def check_state(name: str, state, expected: tuple) -> None:
    if state is None:
        return
    check_tensor(name, state)
    if tuple(state.shape) != tuple(expected):
        fail(ValueError, f"{name} must have shape {dims(expected)}, got {dims(state.shape)}")


def num_sequences(batch: int, cu_seqlens) -> int:
    """The number of independent sequences: ``N`` for packed ones (``cu_seqlens [N + 1]``),
    else the batch size."""
    return batch if cu_seqlens is None else cu_seqlens.shape[0] - 1


def sequence_of(bounds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The packed sequence holding each of ``positions`` (token indices, >= 0): ``n`` with
    ``bounds[n] <= t < bounds[n + 1]``, ``N`` for ``t`` at or past the end.

    ``bounds`` is ``cu_seqlens`` (its first entry 0) as int64. The search runs over the
    whole of it, not over ``bounds[1:]``: Inductor's ``searchsorted`` lowering of torch
    2.11 asks its boundaries for their strides, which a slice of a computed tensor does
    not have while it lowers (``NotImplementedError: SliceView`` under ``torch.compile``
    on CUDA).
    """
    return torch.searchsorted(bounds, positions, right=True) - 1


def check_delta_inputs(
    q, k, v, g, beta, *, initial_state=None, cu_seqlens=None, state_v_first=False,
    gate: str = "any", chunk_size=NOT_CHUNKED,
) -> None:
    """Validate the arguments of the GDN / KDA functions (see their docstrings).

    ``gate`` is ``"scalar"`` (``g [B, T, Hv]``), ``"per_key"`` (``[B, T, Hv, K]``)
    or ``"any"`` (either).
    """
    for name, t, layout in (("q", q, "BTHK"), ("k", k, "BTHK"), ("v", v, "BTHV")):
        check_tensor(name, t, layout=layout)
    check_tensor("g", g)
    check_tensor("beta", beta)  # its shape, [B, T, Hv], is checked below
    if initial_state is not None:
        check_tensor("initial_state", initial_state)
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        fail(TypeError, f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, t, hk, dk = q.shape
    if hk < 1 or dk < 1:
        fail(ValueError, f"q must have at least one head and K >= 1, got shape {dims(q.shape)}")
    if k.shape != q.shape:
        fail(ValueError, f"k must have q's shape {dims(q.shape)} = [B, T, Hk, K], "
                         f"got {dims(k.shape)}")
    if v.shape[0] != b or v.shape[1] != t:
        fail(ValueError, f"v must be [B={shown(b)}, T={shown(t)}, Hv, V], got {dims(v.shape)}")
    hv, dv = v.shape[2], v.shape[3]
    if hv % hk != 0:
        fail(ValueError, f"the value heads Hv = {shown(hv)} (v {dims(v.shape)}) must be a "
                         f"multiple of the key heads Hk = {shown(hk)} (q {dims(q.shape)})")
    scalar, per_key = (b, t, hv), (b, t, hv, dk)
    allowed = [scalar, per_key] if gate == "any" else [scalar] if gate == "scalar" else [per_key]
    if tuple(g.shape) not in allowed:
        expected = " or ".join(dims(s) for s in allowed)
        fail(ValueError, f"g must have shape {expected}, got {dims(g.shape)}")
    if tuple(beta.shape) != scalar:
        fail(ValueError, f"beta must have shape {dims(scalar)} = [B, T, Hv], "
                         f"got {dims(beta.shape)}")
    if not isinstance(chunk_size, _NotChunked):
        check_chunk_size(chunk_size)
    check_cu_seqlens(cu_seqlens, b, q.device, t)
    n = num_sequences(b, cu_seqlens)
    state = (n, hv, dv, dk) if state_v_first else (n, hv, dk, dv)
    check_state("initial_state", initial_state, state)


def check_kdn_inputs(
    q, k, v, log_alpha, omega, r, memory, precision, *, cu_seqlens=None, chunk_size=NOT_CHUNKED,
    pools=False,
) -> None:
    """Validate the arguments of :func:`kdn_compile.diag_kdn`; ``pools``: the decode step's
    call, whose memory and precision are its pools (None here, checked by the caller)."""
    for name, t in (("q", q), ("k", k), ("log_alpha", log_alpha), ("omega", omega)):
        check_tensor(name, t, layout="BTHK")
    check_tensor("v", v, layout="BTHV")
    check_tensor("r", r, layout="BTH")
    if not pools:
        check_tensor("memory", memory, layout="NHKV")
        check_tensor("precision", precision, layout="NHK")
    check_same_device(
        q=q, k=k, v=v, log_alpha=log_alpha, omega=omega, r=r, memory=memory,
        precision=precision,
    )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        fail(TypeError, f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, t, h, dk = q.shape
    if h < 1 or dk < 1:
        fail(ValueError, f"q must have at least one head and K >= 1, got shape {dims(q.shape)}")
    for name, x in (("k", k), ("log_alpha", log_alpha), ("omega", omega)):
        if x.shape != q.shape:
            fail(ValueError, f"{name} must have q's shape {dims(q.shape)} = [B, T, H, K], "
                             f"got {dims(x.shape)}")
    if tuple(v.shape[:3]) != (b, t, h):
        fail(ValueError, f"v must be [B={shown(b)}, T={shown(t)}, H={shown(h)}, V], "
                         f"got {dims(v.shape)}")
    if tuple(r.shape) != (b, t, h):
        fail(ValueError, f"r must have shape {dims((b, t, h))} = [B, T, H], got {dims(r.shape)}")
    if not isinstance(chunk_size, _NotChunked):
        check_chunk_size(chunk_size)
    check_cu_seqlens(cu_seqlens, b, q.device, t)
    n = num_sequences(b, cu_seqlens)
    check_state("memory", memory, (n, h, dk, v.shape[3]))
    check_state("precision", precision, (n, h, dk))


def check_pool(name: str, pool, layout: str, row_shape: tuple, dtypes: tuple, device,
               *, slots=None, beside: str = "q", written: bool = True):
    """A contiguous tensor ``[slots, *row_shape]`` (``layout`` names the dims in messages) of
    one of ``dtypes`` on ``device`` (the device of the argument ``beside``); ``slots``
    ``None`` takes any count >= 1 (a pool), an expected count any value (rows of a batch,
    none included). ``written``: the message of a strided tensor says it is written in
    place. Returns the count. The expected shape is formatted only for a message, so that
    symbolic sizes keep their symbols (no specialization while compiling)."""
    if not isinstance(pool, torch.Tensor):
        fail(TypeError, f"{name} must be a torch.Tensor, got {type(pool).__name__}")
    if pool.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        fail(TypeError, f"{name} must be {allowed}, got {pool.dtype}")
    if pool.dim() != 1 + len(row_shape) or tuple(pool.shape[1:]) != tuple(row_shape) or (
        slots is not None and pool.shape[0] != slots
    ):
        expected = ("S" if slots is None else shown(slots),) + tuple(shown(n) for n in row_shape)
        fail(ValueError, f"{name} must be {layout} = ({', '.join(expected)}), "
                         f"got {dims(pool.shape)}")
    if slots is None and pool.shape[0] < 1:
        fail(ValueError, f"{name} must have at least one slot, got shape {dims(pool.shape)}")
    if pool.device != device:
        fail(ValueError, f"{name} is on {pool.device} but {beside} is on {device}")
    if not pool.is_contiguous():
        fail(ValueError, f"{name} must be contiguous" + (
            " (it is updated in place): call .contiguous() once when allocating it" if written
            else ": call .contiguous() on it"))
    return pool.shape[0]


def check_slot_indices(indices, batch, slots, device, name: str = "state_indices",
                       beside: str = "q") -> None:
    """``name [B]`` (the slot indices) int32/int64 on ``device``, the device of the argument
    ``beside`` (shape, dtype, device; the values are checked by the ops:
    :func:`check_slot_values`, or in the decode kernels)."""
    if not isinstance(indices, torch.Tensor):
        fail(TypeError, f"{name} must be a torch.Tensor, got {type_name(indices)}")
    if indices.dtype not in (torch.int32, torch.int64):
        fail(TypeError, f"{name} must be int32 or int64, got {indices.dtype}")
    if tuple(indices.shape) != (batch,):
        fail(ValueError, f"{name} must be [B] = {dims((batch,))}, got {dims(indices.shape)}")
    if indices.device != device:
        fail(ValueError, f"{name} is on {indices.device} but {beside} is on {device}")


def slot_error(name: str) -> str:
    """The message of a bad slot index value in the argument ``name``."""
    return f"{name} must be < the pool's slots S and must not repeat a non-negative slot"


SLOT_ERROR = slot_error("state_indices")


def check_slot_values(indices: torch.Tensor, slots: int, name: str = "state_indices") -> None:
    """On the device, no host sync: every index ``< slots`` and no non-negative index
    repeated (``torch._assert_async``: a device-side assert on CUDA, a RuntimeError on the
    CPU, both with :func:`slot_error` of ``name``, :data:`SLOT_ERROR` by default)."""
    if indices.device.type == "meta":
        return
    if hasattr(indices, "full_tensor"):  # a DTensor (replicated indices): its values
        indices = indices.full_tensor()
    ordered = indices.sort().values
    repeated = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)
    torch._assert_async(~repeated.any() & (ordered[-1:] < slots).all(), slot_error(name))


def check_callable(name: str, value) -> None:
    """None or a callable."""
    if value is not None and not callable(value):
        fail(TypeError, f"{name} must be None or callable, got {type_name(value)}")


def check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        fail(TypeError, f"{name} must be a bool, got {type_name(value)}")


def check_float(name: str, value) -> float:
    """A finite Python real number as float (not bool, not a tensor)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(TypeError, f"{name} must be a float, got {type_name(value)}")
    # comparisons, not math.isfinite: under torch.compile the float may be symbolic
    if isinstance(value, float) and not -math.inf < value < math.inf:
        fail(ValueError, f"{name} must be finite, got {shown(value)}")
    if isinstance(value, int) and not -sys.float_info.max <= value <= sys.float_info.max:
        fail(ValueError, f"{name} must be a finite float, got an int of "
                         f"{value.bit_length()} bits, beyond the float range")
    return float(value)


def check_no_tangents(function: str, **tensors) -> None:
    """Refuse forward-mode AD (a dual tensor of :mod:`torch.autograd.forward_ad`, or an input
    of ``torch.func.jvp``): the ops have no forward derivative, and PyTorch would drop the
    tangent silently (the output a constant). Eager only; ``None`` entries are skipped."""
    if torch.compiler.is_compiling() or getattr(torch.autograd.forward_ad, "_current_level",
                                                0) < 0:
        return  # no dual level is open (torch.func.jvp opens one): no tensor has a tangent
    unpack = torch.autograd.forward_ad.unpack_dual
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and unpack(t).tangent is not None:
            raise NotImplementedError(
                f"kdn_compile.{function} has no forward-mode AD, got a tangent on {name} "
                "(forward_ad dual tensor or torch.func.jvp): use backward mode, or the "
                "plain-PyTorch references in kdn_compile.reference (same arguments)")
