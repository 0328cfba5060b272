"""Token-mixing layers built on the ``kdn`` ops: ``[B, T, D] -> [B, T, D]`` modules.

Each layer's ``forward(x, state=None, cu_seqlens=None) -> (y, state)`` carries
the short-convolution cache and the recurrent state, so prefill followed by
token-by-token decode equals one pass over the whole sequence. The state is a
:class:`LayerState`, a dict that records the layer type and sizes that made it; the
serving cache of ``allocate_cache`` / ``step`` is a :class:`LayerCache`, a dict of slot
pools that records the same of the layer that allocated it.
"""

from kdn_compile.layers.gdn import GatedDeltaNet
from kdn_compile.layers.kda import KimiDeltaAttention
from kdn_compile.layers.kdn import DiagKDN
from kdn_compile.layers._state import LayerCache, LayerState

__all__ = ["GatedDeltaNet", "KimiDeltaAttention", "DiagKDN", "LayerState", "LayerCache"]
