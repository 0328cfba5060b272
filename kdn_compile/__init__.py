"""kdn_compile: Gated DeltaNet, Kimi Delta Attention and the Diagonal Kalman Delta
Network as first-class citizens of ``torch.compile``, Inductor and ``torch.export``.

Public functions (:mod:`kdn_compile.api`; FLA's names and arguments in
:mod:`kdn_compile.fla`) call ops declared with ``torch.library``
in the ``kdn`` namespace; :mod:`kdn_compile.reference` holds the exact oracles.
"""

import kdn_compile._checkout  # noqa: F401,I001  (must precede the imports below)
from kdn_compile._backend import BACKENDS, get_backend, set_backend, use_backend
from kdn_compile._checks import ArgumentRuntimeError, ArgumentTypeError, ArgumentValueError
from kdn_compile.debug import get_debug, set_debug
from kdn_compile.api import chunk_gdn, chunk_kda, diag_kdn, recurrent_delta_rule, state_fp8_qdq
from kdn_compile.serving import delta_rule_decode, diag_kdn_decode
from kdn_compile import fla  # noqa: E402,I001  (FLA's calling conventions)

__version__ = "0.1.0"

__all__ = [
    "BACKENDS", "get_backend", "set_backend", "use_backend", "get_debug", "set_debug",
    "chunk_gdn", "chunk_kda", "diag_kdn", "recurrent_delta_rule", "state_fp8_qdq",
    "delta_rule_decode", "diag_kdn_decode",
    "ArgumentValueError", "ArgumentTypeError", "ArgumentRuntimeError",
]
