"""Triton kernels and their launchers: how each ``kdn`` op lowers on the GPU.

Where each family lives: its exact reference under ``kdn_compile/reference/``, its op
registration under ``kdn_compile/ops/`` (with the ``torch.ops.kdn`` ops it declares) and
its kernels here. Kernel files are named after the recurrence they compute: ``two_key_*``
is the per-key-decay delta rule with two key vectors per token, the erase key ``k`` and
the write key ``w`` (``beta k`` for KDA, the Kalman gain for Diag-KDN's memory), and
``kalman_gain*`` is Diag-KDN's gain.
Every op declared through ``FamilyOps`` (``ops/_registry.py``) also declares
``<name>_reference`` and ``<name>_reference_bwd``, its reference as an op.

====================  =============  ===================================  ====================
family                reference/     ops/: torch.ops.kdn.*                lowering/
====================  =============  ===================================  ====================
GDN                   delta_rule.py  gdn.py: chunk_gdn, chunk_gdn_bwd     chunk_gdn_fwd.py
                                     gdn_wy.py (``w_quantizer``):         chunk_gdn_bwd.py
                                     gdn_wy_operands(_bwd),               chunk_gdn_wy.py
                                     gdn_wy_recurrence(_bwd)              recurrent.py
                                     recurrent.py: recurrent_delta_rule
KDA                   delta_rule.py  kda.py: chunk_kda, chunk_kda_bwd     two_key_fwd.py
                                     recurrent.py: recurrent_delta_rule   two_key_bwd.py
                                                                          two_key_common.py
                                                                          recurrent.py
Diag-KDN              kdn.py         kdn.py: diag_kdn,                    kalman_gain.py
                                     diag_kdn_memory_bwd,                 kalman_gain_fwd.py
                                     kalman_gain_bwd,                     kalman_gain_bwd.py
                                     mobius_product_reference             two_key_*.py
decode/serving pools  pools.py       decode.py: delta_rule_decode,        recurrent.py
                                     diag_kdn_decode (and _reference)     slots.py
                                     slots.py: scatter_slots(_reference)
FP8                   fp8.py         fp8.py: state_fp8_qdq                fp8.py (used by
                                                                          chunk_gdn_*.py and
                                                                          recurrent.py)
context parallelism   context.py     exchange.py:                         none: each rank runs
                                     context_state_exchange(_bwd),        its family's kernels
                                     context_covariance_exchange(_bwd)
tensor parallelism    none: heads    sharding.py: the DTensor rules of    none
                      are separate   the ops above, no op of its own
====================  =============  ===================================  ====================

Shared: ``ops/_registry.py``, ``ops/_dispatch.py`` (kernel or reference),
``reference/_common.py``, ``_launch.py`` and ``_tiles.py`` here. The same table is in the
documentation's overview (``docs/index.rst``).

Launchers call ``wrap_triton(kernel)[grid]`` so that ``torch.compile``, Inductor and
AOTInductor see every kernel; they read no tensor values on the host.

This folder is the package ``kdn_compile.lowering`` through the symlink
``kdn_compile/lowering -> ../lowering``: Python started in a checkout (any worktree),
an editable install and a wheel (which holds the files, copied through the link) all
find it as a subpackage of ``kdn_compile``, the same way. It has that one name: imported
as a top-level ``lowering`` it would define every Triton kernel a second time.
"""

if __name__ != "kdn_compile.lowering":
    raise ImportError(f"the kernels are kdn_compile.lowering; import that, not {__name__!r}")
