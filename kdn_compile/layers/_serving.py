"""The layers' serving path: slot pools (``allocate_cache``), ``reset_cache`` and ``step``.

A layer's cache is a dict of pools whose first dimension is the slot ``S``: the
convolution windows ``"conv" [S, conv_size - 1, C]`` and the recurrent state (per
layer, see :meth:`SlotCache.pool_rows`). ``step`` reads the slots named by
``state_indices``, advances them by the tokens of ``x`` and writes them back in
place; a negative index is a padding row: its outputs are zeros and no slot is read
or written. Nothing branches on tensor values or reads them on the host, so a step
traces with ``torch.compile(fullgraph=True)`` and replays in a CUDA graph
(``mode="reduce-overhead"``): every pool is marked with
:func:`torch._dynamo.mark_static_address`, which lets CUDA graph trees keep the
in-place writes to it instead of skipping the graph for a mutated input.
"""

from __future__ import annotations

import torch

import kdn_compile.ops  # noqa: F401  (registers torch.ops.kdn)
from kdn_compile._backend import prefer_kernels
from kdn_compile._checks import check_cu_seqlens, check_pool, check_slot_indices, check_slot_values
from kdn_compile._checks import check_tensor, dims, fail, listed, num_sequences, sequence_of, shown
from kdn_compile._checks import type_name
from kdn_compile.layers._state import LayerCache
from kdn_compile.reference.fp8 import dequantize_state_fp8
from kdn_compile.reference.pools import POOL_BLOCK_V, gather_slots
from kdn_compile.checkpoints import check_checkpoints, kept_slots
from kdn_compile.serving import MAX_DECODE_TOKENS, write_slots, write_states

FLOAT8 = torch.float8_e4m3fn


def load_state(cache: dict, key: str, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The named slots of ``cache[key]`` in ``dtype`` (float8: dequantized with its scales);
    padding rows read slot 0."""
    state = gather_slots(cache[key], indices)
    if state.dtype == FLOAT8:
        scales = gather_slots(cache[key + "_scales"], indices)
        return dequantize_state_fp8(state, scales, POOL_BLOCK_V, dtype)
    return state.to(dtype)


def store_state(cache: dict, key: str, indices: torch.Tensor, state: torch.Tensor) -> None:
    """``state [N, ...]`` back into the named slots of ``cache[key]`` (float8: quantized as
    :func:`kdn_compile.reference.fp8.quantize_state_fp8`, one scale per ``[K, 64]`` tile)."""
    write_states(cache[key], cache.get(key + "_scales"), indices, state)


def padding_mask(indices: torch.Tensor, x: torch.Tensor, cu_seqlens) -> torch.Tensor:
    """``[B, T, 1]`` bool: True on the tokens of rows (or packed sequences) with a slot."""
    valid = indices >= 0
    if cu_seqlens is None:
        return valid[:, None, None]
    steps = torch.arange(x.shape[1], device=x.device)
    sequence = sequence_of(cu_seqlens.to(torch.long), steps)
    return valid[sequence][None, :, None]


class SlotCache:
    """Mixin of the serving entry points; a layer defines :attr:`state_dtypes`,
    :meth:`pool_layout` and :meth:`advance` (and :meth:`fresh_row` for a pool whose
    fresh slot is not zeros)."""

    state_dtypes: tuple = (torch.float32, torch.bfloat16, FLOAT8, torch.float64)

    def pool_layout(self, state_dtype: torch.dtype) -> dict[str, tuple[tuple, torch.dtype]]:
        """``{name: (shape of one slot, dtype)}`` of the cache's pools."""
        raise NotImplementedError

    def advance(self, x, cache, indices, cu_seqlens, decode: bool) -> torch.Tensor:
        """The layer's step after the checks: ``y [B, T, D]`` (padding rows not yet zeroed)."""
        raise NotImplementedError

    def fresh_row(self, name: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        """One fresh slot of pool ``name``: zeros, ones for float8 scales."""
        fill = 1.0 if name.endswith("_scales") else 0.0
        return torch.full(shape, fill, dtype=dtype, device=device)

    def _fresh_rows(self, state_dtype, device) -> dict[str, torch.Tensor]:
        return {name: self.fresh_row(name, shape, dtype, device)
                for name, (shape, dtype) in self.pool_layout(state_dtype).items()}

    def _check_state_dtype(self, state_dtype) -> None:
        if state_dtype not in self.state_dtypes:
            allowed = ", ".join(str(d).replace("torch.", "") for d in self.state_dtypes)
            fail(TypeError, f"state_dtype of a {type(self).__name__} cache must be one of "
                            f"{allowed}, got {state_dtype!r}")

    @property
    def _state_key(self) -> str:
        return "recurrent"

    def allocate_cache(self, num_slots: int, *, state_dtype: torch.dtype = torch.float32,
                       device=None) -> LayerCache:
        """Zeroed pools for ``num_slots`` sequences, the layer's serving cache.

        Args:
            num_slots: slots ``S`` (a positive int): the sequences held at once.
            state_dtype: dtype of the recurrent state pool, float32 (default), bfloat16,
                float8_e4m3fn (not for :class:`DiagKDN`) or float64 (exact checks).
            device: the pools' device (default: the layer's parameters').

        Returns:
            A :class:`~kdn_compile.layers.LayerCache` (a dict that records this layer's
            ``state_signature`` as ``made_by``) of contiguous pools, first dimension the
            slot, each marked with
            :func:`torch._dynamo.mark_static_address` (CUDA graphs update them in place):
            ``"conv" [S, conv_size - 1, C]`` in the parameters' dtype, zeros; then
            :class:`GatedDeltaNet` / :class:`KimiDeltaAttention`: ``"recurrent"
            [S, Hv, K, V]`` in ``state_dtype``, zeros, and for float8
            ``"recurrent_scales" [S, Hv, ceil(V / 64)]`` float32, ones (the scale of an
            all-zero ``[K, 64]`` tile); :class:`DiagKDN`: ``"memory" [S, H, K, V]`` in
            ``state_dtype``, zeros, and ``"precision" [S, H, K]`` float32 (float64 with a
            float64 memory) holding the learned prior precision
            ``INITIAL_PRECISION_FLOOR + softplus(initial_precision_param)``.

        Raises:
            ValueError: ``num_slots`` not a positive int.
            TypeError: ``state_dtype`` not one of the dtypes above.
        """
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            fail(ValueError, f"num_slots must be an int >= 1, got {shown(num_slots)}")
        self._check_state_dtype(state_dtype)
        device = self.q_proj.weight.device if device is None else torch.device(device)
        cache = {}
        with torch.no_grad():
            for name, row in self._fresh_rows(state_dtype, device).items():
                pool = row.expand(num_slots, *row.shape).contiguous()
                torch._dynamo.mark_static_address(pool)
                cache[name] = pool
        return LayerCache(self.state_signature, cache)

    def _check_cache(self, cache, device) -> int:
        """The pools of ``cache`` as :meth:`allocate_cache` makes them, allocated by a layer
        of this type and sizes when ``cache`` records one; returns ``S``."""
        if not isinstance(cache, dict):
            fail(TypeError, f"cache must be the dict of allocate_cache, got {type(cache).__name__}")
        made_by = getattr(cache, "made_by", None)
        if made_by is not None and made_by != self.state_signature:
            fail(ValueError, f"cache was allocated by {made_by}; this layer is "
                             f"{self.state_signature}: pass the cache of this layer's "
                             "allocate_cache")
        state = cache.get(self._state_key)
        dtype = state.dtype if isinstance(state, torch.Tensor) else None
        layout = self.pool_layout(dtype if dtype in self.state_dtypes else torch.float32)
        if set(cache) != set(layout):
            fail(ValueError, f"cache must be the pools {listed(layout)} of allocate_cache "
                             f"(for a {dtype} state), got keys {listed(cache)}")
        slots = None
        for name, (shape, dtype) in layout.items():
            names = "[S, " + ", ".join(str(n) for n in shape) + "]"
            dtypes = {"conv": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
                      self._state_key: self.state_dtypes}.get(name, (dtype,))
            slots = check_pool(f'cache["{name}"]', cache[name], names, shape, dtypes, device,
                               slots=slots)
        return slots

    def reset_cache(self, cache: dict, slots) -> None:
        """Put ``slots`` back to the fresh state of :meth:`allocate_cache`, for reuse.

        Args:
            cache: the dict of :meth:`allocate_cache`.
            slots: slot numbers, an int tensor or a list of ints (distinct, ``< S``;
                possibly none); negative ones are skipped.

        Raises:
            TypeError, ValueError: ``cache`` not such a dict, or one allocated by a layer
                of another type or sizes; ``slots`` not ints (RuntimeError on the device
                for a repeated or out-of-range slot).
        """
        device = next(iter(cache.values())).device if isinstance(cache, dict) and cache else None
        count = self._check_cache(cache, device)
        expected = "slots must be a 1-d int tensor or a list of ints"
        if not isinstance(slots, (torch.Tensor, list, tuple)):
            fail(TypeError, f"{expected}, got {type_name(slots)}")
        # an empty list has no ints to infer the dtype from (as_tensor: float32)
        empty = isinstance(slots, (list, tuple)) and not slots
        try:
            indices = torch.as_tensor(slots, device=device, dtype=torch.long if empty else None)
        except (TypeError, ValueError, RuntimeError, OverflowError) as error:
            fail(TypeError, f"{expected} (int64), got {slots!r:.80}: {error}")
        if indices.dtype not in (torch.int32, torch.int64) or indices.dim() != 1:
            fail(TypeError, f"{expected}, got {indices.dtype} of shape {dims(indices.shape)}")
        check_slot_indices(indices, indices.shape[0], count, device, name="slots",
                           beside="the cache")
        check_slot_values(indices, count, name="slots")
        fresh = self._fresh_rows(cache[self._state_key].dtype, device)
        with torch.no_grad():
            for name, row in fresh.items():
                write_slots(cache[name], indices, row.expand(indices.shape[0], *row.shape))

    def step(self, x: torch.Tensor, cache: dict, state_indices: torch.Tensor,
             cu_seqlens: torch.Tensor | None = None, *,
             checkpoint_indices: torch.Tensor | None = None,
             checkpoint_every: int | None = None) -> torch.Tensor:
        """Advance the slots ``state_indices`` of ``cache`` by the tokens of ``x``, in place.

        Row ``b`` of ``x`` (or packed sequence ``b`` with ``cu_seqlens``) continues the
        sequence held in slot ``state_indices[b]``; its convolution window and recurrent
        state are read from the pools and the new ones written back. A decode step
        (``T <= 8`` tokens per row, no ``cu_seqlens``) runs the decode ops on the pools
        in place (:func:`kdn_compile.delta_rule_decode` /
        :func:`kdn_compile.diag_kdn_decode`); a prompt of any length, or packed prompts,
        run the chunked ops of ``forward`` from the gathered states (float8:
        dequantized) and write the final states back (float8: quantized per
        ``[K, 64]`` tile). The math is that of ``forward``: prefilling with ``step``
        and decoding token by token equals one ``forward`` over the whole sequence. It
        runs without autograd (``y`` carries no gradient).

        Prefix-cache checkpoints: with
        ``checkpoint_indices [N, C]`` and ``checkpoint_every`` (a multiple of 64), slot
        ``checkpoint_indices[n, c]`` also receives, in every pool, what sequence ``n``'s
        own slot would hold after its first ``(c + 1) * checkpoint_every`` tokens of this
        step (recurrent state and convolution window); checkpoints past a sequence's
        end, of padding rows and with a negative index are not written
        (:func:`kdn_compile.chunk_checkpoints`). A prompt that starts with those tokens
        copies the slot into its own (:meth:`copy_slots`) and steps only the rest, with
        the outputs and final slot of stepping the whole prompt up to rounding (the
        projections of fewer tokens may round differently; the GDN and KDA recurrence
        itself resumes bit for bit on CUDA from a float32 pool, see
        :func:`kdn_compile.chunk_checkpoints`; Diag-KDN's gain scan composes its chunks in
        another order, within rounding). A step with checkpoints runs the chunked kernels at
        chunk size 64 whatever the layer's ``chunk_size`` (other sizes: within rounding of
        the plain step's outputs).

        Args:
            x: ``[B, T, D]`` activations in the parameters' dtype (checked outside
                ``torch.autocast``, which casts the projections' operands).
            cache: the dict of :meth:`allocate_cache`, on ``x``'s device.
            state_indices: ``[N]`` int32/int64 slots on ``x``'s device, ``N = B`` (or
                the packed sequences); non-negative ones distinct and ``< S`` (checked
                on the device without a host sync); negative: a padding row.
            cu_seqlens: optional ``[N + 1]`` boundaries of packed prompts (``B == 1``).
            checkpoint_indices: optional ``[N, C]`` int32/int64 slots on ``x``'s device
                (those written distinct, ``< S`` and not in ``state_indices``: checked on
                the device), with ``checkpoint_every``.
            checkpoint_every: tokens between checkpoints, a positive multiple of 64.

        Returns:
            ``y [B, T, D]`` in ``x``'s dtype; zeros on the tokens of padding rows, whose
            slots (and every slot not named) are neither read nor written. With no
            tokens (``T == 0``) or no rows the pools keep their values.

        Raises:
            ValueError, TypeError: naming the argument: ``x`` not ``[B, T, D]`` or (a
                TypeError) not in the parameters' dtype outside ``torch.autocast``;
                ``cache`` not this layer's pools on ``x``'s device, or (a ValueError)
                allocated by a layer of another type or sizes (a KimiDeltaAttention
                cache given to a GatedDeltaNet, though its pools have the same shapes);
                ``state_indices``
                of the wrong dtype, shape or device; ``cu_seqlens`` as in ``forward``;
                ``checkpoint_indices`` without ``checkpoint_every`` or the other way
                round, either as :func:`kdn_compile.chunk_checkpoints` refuses it, or
                ``checkpoint_every`` below the convolution's window ``conv_size - 1``.
            NotImplementedError: checkpoints for a GatedDeltaNet with ``state_qdq`` or a
                ``w_quantizer``.
        """
        check_tensor("x", x, floating=False)
        if x.dim() != 3:
            fail(ValueError, f"x must be [B, T, D] (3 dims), got shape {dims(x.shape)}")
        slots = self._check_cache(cache, x.device)
        check_cu_seqlens(cu_seqlens, x.shape[0], x.device, x.shape[1])
        rows = num_sequences(x.shape[0], cu_seqlens)
        check_slot_indices(state_indices, rows, slots, x.device, beside="x")
        state_indices = state_indices.contiguous()  # the kernels index it as a dense vector
        # no tokens: the prefill path, whose ops take T == 0 (the decode ops need T >= 1)
        decode = cu_seqlens is None and 1 <= x.shape[1] <= MAX_DECODE_TOKENS
        # The decode kernels check the values themselves (an assert after the step, since the
        # device runs ahead of the host); elsewhere check them before any pool is written.
        if not decode or not prefer_kernels(x.device.type):
            check_slot_values(state_indices, slots)
        kept = self._checkpoint_slots(x, state_indices, cu_seqlens, slots, checkpoint_indices,
                                      checkpoint_every)
        with torch.no_grad():  # serving: the decode ops have no autograd
            if kept is None or decode:  # a decode step holds no checkpoint (T < 64)
                y = self.advance(x, cache, state_indices, cu_seqlens, decode)
            else:
                y = self.advance(x, cache, state_indices, cu_seqlens, decode,
                                 checkpoints=(kept, checkpoint_every,
                                              checkpoint_indices.shape[1]))
        return torch.where(padding_mask(state_indices, x, cu_seqlens), y, 0.0)

    def _checkpoint_slots(self, x, state_indices, cu_seqlens, slots, checkpoint_indices,
                          checkpoint_every):
        """``[N * C]`` slots of the kept checkpoints (-1 elsewhere), checked; None without
        checkpoints."""
        if checkpoint_indices is None and checkpoint_every is None:
            return None
        if checkpoint_indices is None or checkpoint_every is None:
            fail(ValueError, "checkpoint_indices and checkpoint_every go together, got "
                             f"checkpoint_indices {type_name(checkpoint_indices)} and "
                             f"checkpoint_every {type_name(checkpoint_every)}")
        if not self._keeps_checkpoints:
            raise NotImplementedError(
                f"{type(self).__name__}.step keeps no prefix-cache checkpoints with state_qdq "
                "or a w_quantizer (its prefill quantizes as the checkpoints' kernels do not)")
        rows = num_sequences(x.shape[0], cu_seqlens)
        check_checkpoints(checkpoint_indices, checkpoint_every, rows, x.device)
        width = self.conv.kernel_size - 1  # the window must lie within this step's tokens
        if width > checkpoint_every:
            fail(ValueError, f"checkpoint_every must be at least the convolution's window "
                             f"conv_size - 1 = {width}, got {checkpoint_every}")
        named = torch.where(state_indices[:, None] >= 0, checkpoint_indices, -1)
        kept = kept_slots(named, checkpoint_every, cu_seqlens, x.shape[0], x.shape[1])
        # a checkpoint slot is none of the sequences' own (those are written too)
        check_slot_values(torch.cat((state_indices.to(kept.dtype), kept)), slots,
                          name="checkpoint_indices (with state_indices)")
        return kept

    @property
    def _keeps_checkpoints(self) -> bool:
        """Whether :meth:`advance` takes ``checkpoints``."""
        return False

    def copy_slots(self, cache: dict, source: torch.Tensor, destination: torch.Tensor) -> None:
        """Copy slots within ``cache``, in place: every pool's row ``source[i]`` into row
        ``destination[i]`` (a prefix-cache hit: a checkpoint into a sequence's slot).

        Args:
            cache: the dict of :meth:`allocate_cache`.
            source, destination: ``[M]`` int32/int64 slots on the cache's device;
                ``destination`` distinct and ``< S``, ``source < S`` (checked on the device);
                pairs with a negative entry are skipped.

        Raises:
            TypeError, ValueError: ``cache`` not this layer's, ``source`` or
                ``destination`` of the wrong dtype, shape or device.
        """
        device = next(iter(cache.values())).device if isinstance(cache, dict) and cache else None
        count = self._check_cache(cache, device)
        if not isinstance(source, torch.Tensor) or source.dim() != 1:
            fail(TypeError, f"source must be a 1-d int tensor, got {type_name(source)}"
                            + (f" of shape {dims(source.shape)}"
                               if isinstance(source, torch.Tensor) else ""))
        check_slot_indices(source, source.shape[0], count, device, name="source",
                           beside="the cache")
        check_slot_indices(destination, source.shape[0], count, device, name="destination",
                           beside="the cache")
        skip = (source < 0) | (destination < 0)
        destination = torch.where(skip, -1, destination)
        check_slot_values(destination, count, name="destination")
        torch._assert_async((torch.where(skip, -1, source) < count).all(),
                            "source must be < the pool's slots S")
        with torch.no_grad():
            for pool in cache.values():
                write_slots(pool, destination, gather_slots(pool, torch.where(skip, 0, source)))

    # -- speculative decoding: a layer defines _value_heads, _draft_layout, _verify_mix
    # and _commit_mix
    def allocate_drafts(self, batch: int, tokens: int, *, state_dtype: torch.dtype = torch.float32,
                        device=None) -> dict[str, torch.Tensor]:
        """The buffers of a speculative-decoding verification of ``tokens`` draft tokens for
        ``batch`` rows (:meth:`verify` fills them, :meth:`commit` reads them).

        Args:
            batch: rows ``B`` of each verification (an int >= 1; pad with index -1).
            tokens: draft tokens ``T`` per row, ``1 <= T <= 8``.
            state_dtype: the dtype of the cache's state pool (:meth:`allocate_cache`):
                the states are kept in float32, float64 for a float64 pool.
            device: default the parameters'.

        Returns:
            ``{"conv": [B, conv_size - 1 + T, C]`` in the parameters' dtype (each row's
            convolution window, then its tokens' convolution inputs), and the state after
            each token: ``"recurrent": [B, T, Hv, K, V]`` (:class:`GatedDeltaNet`,
            :class:`KimiDeltaAttention`) or ``"memory": [B, T, H, K, V]`` and
            ``"precision": [B, T, H, K]`` (:class:`DiagKDN`); ``"indices": [B]`` int64,
            the slots of the verification that filled them (-1 before any)``}``, zeros,
            each marked with :func:`torch._dynamo.mark_static_address`.

        Raises:
            ValueError: ``batch`` or ``tokens`` out of range; TypeError: ``state_dtype``
                not a pool dtype.
        """
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            fail(ValueError, f"batch must be an int >= 1, got {shown(batch)}")
        if (isinstance(tokens, bool) or not isinstance(tokens, int)
                or not 1 <= tokens <= MAX_DECODE_TOKENS):
            fail(ValueError, f"tokens must be an int in 1..{MAX_DECODE_TOKENS}, got {shown(tokens)}")
        self._check_state_dtype(state_dtype)
        device = self.q_proj.weight.device if device is None else torch.device(device)
        (window, channels), conv_dtype = self.pool_layout(state_dtype)["conv"]
        drafts = {"conv": torch.zeros(batch, window + tokens, channels, dtype=conv_dtype,
                                      device=device),
                  # the slots of the verification that filled the buffers (-1: none yet)
                  "indices": torch.full((batch,), -1, dtype=torch.long, device=device)}
        for name, (shape, dtype) in self._draft_layout(state_dtype).items():
            drafts[name] = torch.zeros((batch, tokens) + shape, dtype=dtype, device=device)
        for buffer in drafts.values():
            torch._dynamo.mark_static_address(buffer)
        return drafts

    def _check_drafts(self, drafts, cache, batch: int, tokens: int | None = None) -> int:
        """``drafts`` as :meth:`allocate_drafts` makes them for this cache; returns ``T``."""
        layout = self._draft_layout(cache[self._state_key].dtype)
        names = {"conv", "indices", *layout}
        if not isinstance(drafts, dict) or set(drafts) != names:
            fail(TypeError if not isinstance(drafts, dict) else ValueError,
                 f"drafts must be the dict of allocate_drafts (keys {', '.join(sorted(names))}), "
                 "got " + (f"keys {sorted(drafts)}" if isinstance(drafts, dict)
                           else type(drafts).__name__))
        first = next(iter(layout))
        check_tensor(f'drafts["{first}"]', drafts[first], floating=False)
        if drafts[first].dim() != 2 + len(layout[first][0]):
            fail(ValueError, f'drafts["{first}"] must be [B, T, ...] ({2 + len(layout[first][0])} '
                             f"dims) as allocate_drafts makes it, got shape "
                             f"{dims(drafts[first].shape)}")
        t = drafts[first].shape[1]
        if tokens is not None and t != tokens:
            fail(ValueError, f'drafts["{first}"] must be [B, T, ...] with T = {tokens} (the '
                             f"tokens of x), got shape {dims(drafts[first].shape)}")
        device = cache["conv"].device
        for name, (shape, dtype) in layout.items():
            if isinstance(drafts[name], torch.Tensor) and drafts[name].dtype != dtype:
                fail(TypeError, f'drafts["{name}"] must be {dtype} for this cache, got '
                                f"{drafts[name].dtype}: allocate the drafts with the cache's "
                                f"state_dtype (allocate_drafts(..., state_dtype="
                                f"{cache[self._state_key].dtype}))")
            check_pool(f'drafts["{name}"]', drafts[name], "[B, T, " + ", ".join(
                str(n) for n in shape) + "]", (t,) + shape, (dtype,), device, slots=batch)
        window, channels = cache["conv"].shape[1:]
        check_pool('drafts["conv"]', drafts["conv"], "[B, conv_size - 1 + T, C]",
                   (window + t, channels), (cache["conv"].dtype,), device, slots=batch)
        check_pool('drafts["indices"]', drafts["indices"], "[B]", (), (torch.long,), device,
                   slots=batch)
        return t

    def verify(self, x: torch.Tensor, cache: dict, state_indices: torch.Tensor,
               drafts: dict) -> torch.Tensor:
        """A speculative-decoding verification: the outputs of ``T`` draft tokens per row from
        the named slots, which stay as they are; the state and convolution window after each
        token go to ``drafts``, for :meth:`commit`.

        The outputs are those of ``step(x, cache, state_indices)``. Nothing synchronizes with
        the host: a verification replays in a CUDA graph.

        Args:
            x: ``[B, T, D]`` in the parameters' dtype, ``1 <= T <= 8``.
            cache: the dict of :meth:`allocate_cache`.
            state_indices: ``[B]`` int32/int64 slots (negative: a padding row), as ``step``.
            drafts: the dict of :meth:`allocate_drafts` for ``B`` rows and ``T`` tokens.

        Returns:
            ``y [B, T, D]`` in ``x``'s dtype, zeros on padding rows.

        Raises:
            ValueError, TypeError: naming the argument, as ``step``; ``drafts`` not of
                ``allocate_drafts(B, T)`` for this cache.
        """
        check_tensor("x", x, floating=False)
        if x.dim() != 3 or not 1 <= x.shape[1] <= MAX_DECODE_TOKENS:
            fail(ValueError, f"x must be [B, T, D] with 1 <= T <= {MAX_DECODE_TOKENS}, got shape "
                             f"{dims(x.shape)}")
        slots = self._check_cache(cache, x.device)
        check_slot_indices(state_indices, x.shape[0], slots, x.device, beside="x")
        self._check_drafts(drafts, cache, x.shape[0], x.shape[1])
        indices = state_indices.contiguous()
        if not prefer_kernels(x.device.type):
            check_slot_values(indices, slots)
        from kdn_compile.layers._common import convolved_qkv

        with torch.no_grad():
            windows = gather_slots(cache["conv"], indices)
            q, k, v, _, inputs = convolved_qkv(self, x, windows, None, self._value_heads,
                                               with_inputs=True)
            drafts["conv"].copy_(torch.cat((windows.to(inputs.dtype), inputs), dim=1))
            drafts["indices"].copy_(indices)
            y = self.output(self._verify_mix(x, q, k, v, cache, indices, drafts), x)
        return torch.where(padding_mask(indices, x, None), y, 0.0)

    def commit(self, cache: dict, state_indices: torch.Tensor, accepted: torch.Tensor,
               drafts: dict) -> None:
        """Commit a verification: slot ``state_indices[b]`` takes its recurrent state and
        convolution window after the first ``accepted[b]`` draft tokens; with 0 it keeps
        what it held before the verification; padding rows write nothing.

        Then the slot holds what ``step`` over the accepted tokens leaves (up to the
        rounding of the projections over ``T`` rows at once against fewer): the states
        through :func:`kdn_compile.commit_states` (:func:`kdn_compile.commit_diag_kdn_states`
        for :class:`DiagKDN`).

        Args:
            cache: the dict of :meth:`allocate_cache` the verification read.
            state_indices: ``[B]`` the slots the verification named.
            accepted: ``[B]`` int32/int64 in ``0..T``, checked on the device (a
                device-side assert on CUDA, a RuntimeError on the CPU).
            drafts: the dict the verification filled.

        Raises:
            ValueError, TypeError: naming the argument, as :meth:`verify`.
            RuntimeError: on the CPU (a device-side assert on CUDA), ``accepted`` outside
                ``0..T``, or ``state_indices`` not those of the verification that filled
                ``drafts`` (drafts never filled, or a row padded there and named here).
        """
        state = cache.get(self._state_key) if isinstance(cache, dict) else None
        device = state.device if isinstance(state, torch.Tensor) else None
        slots = self._check_cache(cache, device)
        conv = drafts.get("conv") if isinstance(drafts, dict) else None
        batch = conv.shape[0] if isinstance(conv, torch.Tensor) else -1
        t = self._check_drafts(drafts, cache, batch)
        check_slot_indices(state_indices, batch, slots, device, beside="cache")
        check_slot_indices(accepted, batch, slots, device, name="accepted", beside="cache")
        with torch.no_grad():
            if device.type != "meta":
                torch._assert_async((state_indices.long() == drafts["indices"]).all(),
                                    "state_indices must be those of the verification that "
                                    "filled drafts (padding rows included)")
            self._commit_mix(cache, state_indices.contiguous(), accepted, drafts)
            window = cache["conv"].shape[1]
            rows = (accepted.long().clamp(0, t)[:, None]
                    + torch.arange(window, device=device)[None, :])
            windows = drafts["conv"].gather(
                1, rows[..., None].expand(-1, -1, drafts["conv"].shape[-1]))
            write_slots(cache["conv"], torch.where(accepted > 0, state_indices, -1), windows)

    @property
    def _value_heads(self) -> int:
        """Value heads of the convolution's v (a layer's)."""
        raise NotImplementedError

    def _draft_layout(self, state_dtype) -> dict[str, tuple[tuple, torch.dtype]]:
        """``{name: (shape of one token's state, dtype)}`` that a verification keeps."""
        raise NotImplementedError

    def _verify_mix(self, x, q, k, v, cache, indices, drafts) -> torch.Tensor:
        """The recurrence of a verification: ``o``, the states after each token into
        ``drafts``, the pools untouched."""
        raise NotImplementedError

    def _commit_mix(self, cache, indices, accepted, drafts) -> None:
        """The states of each row's accepted tokens from ``drafts`` into its slots."""
        raise NotImplementedError

    def _conv_step(self, x, cache, indices, cu_seqlens, value_heads, checkpoints=None):
        """q, k, v through the convolution from the named windows; the new windows stored,
        and with ``checkpoints`` (``(kept slots [N * C], every, C)``) the window after
        each kept checkpoint's tokens into its slot."""
        from kdn_compile.layers._common import convolved_qkv

        windows = gather_slots(cache["conv"], indices)
        q, k, v, windows, *inputs = convolved_qkv(self, x, windows, cu_seqlens, value_heads,
                                                  with_inputs=checkpoints is not None)
        write_slots(cache["conv"], indices, windows)
        if checkpoints is not None:
            kept, every, count = checkpoints
            write_slots(cache["conv"], kept,
                        checkpoint_windows(inputs[0], cu_seqlens, every, count,
                                           cache["conv"].shape[1]))
        return q, k, v


def checkpoint_windows(inputs: torch.Tensor, cu_seqlens, every: int, count: int,
                       width: int) -> torch.Tensor:
    """``[N * C, width, channels]``: the convolution inputs ``inputs [B, T, channels]`` of
    the ``width`` tokens before token ``(c + 1) * every`` of each sequence (the window a
    slot holds after those tokens; rows past a sequence's end are clamped and never
    written, see :func:`kdn_compile.checkpoints.kept_slots`)."""
    batch, length = inputs.shape[0], inputs.shape[1]
    device = inputs.device
    if length == 0:  # no token: no checkpoint is kept
        rows = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
        return inputs.new_zeros((rows * count, width, inputs.shape[2]))
    ends = (torch.arange(count, device=device) + 1) * every  # [C]
    offsets = torch.arange(width, device=device) - width  # [width]
    if cu_seqlens is None:
        rows = torch.arange(batch, device=device)[:, None, None].expand(batch, count, width)
        times = (ends[:, None] + offsets[None, :]).clamp(0, max(length - 1, 0))
        return inputs[rows, times.expand(batch, count, width)].flatten(0, 1)
    starts = cu_seqlens[:-1].to(torch.int64)
    times = (starts[:, None, None] + ends[None, :, None] + offsets[None, None, :])
    return inputs[0, times.clamp(0, max(length - 1, 0))].flatten(0, 1)
