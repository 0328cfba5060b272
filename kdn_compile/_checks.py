"""Argument validation shared by the public functions and the references.

Every check raises ``ValueError`` (shapes, values) or ``TypeError`` (dtypes,
types) whose message names the argument, what was expected and what arrived.
Checks read shapes, dtypes and devices only, never tensor values, so they
trace under ``torch.compile`` without graph breaks or host syncs.
"""

from __future__ import annotations

import math

import torch

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def check_tensor(name: str, t, *, layout: str | None = None, floating: bool = True) -> None:
    """A tensor, of rank ``len(layout)`` when ``layout`` (e.g. ``"BTHK"``) is given, and a
    float dtype when ``floating``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if layout is not None and t.dim() != len(layout):
        raise ValueError(
            f"{name} must have {len(layout)} dims, [{', '.join(layout)}], got shape {_shape(t)}"
        )
    if floating and t.dtype not in _FLOATS:
        raise TypeError(
            f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}"
        )


def check_same_device(**tensors) -> None:
    present = {n: t for n, t in tensors.items() if t is not None}
    devices = {n: t.device for n, t in present.items()}
    first_name, first = next(iter(devices.items()))
    for name, device in devices.items():
        if device != first:
            raise ValueError(
                f"{name} is on {device} but {first_name} is on {first}: "
                "all tensors must share one device"
            )


# Default ``chunk_size`` of the input checks: the caller has no chunks (a token loop).
# A caller's ``chunk_size=None`` is checked like any other value.
NOT_CHUNKED = object()


def check_chunk_size(chunk_size) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, float)):
        raise TypeError(f"chunk_size must be a positive int, got {type(chunk_size).__name__}")
    # math.isfinite only on real floats: an int may be symbolic under torch.compile.
    if isinstance(chunk_size, float) and not math.isfinite(chunk_size):
        raise ValueError(f"chunk_size must be a positive finite int, got {chunk_size}")
    if chunk_size != int(chunk_size) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive finite int, got {chunk_size}")


def _tracing() -> bool:
    return torch.compiler.is_compiling() or torch._guards.detect_fake_mode() is not None


def check_cu_seqlens_values(cu_seqlens: torch.Tensor, length) -> None:
    """Boundaries must start at 0, never decrease and end at ``T``.

    CPU tensors in eager mode are read and raise ``ValueError`` with the values (a
    replicated DTensor, under tensor parallelism, through its full value). Elsewhere
    (CUDA, or while tracing) a device-side assert checks the same without a host sync:
    it fails the next synchronizing call with this message.
    """
    if cu_seqlens.device.type == "cpu" and not _tracing():
        full = getattr(cu_seqlens, "full_tensor", None)  # a DTensor
        bounds = (cu_seqlens if full is None else full()).tolist()
        steps_ok = all(a <= b for a, b in zip(bounds, bounds[1:]))
        if bounds[0] != 0 or bounds[-1] != length or not steps_ok:
            raise ValueError(
                f"cu_seqlens must start at 0, never decrease and end at T = {length}, "
                f"got {bounds if len(bounds) <= 12 else bounds[:6] + ['...'] + bounds[-3:]}"
            )
        return
    valid = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == length) & (cu_seqlens.diff() >= 0).all()
    torch._assert_async(valid, "cu_seqlens must start at 0, never decrease and end at T")


def check_cu_seqlens(cu_seqlens, batch: int, device: torch.device, length) -> None:
    if cu_seqlens is None:
        return
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be [N + 1] with N >= 1, got shape {_shape(cu_seqlens)}")
    if batch != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1, got B = {batch}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {device}")
    if device.type != "meta":
        check_cu_seqlens_values(cu_seqlens, length)


def check_state(name: str, state, expected: tuple) -> None:
    if state is None:
        return
    check_tensor(name, state)
    if _shape(state) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {_shape(state)}")


def num_sequences(batch: int, cu_seqlens) -> int:
    return batch if cu_seqlens is None else cu_seqlens.shape[0] - 1


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
    check_tensor("beta", beta, layout="BTH")
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, t, hk, dk = q.shape
    if hk < 1 or dk < 1:
        raise ValueError(f"q must have at least one head and K >= 1, got shape {_shape(q)}")
    if _shape(k) != _shape(q):
        raise ValueError(f"k must have q's shape {_shape(q)} = [B, T, Hk, K], got {_shape(k)}")
    if v.shape[0] != b or v.shape[1] != t:
        raise ValueError(f"v must be [B={b}, T={t}, Hv, V], got {_shape(v)}")
    hv, dv = v.shape[2], v.shape[3]
    if hv % hk != 0:
        raise ValueError(
            f"the value heads Hv = {hv} (v {_shape(v)}) must be a multiple of "
            f"the key heads Hk = {hk} (q {_shape(q)})"
        )
    scalar, per_key = (b, t, hv), (b, t, hv, dk)
    allowed = {"scalar": [scalar], "per_key": [per_key], "any": [scalar, per_key]}[gate]
    if _shape(g) not in allowed:
        expected = " or ".join(str(s) for s in allowed)
        raise ValueError(f"g must have shape {expected}, got {_shape(g)}")
    if _shape(beta) != scalar:
        raise ValueError(f"beta must have shape {scalar} = [B, T, Hv], got {_shape(beta)}")
    if chunk_size is not NOT_CHUNKED:
        check_chunk_size(chunk_size)
    check_cu_seqlens(cu_seqlens, b, q.device, t)
    n = num_sequences(b, cu_seqlens)
    state = (n, hv, dv, dk) if state_v_first else (n, hv, dk, dv)
    check_state("initial_state", initial_state, state)


def check_kdn_inputs(
    q, k, v, log_alpha, omega, r, memory, precision, *, cu_seqlens=None, chunk_size=NOT_CHUNKED
) -> None:
    """Validate the arguments of :func:`kdn_compile.diag_kdn`."""
    for name, t in (("q", q), ("k", k), ("log_alpha", log_alpha), ("omega", omega)):
        check_tensor(name, t, layout="BTHK")
    check_tensor("v", v, layout="BTHV")
    check_tensor("r", r, layout="BTH")
    if memory is not None or precision is not None:  # None: the decode step's pools
        check_tensor("memory", memory, layout="NHKV")
        check_tensor("precision", precision, layout="NHK")
    check_same_device(
        q=q, k=k, v=v, log_alpha=log_alpha, omega=omega, r=r, memory=memory,
        precision=precision,
    )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, t, h, dk = q.shape
    if h < 1 or dk < 1:
        raise ValueError(f"q must have at least one head and K >= 1, got shape {_shape(q)}")
    for name, x in (("k", k), ("log_alpha", log_alpha), ("omega", omega)):
        if _shape(x) != _shape(q):
            raise ValueError(f"{name} must have q's shape {_shape(q)} = [B, T, H, K], got {_shape(x)}")
    if _shape(v)[:3] != (b, t, h):
        raise ValueError(f"v must be [B={b}, T={t}, H={h}, V], got {_shape(v)}")
    if _shape(r) != (b, t, h):
        raise ValueError(f"r must have shape {(b, t, h)} = [B, T, H], got {_shape(r)}")
    if chunk_size is not NOT_CHUNKED:
        check_chunk_size(chunk_size)
    check_cu_seqlens(cu_seqlens, b, q.device, t)
    n = num_sequences(b, cu_seqlens)
    check_state("memory", memory, (n, h, dk, v.shape[3]))
    check_state("precision", precision, (n, h, dk))


def check_pool(name: str, pool, layout: str, row_shape: tuple, dtypes: tuple, device,
               *, slots=None):
    """A contiguous tensor ``[slots, *row_shape]`` (``layout`` names the dims in messages) of
    one of ``dtypes`` on ``device``; ``slots`` ``None`` takes any count >= 1. Returns the count."""
    if not isinstance(pool, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(pool).__name__}")
    if pool.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must be {allowed}, got {pool.dtype}")
    expected = ("S" if slots is None else slots,) + tuple(row_shape)
    if pool.dim() != len(expected) or _shape(pool)[1:] != tuple(row_shape) or (
        slots is not None and pool.shape[0] != slots
    ):
        raise ValueError(f"{name} must be {layout} = {expected}, got {_shape(pool)}")
    if pool.shape[0] < 1:
        raise ValueError(f"{name} must have at least one slot, got shape {_shape(pool)}")
    if pool.device != device:
        raise ValueError(f"{name} is on {pool.device} but q is on {device}")
    if not pool.is_contiguous():
        raise ValueError(f"{name} must be contiguous (it is updated in place): call "
                         f".contiguous() once when allocating it")
    return pool.shape[0]


def check_slot_indices(indices, batch, slots, device) -> None:
    """``state_indices [B]`` int32/int64 on ``device`` (shape, dtype, device; the values are
    checked by the ops: :func:`check_slot_values`, or in the decode kernels)."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"state_indices must be a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"state_indices must be int32 or int64, got {indices.dtype}")
    if _shape(indices) != (batch,):
        raise ValueError(f"state_indices must be [B] = ({batch},), got {_shape(indices)}")
    if indices.device != device:
        raise ValueError(f"state_indices is on {indices.device} but q is on {device}")


SLOT_ERROR = "state_indices must be < the pool's slots S and must not repeat a non-negative slot"


def check_slot_values(indices: torch.Tensor, slots: int) -> None:
    """On the device, no host sync: every index ``< slots`` and no non-negative index
    repeated (``torch._assert_async``: a device-side assert on CUDA, a RuntimeError on the
    CPU, both with :data:`SLOT_ERROR`)."""
    if indices.device.type == "meta":
        return
    ordered = indices.sort().values
    repeated = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)
    torch._assert_async(~repeated.any() & (ordered[-1:] < slots).all(), SLOT_ERROR)


def check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def check_float(name: str, value) -> float:
    """A Python real number as float (not bool, not a tensor)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    # not while compiling: dynamo may trace a float as symbolic (math.isfinite breaks it)
    if isinstance(value, float) and not torch.compiler.is_compiling() and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)
