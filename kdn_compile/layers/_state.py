"""The layers' recurrent state and serving cache: dicts of tensors that record the layer
that made them."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from kdn_compile._checks import fail, listed


class LayerState(dict):
    """The ``state`` a layer's ``forward`` returns: a ``dict`` of tensors (``"conv"``, then
    ``"recurrent"``, or ``"memory"`` and ``"precision"``) that also records what made it.

    ``made_by`` names the layer type and its sizes, e.g.
    ``"GatedDeltaNet(hidden_size=64, num_heads=2, head_dim=16, num_v_heads=2,
    head_v_dim=16, conv_size=4)"``; a layer refuses a state made by a layer of another
    type or sizes (``ValueError`` naming both), even one whose tensors have the right
    shapes. It is a plain ``dict`` otherwise: ``state["recurrent"]``, iteration, and
    ``{k: v.detach() for k, v in state.items()}``, which gives a plain dict (a layer
    takes one after checking its keys and shapes). It is a pytree node, so
    ``torch.utils._pytree.tree_map`` and ``torch.export`` keep it, ``made_by`` included,
    and a safe global of ``torch.load`` (``weights_only=True`` loads a saved state).
    """

    def __init__(self, made_by: str, tensors: dict):
        super().__init__(tensors)
        self.made_by = made_by

    def __reduce__(self):
        return LayerState, (self.made_by, dict(self))


def _flatten(state: LayerState):
    return list(state.values()), (state.made_by, list(state))


def _unflatten(values, context) -> LayerState:
    made_by, keys = context
    return LayerState(made_by, dict(zip(keys, values)))


def _flatten_with_keys(state: LayerState):
    return [(pytree.MappingKey(k), v) for k, v in state.items()], (state.made_by, list(state))


pytree.register_pytree_node(
    LayerState, _flatten, _unflatten, flatten_with_keys_fn=_flatten_with_keys,
    serialized_type_name="kdn_compile.layers.LayerState",
)
torch.serialization.add_safe_globals([LayerState])


class LayerCache(dict):
    """The ``cache`` a layer's ``allocate_cache`` returns: a ``dict`` of slot pools
    (``"conv"``, then ``"recurrent"`` and, for float8, ``"recurrent_scales"``, or
    ``"memory"`` and ``"precision"``) that also records the layer that allocated it.

    ``made_by`` is that layer's ``state_signature`` (its type and sizes, as
    :class:`LayerState` records them); ``step`` and ``reset_cache`` refuse a cache
    allocated by a layer of another type or sizes (``ValueError`` naming ``cache`` and
    both layers), e.g. a KimiDeltaAttention cache given to a GatedDeltaNet whose pools
    have the same shapes. It is a plain ``dict`` otherwise; a plain dict of pools (a copy,
    ``{k: v.clone() for k, v in cache.items()}``) records no layer and is taken once its
    keys, shapes, dtypes and device are checked. It is a pytree node (``made_by``
    kept) and a safe global of ``torch.load``, as :class:`LayerState`.
    """

    def __init__(self, made_by: str, pools: dict):
        super().__init__(pools)
        self.made_by = made_by

    def __reduce__(self):
        return LayerCache, (self.made_by, dict(self))


def _unflatten_cache(values, context) -> LayerCache:
    made_by, keys = context
    return LayerCache(made_by, dict(zip(keys, values)))


pytree.register_pytree_node(
    LayerCache, _flatten, _unflatten_cache, flatten_with_keys_fn=_flatten_with_keys,
    serialized_type_name="kdn_compile.layers.LayerCache",
)
torch.serialization.add_safe_globals([LayerCache])


def signature(layer, **sizes) -> str:
    """What a layer's states record as ``made_by``: its type and sizes,
    ``"GatedDeltaNet(hidden_size=64, num_heads=2, ...)"``."""
    return f"{type(layer).__name__}(" + ", ".join(f"{k}={v}" for k, v in sizes.items()) + ")"


def state_entries(layer, state, keys: tuple[str, ...]) -> tuple:
    """The entries ``keys`` of ``state`` (all ``None`` when ``state`` is ``None``).

    Raises:
        TypeError: ``state`` is not ``None`` or a dict (a tensor, say).
        ValueError: a :class:`LayerState` made by another kind of layer
            (``made_by`` differs from ``layer.state_signature``), or a dict without exactly
            ``keys``.
    """
    if state is None:
        return (None,) * len(keys)
    kind = type(layer).__name__
    if not isinstance(state, dict):
        fail(TypeError, f"state must be None or the dict {listed(keys)} that a {kind} returns, "
                        f"got {type(state).__name__}")
    made_by = getattr(state, "made_by", None)
    if made_by is not None and made_by != layer.state_signature:
        fail(ValueError, f"state was made by {made_by}; this layer is {layer.state_signature}")
    if set(state) != set(keys):
        fail(ValueError, f"state must be the dict {listed(keys)} that a {kind} returns, "
                         f"got keys {listed(state)}")
    return tuple(state[key] for key in keys)
