"""Output metadata from input shapes only: the fake implementations' vocabulary."""

from __future__ import annotations

from kdn_compile._checks import num_sequences
from kdn_compile.reference._common import work_dtype


def empty_state(q, cu_seqlens, heads, key_dim, value_dim, state_v_first):
    """An uninitialised ``[N, Hv, K, V]`` (or value-major) state in the working dtype."""
    n = num_sequences(q.shape[0], cu_seqlens)
    shape = (n, heads, value_dim, key_dim) if state_v_first else (n, heads, key_dim, value_dim)
    return q.new_empty(shape, dtype=work_dtype(q.dtype))
