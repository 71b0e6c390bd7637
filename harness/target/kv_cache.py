"""A KV cache whose layers append in place: ``model.static_cache`` (the default on an uncompiled target).

transformers' ``DynamicLayer`` appends a forward's rows with ``torch.cat([keys, new])``: every
forward copies the whole cache of every layer, ``2 * B * H_kv * L * d_h`` elements per layer, so a
decode step's cost grows with the context by copying, not by attention alone (SmolLM2 at a
1,024-token context: 47 MB copied per step). :class:`PreallocatedLayer` keeps each layer's keys and
values in buffers ``[B, H_kv, capacity, d_h]`` reserved ahead, writes a forward's rows into the
next free slots, and exposes ``keys`` / ``values`` as views ``[B, H_kv, L, d_h]`` of the buffers,
so everything that reads or edits them (attention, the backend's commit gather/scatter, its crop,
``DynamicLayer.crop``) works unchanged and in place. A forward that needs more slots than the
buffer holds reallocates it with at least twice the capacity (amortised O(1) per row).

Anything that replaces ``keys`` / ``values`` with a tensor that is not a prefix view of the buffers
(a batch-row selection, a reorder) is taken as the new content: the next update copies it into
fresh buffers. Requests leaving a batch go through :meth:`PreallocatedLayer.keep_batch_rows`
instead, which copies the kept rows once into buffers of the new batch size and the same capacity,
so the next forward appends in place. The views hold the same values a concatenating cache would,
so a forward reads the same keys and values either way (a test checks logits bit for bit against
``DynamicLayer``).

Bytes: :func:`harness.target.backend.cache_bytes` counts the views (the rows a request holds, as
for a dynamic cache); :func:`reserved_bytes` counts the buffers.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

#: slots reserved beyond what the first forward needs (and the least a reallocation adds)
DEFAULT_RESERVE = 256


class PreallocatedLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends into reserved buffers instead of concatenating."""

    def __init__(self, reserve: int | None = None, **kwargs) -> None:
        self._key_buffer: torch.Tensor | None = None  # [B, H_kv, capacity, d_h]
        self._value_buffer: torch.Tensor | None = None
        self._filled: int | None = None  # the cache is the buffers' first _filled slots (views made when read)
        self._set_layout()
        super().__init__(**kwargs)
        self.reserve = max(int(DEFAULT_RESERVE if reserve is None else reserve), 1)

    # ``keys`` / ``values`` as attributes of the layer: an assignment from outside (a crop to a
    # shorter prefix, a batch-row selection) records whether the new tensor is still a prefix view
    # of the buffer, so :meth:`update` never has to inspect pointers (nor does a compiled forward).
    # Where the cache is the buffers' first slots (after a forward or a crop) only that count is
    # kept, and the views are made the first time someone reads them: a step of the native stack
    # and a round's rollback then cost no tensor views at all.
    @property
    def keys(self) -> torch.Tensor | None:
        if self._filled is not None:
            self._make_views()
        return self._keys

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        if self._filled is not None:
            self._make_views()
        self._keys = value
        self._keys_in_buffer = _prefix_view(value, self._key_buffer)

    @property
    def values(self) -> torch.Tensor | None:
        if self._filled is not None:
            self._make_views()
        return self._values

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        if self._filled is not None:
            self._make_views()
        self._values = value
        self._values_in_buffer = _prefix_view(value, self._value_buffer)

    def _make_views(self) -> None:
        end, self._filled = self._filled, None
        self._keys, self._values = self._key_buffer.narrow(2, 0, end), self._value_buffer.narrow(2, 0, end)

    def get_seq_length(self) -> int:
        return self._filled if self._filled is not None else super().get_seq_length()

    def _set_layout(self) -> None:
        """Record the buffers' batch and heads, capacity and bytes per slot (read on every step)."""
        k, v = self._key_buffer, self._value_buffer
        if k is None:
            self._batch_heads, self._capacity, self._slot_bytes = None, 0, 0
            return
        self._batch_heads, self._capacity = tuple(k.shape[:2]), int(k.shape[-2])
        per_slot = k.shape[0] * k.shape[1] * k.shape[3] * k.element_size()
        self._slot_bytes = per_slot + v.shape[0] * v.shape[1] * v.shape[3] * v.element_size()

    def cached_bytes(self) -> int:
        """Bytes of the rows the layer holds (``keys`` and ``values``), without making views."""
        if self._filled is not None:
            return self._filled * self._slot_bytes
        keys, values = self._keys, self._values
        if keys is None or keys.dim() != 4:
            return 0
        return keys.numel() * keys.element_size() + values.numel() * values.element_size()

    @property
    def capacity(self) -> int:
        return self._capacity

    def _reallocate(self, length: int, needed: int, like_keys: torch.Tensor, like_values: torch.Tensor) -> None:
        """Fresh buffers of at least ``needed`` slots holding the first ``length`` current rows: the
        first ones with ``reserve`` slots to spare, an outgrown one at least doubled, a replaced one
        (new content that fits) at its old capacity."""
        old = self.capacity
        capacity = old if needed <= old else max(needed + self.reserve, 2 * old)
        b, h, _, d = like_keys.shape
        keys = like_keys.new_empty((b, h, capacity, d))
        values = like_values.new_empty((b, h, capacity, like_values.shape[-1]))
        if length:
            keys[:, :, :length] = self.keys
            values[:, :, :length] = self.values
        self._key_buffer, self._value_buffer = keys, values
        self._set_layout()

    def reserve_rows(self, rows: int, like_keys: torch.Tensor, like_values: torch.Tensor) -> int:
        """Make room for ``rows`` more rows after the cached ones (``like_*``: a forward's new keys and
        values, or tensors of their shape and dtype); returns the first free slot."""
        filled = self._filled
        if filled is not None and filled + rows <= self._capacity and like_keys.shape[:2] == self._batch_heads:
            return filled  # the cache is the buffers' prefix and the rows fit: nothing to move
        if not self.is_initialized:
            self.lazy_initialization(like_keys, like_values)
        length = self.get_seq_length()
        held = self._key_buffer if self._filled is not None else self._keys
        if length and tuple(held.shape[:2]) != tuple(like_keys.shape[:2]):
            raise ValueError(f"cache layer holds {tuple(self.keys.shape)}; cannot append {tuple(like_keys.shape)}")
        end = length + rows
        if not (self._keys_in_buffer and self._values_in_buffer) or end > self.capacity:
            self._reallocate(length, end, like_keys, like_values)
        return length

    def mark_filled(self, end: int) -> None:
        """The buffers' slots ``[0, end)`` hold the cache now (their views are made when read)."""
        self._filled = end
        self._keys_in_buffer = self._values_in_buffer = True

    def filled_to(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`mark_filled`, returning the slots ``[0, end)`` as ``keys`` / ``values``."""
        self.mark_filled(end)
        return self.keys, self.values

    def keep_first(self, end: int) -> None:
        """Keep the cache's first ``end`` rows (a crop): the count alone where the cache is the
        buffers' prefix, else a slice of whatever tensors it holds."""
        if self._keys_in_buffer and self._values_in_buffer:
            self.mark_filled(end)
        else:
            self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]

    def keep_batch_rows(self, index: torch.Tensor, end: int) -> None:
        """Keep the batch rows ``index`` (a long tensor on the cache's device) and their first ``end``
        slots, in fresh buffers of the kept batch size and the old capacity whose first ``end`` slots
        are the cache: the next forward appends in place, nothing reallocated (requests leaving a batch)."""
        keys, values = self.keys, self.values
        end = min(end, keys.shape[-2])
        capacity = self.capacity if end <= self.capacity else end + self.reserve
        b = index.numel()
        key_buffer = keys.new_empty((b, keys.shape[1], capacity, keys.shape[3]))
        value_buffer = values.new_empty((b, values.shape[1], capacity, values.shape[3]))
        torch.index_select(keys.narrow(2, 0, end), 0, index, out=key_buffer.narrow(2, 0, end))
        torch.index_select(values.narrow(2, 0, end), 0, index, out=value_buffer.narrow(2, 0, end))
        self._key_buffer, self._value_buffer = key_buffer, value_buffer
        self._keys, self._values = key_buffer.narrow(2, 0, end), value_buffer.narrow(2, 0, end)
        self._set_layout()
        self.mark_filled(end)

    @torch._dynamo.disable  # appending into a buffer the graph does not own: eager (a compiled forward breaks here)
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``key_states`` / ``value_states`` ``[B, H_kv, R, d_h]`` after the cached rows; return
        views of every cached row ``[B, H_kv, L + R, d_h]``."""
        start = self.reserve_rows(key_states.shape[-2], key_states, value_states)
        end = start + key_states.shape[-2]
        self._key_buffer[:, :, start:end] = key_states
        self._value_buffer[:, :, start:end] = value_states
        return self.filled_to(end)

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        self._filled = None
        self._set_layout()
        super().reset()


def _prefix_view(view: torch.Tensor | None, buffer: torch.Tensor | None) -> bool:
    """Whether ``view`` is ``buffer[:, :, :L]`` for some L (same storage start, strides and heads)."""
    return (
        view is not None
        and buffer is not None
        and view.dim() == 4
        and view.data_ptr() == buffer.data_ptr()
        and view.stride() == buffer.stride()
        and view.shape[:2] == buffer.shape[:2]
        and view.shape[-1] == buffer.shape[-1]
    )


def new_cache(config, *, preallocated: bool, reserve: int | None = None):
    """A ``DynamicCache`` for ``config``; with ``preallocated`` its plain full-attention layers are
    :class:`PreallocatedLayer` (a layer that stores nothing stays as transformers builds it; a layer
    with a recurrent or compressed state is refused: a round's rollback cannot cut rejected rows out
    of it).

    Sliding-window layers (Mistral, Qwen2 with ``use_sliding_window``, Gemma 2's local layers) and
    chunked-attention layers (Llama 4) are full-attention layers here: a run keeps every context
    inside the window (the chunk), where such attention attends to every position, as full
    attention does. transformers' sliding layer counts its length apart from its keys, so the
    backend's rollback and commit, which edit the keys, left that count stale and the next
    forward's mask too long. :func:`cache_window` gives the window, and the backend refuses a
    forward whose rows reach positions past it (tree rows sit at their depth's position whatever
    cache slot holds them)."""
    import transformers.cache_utils as cache_utils
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    # a layer that stores nothing (recent transformers releases; older ones, a GPU image's, have none)
    stateless = tuple(t for t in (getattr(cache_utils, "DummyLayer", None),) if t is not None)
    cache = DynamicCache(config=config)
    # the plain sliding layer (transformers builds chunked attention as one); its subclasses keep other state
    windows = [int(layer.sliding_window) for layer in cache.layers if type(layer) is DynamicSlidingWindowLayer]
    stateful = sorted(
        {
            type(layer).__name__
            for layer in cache.layers
            if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer, *stateless)
        }
    )
    if stateful:
        raise ValueError(
            f"a {type(config).__name__}'s cache has {', '.join(stateful)} layers, whose state rejected draft rows "
            "cannot be cut out of; the harness verifies on full, sliding-window or chunked attention layers"
        )

    def full(layer):
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
            return layer  # a layer that stores nothing
        return PreallocatedLayer(reserve=reserve) if preallocated else DynamicLayer()

    cache.layers = [full(layer) for layer in cache.layers]
    cache._harness_window = min(windows) if windows else None
    return cache


def cache_window(cache) -> int | None:
    """How many positions a forward's rows may reach while full attention equals the model's sliding
    window attention (None: no layer slides)."""
    return getattr(cache, "_harness_window", None)


def reserved_bytes(cache) -> int:
    """Bytes the cache's layers hold: preallocated buffers whole, other layers' tensors as they are."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, PreallocatedLayer) and layer._key_buffer is not None:
            tensors = (layer._key_buffer, layer._value_buffer)
        else:
            tensors = tuple(t for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor))
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def kv_head_count(config) -> int:
    """The key/value heads a decoder layer caches: ``num_key_value_heads`` where the config names
    it; Falcon's classic layers under ``multi_query`` one (its new decoder architecture caches its
    keys expanded to every attention head); else one per attention head."""
    n = getattr(config, "num_key_value_heads", None)
    if n:
        return int(n)
    falcon = getattr(config, "model_type", None) == "falcon"
    if falcon and getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
        return 1
    return int(config.num_attention_heads)
