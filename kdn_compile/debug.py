"""Debug mode: the public functions check the values of their inputs on the device.

Off by default (the checks cost a reduction per input); on with
:func:`set_debug` or by starting Python with the environment variable
``KDN_DEBUG=1`` (any value but empty, ``0``, ``false``, ``no`` or ``off``, in any
case). While on, every public function
(:func:`kdn_compile.chunk_gdn`, :func:`~kdn_compile.chunk_kda`,
:func:`~kdn_compile.recurrent_delta_rule`, :func:`~kdn_compile.diag_kdn`, the
decode steps, and the layers, :mod:`kdn_compile.fla` and
:mod:`kdn_compile.distributed` through them) asserts, after its argument checks
and before its op, that

* every float tensor input is finite (no NaN, no ``inf``),
* gates are natural-log decays: ``g <= 0`` (Diag-KDN: ``log_alpha <= 0``); a gate
  of ``-inf`` (a hard reset) passes where the function takes it, in
  :func:`~kdn_compile.chunk_gdn`, :func:`~kdn_compile.chunk_kda`,
  :func:`~kdn_compile.recurrent_delta_rule` and :func:`~kdn_compile.delta_rule_decode`,
* Diag-KDN's noises and precision are in their domain: ``omega >= 0``,
  ``r > 0``, ``precision > 0``;

and :func:`~kdn_compile.chunk_gdn` checks that its ``w_quantizer`` returned a
finite ``W``.

Each argument costs one ``torch._assert_async`` of one reduced boolean, with a
message naming the function and the argument: no host sync, so it traces under
``torch.compile(fullgraph=True)`` and ``torch.export`` without a graph break.
Where a check fails:

* CPU, eager: ``RuntimeError`` with the message, raised by the call itself;
* CPU, compiled: ``RuntimeError`` with the message from the compiled code;
* CUDA (eager or compiled): a device-side assert carrying the message (the CUDA
  runtime prints it to stderr); the next synchronizing call raises
  ``RuntimeError: ... device-side assert triggered``, and, as after any
  device-side assert, the process's CUDA context is unusable.
  ``CUDA_LAUNCH_BLOCKING=1`` makes it fail at the call.

The switch is a module global read while Dynamo traces a public function, so
``torch.compile`` guards on it: turning it on or off recompiles.
Under tensor parallelism each rank checks its own shards of DTensor inputs.
State pools (decode) and ``cu_seqlens`` are not value-checked here
(``cu_seqlens`` and slot indices are always checked, see each function).
"""

from __future__ import annotations

import os

import torch

__all__ = ["get_debug", "set_debug"]

_enabled = os.environ.get("KDN_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor

    _DTENSOR: tuple = (DTensor,)
else:
    _DTENSOR = ()

# What each argument must be: (condition, the message's words); others only finite.
_FINITE = (torch.isfinite, "finite (no NaN or inf)")
_DOMAINS = {
    "g": (lambda t: t.isfinite() & (t <= 0), "finite and <= 0 (natural-log decays)"),
    "log_alpha": (lambda t: t.isfinite() & (t <= 0), "finite and <= 0 (natural-log retention)"),
    "omega": (lambda t: t.isfinite() & (t >= 0), "finite and >= 0"),
    "r": (lambda t: t.isfinite() & (t > 0), "finite and > 0"),
    "precision": (lambda t: t.isfinite() & (t > 0), "finite and > 0"),
}
# Gates where -inf is a hard reset: ``t <= 0`` is false for NaN and +inf, true for -inf.
_RESET_GATES = (lambda t: t <= 0, "<= 0 and not NaN (natural-log decays, -inf a hard reset)")


def get_debug() -> bool:
    """Whether debug mode is on."""
    return _enabled


def set_debug(enabled: bool) -> None:
    """Turn debug mode on or off for later calls (see :mod:`kdn_compile.debug`).

    Raises:
        TypeError: ``enabled`` is not a bool.
    """
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    _enabled = enabled


def check_values(function: str, *, resets: bool = False, **tensors: torch.Tensor | None) -> None:
    """In debug mode, assert on the device that each named float tensor is finite and in its
    domain (:data:`_DOMAINS`); with ``resets`` the gate ``g`` may be ``-inf`` as well.
    ``None`` entries are skipped. A no-op otherwise."""
    if not _enabled:
        return
    for name, t in tensors.items():
        if t is None or not t.is_floating_point() or t.device.type == "meta":
            continue
        if isinstance(t, _DTENSOR):  # each rank checks its own shard
            t = t.to_local()
        condition, words = (_RESET_GATES if resets and name == "g"
                            else _DOMAINS.get(name, _FINITE))
        torch._assert_async(condition(t).all(),
                            f"kdn_compile debug: {function}: {name} must be {words}")
