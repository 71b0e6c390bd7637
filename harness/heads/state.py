"""Provenance of reused state (the self-draft state contract) and the target hidden-state tap.

``may_reuse`` is the metadata predicate of that contract: a necessary check before a tensor computed
on one path is used where another path needs it. It is not a proof of equality; each caller reuses a
tensor only where the computation is the same by construction (a full-target final-norm row under
the committed ancestry; a shallow-path row of the same layers under the same ancestry).

:class:`HiddenTap` observes every forward of the target's base model (a forward hook; outputs are
not changed) and keeps the last one: input ids, position ids, whether a custom mask was passed, the
cache length before the forward, and the final-norm hidden rows. Draft heads read ``h_{t-1}`` from
it: the prefill forward supplies the prompt rows, and each verify forward supplies the pending
row and the candidate rows, of which the accepted path becomes committed. The tap is how the heads
proposers work without an engine change; see :class:`HeadsProposer` for the proposed engine hook.

A proposer may also ask for the *next* forward to be handed to it (:meth:`HiddenTap.deliver_next`):
the verify forward that follows its proposal, whatever other forwards of the same model run later
(the end-to-end oracle interleaves many). And it may ask for the residual stream entering chosen
decoder layers (:meth:`HiddenTap.capture_layers`, EAGLE-3's fused features), kept per forward as
``CapturedForward.aux``.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateTag:
    """What a cached tensor is: enough metadata to refuse a mismatched reuse."""

    checkpoint: str  # target (or target + artifact) fingerprint
    layer_boundary: str  # e.g. "final_norm", "after_layer_3"
    token_id: int
    position: int
    ancestry_hash: int  # hash of every token up to and including token_id
    dtype: str
    cache_generation: int


def may_reuse(candidate: StateTag, need: StateTag) -> bool:
    """Every field must match (necessary, not sufficient: it does not prove the tensors equal)."""
    return (
        candidate.checkpoint == need.checkpoint
        and candidate.layer_boundary == need.layer_boundary
        and candidate.token_id == need.token_id
        and candidate.position == need.position
        and candidate.ancestry_hash == need.ancestry_hash
        and candidate.dtype == need.dtype
        and candidate.cache_generation == need.cache_generation
    )


class PrefixHashes:
    """Chained hashes of a growing token list: ``at(j)`` identifies ``tokens[: j + 1]``."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.hashes: list[int] = []

    def sync(self, tokens: Sequence[int]) -> None:
        limit = min(len(self.tokens), len(tokens))
        if self.tokens[:limit] == list(tokens[:limit]):  # the common case: append-only (C-level compare)
            n = limit
        else:
            n = 0
            while n < limit and self.tokens[n] == tokens[n]:
                n += 1
        del self.tokens[n:]
        del self.hashes[n:]
        prev = self.hashes[-1] if self.hashes else 0
        for tok in tokens[n:]:
            prev = hash((prev, int(tok)))
            self.tokens.append(int(tok))
            self.hashes.append(prev)

    def at(self, j: int) -> int:
        return self.hashes[j]

    @staticmethod
    def extend(base: int, tokens: Sequence[int]) -> int:
        for tok in tokens:
            base = hash((base, int(tok)))
        return base


@dataclass(frozen=True)
class CapturedForward:
    """One target forward as the tap saw it. Its ids and positions stay tensors on the model's
    device until read (:attr:`input_ids`, :attr:`positions`): reading a GPU tensor waits for the
    device, which inside the hook would stall the timed verify forward before its LM head."""

    serial: int
    ids: torch.Tensor  # [R] input ids, on the model's device
    pos: torch.Tensor | None  # [R] position ids (None: cache_len .. cache_len + R - 1)
    custom_mask: bool  # a 4D mask was passed (tree verify); False = plain causal
    cache_len: int  # rows in the cache before this forward
    hidden: torch.Tensor  # [R, d] final-norm hidden states
    aux: dict[int, torch.Tensor] | None = None  # layer l -> [R, d] residual stream entering layer l

    @functools.cached_property
    def input_ids(self) -> tuple[int, ...]:
        return tuple(int(t) for t in self.ids.tolist())

    @functools.cached_property
    def positions(self) -> tuple[int, ...]:
        if self.pos is None:
            return tuple(range(self.cache_len, self.cache_len + int(self.ids.shape[0])))
        return tuple(int(p) for p in self.pos.tolist())


class HiddenTap:
    """One forward hook per target model, shared by every proposer built on it."""

    _taps: weakref.WeakKeyDictionary[torch.nn.Module, HiddenTap] = weakref.WeakKeyDictionary()

    def __init__(self, model: torch.nn.Module) -> None:
        self.serial = 0
        self.last: CapturedForward | None = None
        base = model.base_model
        self._base = base
        self._handle = base.register_forward_hook(self._hook, with_kwargs=True)
        self._waiting: list[weakref.WeakMethod] = []  # callbacks for the next forward only
        self._layer_handles: dict[int, object] = {}
        self._aux: dict[int, torch.Tensor] = {}

    def deliver_next(self, callback: Callable[[CapturedForward | None], None]) -> None:
        """Hand the next forward of this model (``None`` for a batched one) to ``callback``, a bound
        method held weakly (a dropped proposer is not kept alive), then forget it."""
        self._waiting.append(weakref.WeakMethod(callback))

    def capture_layers(self, layers: Sequence[int]) -> None:
        """From now on record the residual stream entering each of ``layers`` (decoder layer indices
        of the base model) in ``CapturedForward.aux`` (HF ``hidden_states[l]``)."""
        blocks = self._base.layers
        for layer in layers:
            layer = int(layer)
            if not 0 <= layer < len(blocks):
                raise ValueError(f"decoder layer {layer} is outside the target's {len(blocks)} layers")
            if layer not in self._layer_handles:
                self._layer_handles[layer] = blocks[layer].register_forward_pre_hook(
                    self._pre_hook(layer), with_kwargs=True
                )

    def _pre_hook(self, layer: int):
        def hook(module, args, kwargs) -> None:
            x = args[0] if args else kwargs.get("hidden_states")
            if x is not None and x.dim() == 3 and x.shape[0] == 1:
                self._aux[layer] = x[0].detach()

        return hook

    @classmethod
    @contextlib.contextmanager
    def suspended(cls, model: torch.nn.Module) -> Iterator[None]:
        """Within: ``model`` runs without the tap's hooks (where it has a tap), so a forward that no
        proposer reads (the autoregressive arm's) takes the path it would take with no proposer
        built on the model; the hooks are back, as they were, after."""
        tap = cls._taps.get(model)
        if tap is None or tap._handle is None:
            yield
            return
        tap._handle.remove()
        tap._handle = None
        for handle in tap._layer_handles.values():
            handle.remove()
        layers, tap._layer_handles = list(tap._layer_handles), {}
        try:
            yield
        finally:
            tap._handle = tap._base.register_forward_hook(tap._hook, with_kwargs=True)
            tap.capture_layers(layers)

    @classmethod
    def on(cls, model: torch.nn.Module) -> HiddenTap:
        tap = cls._taps.get(model)
        if tap is None:
            tap = cls._taps[model] = cls(model)
        return tap

    def _hook(self, module, args, kwargs, output) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        hidden = getattr(output, "last_hidden_state", None)
        self.serial += 1
        aux, self._aux = self._aux, {}
        waiting, self._waiting = self._waiting, []
        if ids is None or hidden is None or ids.shape[0] != 1:
            self.last = None
            self._deliver(waiting)
            return
        pos = kwargs.get("position_ids")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        cache_len = 0
        if cache is not None:
            # the hook runs after the forward appended R rows
            cache_len = int(cache.get_seq_length()) - ids.shape[1]
        self.last = CapturedForward(
            serial=self.serial,
            ids=ids[0],
            pos=pos[0] if pos is not None else None,
            custom_mask=kwargs.get("attention_mask") is not None,
            cache_len=cache_len,
            hidden=hidden[0].detach(),
            aux={l: aux[l] for l in self._layer_handles if l in aux} or None,
        )
        self._deliver(waiting)

    def _deliver(self, waiting: list[weakref.WeakMethod]) -> None:
        for ref in waiting:
            callback = ref()
            if callback is not None:
                callback(self.last)


class CommittedHidden:
    """Final-norm target hidden rows of committed positions for one request, each admitted only
    through :func:`may_reuse` against the committed path (proposal-side copy, never target KV)."""

    def __init__(self, *, checkpoint: str, dtype: str, keep: int, boundary: str = "final_norm") -> None:
        self.checkpoint = checkpoint
        self.dtype = dtype
        self.boundary = boundary  # which rows: "final_norm", or e.g. EAGLE-3's fused layer inputs
        self.keep = max(int(keep), 1)
        self.rows: dict[int, torch.Tensor] = {}  # position -> [d]
        self.prefix = PrefixHashes()
        self.refused = 0

    def reset(self) -> None:
        self.rows.clear()
        self.prefix = PrefixHashes()

    def admit(self, captured: CapturedForward, index: int, *, ancestry_hash: int, generation: int) -> bool:
        """Admit row ``index`` of a captured forward if its tag matches the committed path."""
        pos = captured.positions[index]
        if pos >= len(self.prefix.tokens):
            return False
        have = StateTag(
            self.checkpoint, self.boundary, captured.input_ids[index], pos, ancestry_hash, self.dtype, captured.serial
        )
        need = StateTag(
            self.checkpoint, self.boundary, self.prefix.tokens[pos], pos, self.prefix.at(pos), self.dtype, generation
        )
        if not may_reuse(have, need):
            self.refused += 1
            return False
        self.rows[pos] = captured.hidden[index]
        return True

    def prune(self, newest: int) -> None:
        for p in [p for p in self.rows if p <= newest - self.keep]:
            del self.rows[p]

    def window(self, newest: int, width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rows ``newest - width + 1 .. newest`` -> (``[W, d]`` left-padded, ``[W]`` mask) or None
        when ``newest`` itself is missing. Older missing rows (a document start) are masked."""
        if newest not in self.rows:
            return None
        h = self.rows[newest]
        rows = torch.zeros(width, h.shape[-1], dtype=h.dtype, device=h.device)  # where the target's rows live
        mask = torch.zeros(width, dtype=torch.bool, device=h.device)
        for k in range(width):
            p = newest - (width - 1 - k)
            if p in self.rows:
                rows[k] = self.rows[p]
                mask[k] = True
            elif p >= 0 and k < width - 1:
                # a gap inside the window: keep only the contiguous suffix ending at `newest`
                rows[: k + 1] = 0
                mask[: k + 1] = False
        return rows, mask
