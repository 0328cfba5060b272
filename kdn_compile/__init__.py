"""kdn_compile: Gated DeltaNet, Kimi Delta Attention and the Diagonal Kalman Delta
Network as first-class citizens of ``torch.compile``, Inductor and ``torch.export``.

Public functions (:mod:`kdn_compile.api`; FLA's names and arguments in
:mod:`kdn_compile.fla`) call ops declared with ``torch.library``
in the ``kdn`` namespace; :mod:`kdn_compile.reference` holds the exact oracles.
"""

from kdn_compile._backend import BACKENDS, get_backend, set_backend, use_backend
from kdn_compile._checks import ArgumentRuntimeError, ArgumentTypeError, ArgumentValueError
from kdn_compile.api import chunk_gdn, chunk_kda, diag_kdn, recurrent_delta_rule, state_fp8_qdq
from kdn_compile.checkpoints import chunk_checkpoints
from kdn_compile.debug import get_debug, set_debug
from kdn_compile.serving import (
    commit_diag_kdn_states, commit_states, delta_rule_decode, diag_kdn_decode,
)

__version__ = "0.1.0"

__all__ = [
    "BACKENDS", "get_backend", "set_backend", "use_backend", "get_debug", "set_debug",
    "chunk_gdn", "chunk_kda", "diag_kdn", "recurrent_delta_rule", "state_fp8_qdq",
    "chunk_checkpoints", "commit_diag_kdn_states", "commit_states", "delta_rule_decode",
    "diag_kdn_decode",
    "ArgumentValueError", "ArgumentTypeError", "ArgumentRuntimeError",
]

# Submodules that build the nn.Module layers load on first use, so ``import kdn_compile``
# stays at the functions and ops: ``kdn_compile.fla`` works as an attribute and as
# ``import kdn_compile.fla``.
_LAZY_SUBMODULES = ("fla", "layers")


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_SUBMODULES})
