"""Exact, differentiable PyTorch references: the oracles and the fallback of every op.

Written in PyTorch only, independent of the kernels (the package imports without
Triton; every op then runs these). Gates are natural logarithms;
q and k arrive normalized. Packed-sequence boundaries (``cu_seqlens``) are read
on the CPU. Accumulation is in ``promote_types(dtype, float32)`` (float64 for
algebra tests).
"""

from kdn_compile.reference.delta_rule import (
    GDN_GATE_FLOOR,
    chunk_gdn_reference,
    chunk_kda_reference,
    gdn_wy_operands_reference,
    gdn_wy_recurrence_reference,
    recurrent_delta_rule_reference,
    two_key_chunk_recurrence,
)
from kdn_compile.reference.fp8 import state_fp8_qdq_reference
from kdn_compile.reference.kdn import (
    DEFAULT_CHUNK_SIZE,
    INITIAL_PRECISION,
    INITIAL_PRECISION_FLOOR,
    LOG_MEMORY_ALPHA_FLOOR,
    NORM_EPS,
    OMEGA_MIN,
    R_MIN,
    chunked_memory,
    covariance_step_maps,
    diag_kdn_chunked,
    diag_kdn_recurrent,
    diag_kdn_reference,
    diag_kdn_step,
    initial_precision_logit,
    initial_state,
    kalman_gain,
    kalman_noise,
    mask_padding,
    mobius_product,
    normalize_query_key,
)

__all__ = [
    "chunk_gdn_reference", "chunk_kda_reference", "recurrent_delta_rule_reference",
    "gdn_wy_operands_reference", "gdn_wy_recurrence_reference", "two_key_chunk_recurrence",
    "state_fp8_qdq_reference", "GDN_GATE_FLOOR",
    "OMEGA_MIN", "R_MIN", "INITIAL_PRECISION", "INITIAL_PRECISION_FLOOR",
    "LOG_MEMORY_ALPHA_FLOOR", "NORM_EPS", "DEFAULT_CHUNK_SIZE",
    "initial_precision_logit", "kalman_noise", "normalize_query_key", "initial_state",
    "mask_padding", "diag_kdn_step", "diag_kdn_recurrent", "kalman_gain",
    "chunked_memory", "diag_kdn_chunked", "diag_kdn_reference",
    "covariance_step_maps", "mobius_product",
]
