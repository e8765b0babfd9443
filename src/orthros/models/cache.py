"""The Orthros KV cache: every position of every layer is kept.

Sliding-window caches evict old keys; Orthros cannot, because each output
token reads the whole cache. Besides K/V the cache keeps, per slot, the
document id (padding = -1) and the RoPE position of the token and, per row,
the next RoPE position and the current document id.

It is a `transformers.Cache` whose `layers` are transformers' own
`DynamicLayer`s (K/V [B, Hkv, S, D], grown by concatenation, nothing
evicted), so transformers' generate() carries it from step to step and its
cache utilities (crop, beam reordering, batch selection, `layers[i].keys`)
work on it. Orthros layers call `write(layer_idx, k, v)` with [B, T, Hkv, D]
(the `models.kv.KVCache` contract); `update` returns the whole layer as [B, S, Hkv, D] views.

Cropping is exact: a base token's K/V depend only on the tokens at or before
it, so dropping the last k slots leaves the cache the earlier, shorter call
built, once each row's next position and document are recomputed from the
slots that remain. This is what assisted generation and prompt-lookup
decoding do after verifying drafted tokens.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from transformers import Cache
from transformers.cache_utils import DynamicLayer

from ..ops.kv import DenseKV
from ..ops.masks import PAD_DOC


class OrthrosCache(Cache):
    """Implements `models.kv.KVCache`."""

    is_compileable = False  # grows by concatenation
    reference_reads = True

    def __init__(self, num_layers: int):
        super().__init__(layers=[DynamicLayer() for _ in range(num_layers)])
        self.num_layers = num_layers
        self.key_doc: torch.Tensor | None = None  # [B, S] document of each slot (PAD_DOC = padding)
        self.key_pos: torch.Tensor | None = None  # [B, S] RoPE position of each slot
        self.next_pos: torch.Tensor | None = None  # [B] RoPE position of the next token
        self.last_doc: torch.Tensor | None = None  # [B]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of slots held (padding included)."""
        return 0 if self.key_doc is None else self.key_doc.shape[1]

    @property
    def batch_size(self) -> int | None:
        return None if self.key_doc is None else self.key_doc.shape[0]

    def append_tokens(self, doc: torch.Tensor, next_pos: torch.Tensor, last_doc: torch.Tensor,
                      pos: torch.Tensor | None = None) -> None:
        """Record the new slots' documents and positions [B, T] and the rows' running state."""
        if pos is None:
            raise ValueError("OrthrosCache.append_tokens needs the new slots' positions (pos=[B, T])")
        pos = pos.expand_as(doc)
        self.key_doc = doc if self.key_doc is None else torch.cat([self.key_doc, doc], dim=1)
        self.key_pos = pos if self.key_pos is None else torch.cat([self.key_pos, pos], dim=1)
        self.next_pos, self.last_doc = next_pos, last_doc

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        """Append k, v [B, T, Hkv, D]; return the layer's whole cache [B, S, Hkv, D].

        (Argument order differs from `transformers.Cache.update`; only Orthros
        layers call it.)"""
        keys, values = self.layers[layer_idx].update(k.transpose(1, 2), v.transpose(1, 2))
        return keys.transpose(1, 2), values.transpose(1, 2)

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> DenseKV:
        """`update`, as the layers call it: the layer's whole cache as what attention reads."""
        return DenseKV(*self.update(layer_idx, k, v))

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer `layer_idx`'s K/V as [B, S, Hkv, D] (None before the first forward)."""
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            return None
        return layer.keys.transpose(1, 2), layer.values.transpose(1, 2)

    # ------------------------------------------------------------ row state
    def _select_state(self, index: torch.Tensor) -> None:
        for name in ("key_doc", "key_pos", "next_pos", "last_doc"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[index.to(t.device)])

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only batch rows `index` (e.g. drop finished sequences)."""
        self.batch_select_indices(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i becomes old row beam_idx[i]."""
        super().reorder_cache(beam_idx)
        self._select_state(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._select_state(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.key_doc is not None:
            rows = torch.arange(self.key_doc.shape[0], device=self.key_doc.device)
            self._select_state(rows.repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` slots (transformers' convention: a negative
        count; 0 changes nothing). Exact: each row's next RoPE position and current
        document become those after its last remaining real token."""
        tokens_to_remove = int(tokens_to_remove)  # transformers' assisted decoding passes a 0-d tensor
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of slots to remove, got {tokens_to_remove}")
        n, S = -tokens_to_remove, self.get_seq_length()
        if n == 0:
            return
        if n > S:
            raise ValueError(f"cannot remove {n} slots from a cache that holds {S}")
        if n == S:
            self.reset()
            return
        super().crop(tokens_to_remove)
        self.key_doc, self.key_pos = self.key_doc[:, : S - n], self.key_pos[:, : S - n]
        real = self.key_doc != PAD_DOC
        last = S - n - 1 - real.flip(1).int().argmax(1)  # each row's last real slot
        self.next_pos = torch.where(real.any(1), self.key_pos.gather(1, last[:, None]).squeeze(1) + 1, 0)
        self.last_doc = self.key_doc.amax(1).clamp_min(-1)

    def reset(self) -> None:
        self.__init__(self.num_layers)

    def __repr__(self) -> str:
        return f"OrthrosCache(layers={self.num_layers}, batch={self.batch_size}, slots={self.get_seq_length()})"


# --------------------------------------------------------------- torch.export
_STATE = ("key_doc", "key_pos", "next_pos", "last_doc")


def _flatten(cache: OrthrosCache):
    """An OrthrosCache as pytree leaves, so that torch.export can take and return one:
    every layer's K and V, then the slot / row state; the context says which are set."""
    slots = [t for layer in cache.layers for t in ((layer.keys, layer.values) if layer.is_initialized else (None, None))]
    slots += [getattr(cache, name) for name in _STATE]
    return [t for t in slots if t is not None], (cache.num_layers, tuple(t is not None for t in slots))


def _unflatten(leaves, context) -> OrthrosCache:
    num_layers, present = context
    it = iter(leaves)
    slots = [next(it) if p else None for p in present]
    cache = OrthrosCache(num_layers)
    for i, layer in enumerate(cache.layers):
        k, v = slots[2 * i], slots[2 * i + 1]
        if k is not None:
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
    for name, t in zip(_STATE, slots[2 * num_layers:]):
        setattr(cache, name, t)
    return cache


def _flatten_with_keys(cache: OrthrosCache):
    leaves, context = _flatten(cache)
    return [(pytree.SequenceKey(i), t) for i, t in enumerate(leaves)], context


pytree.register_pytree_node(OrthrosCache, _flatten, _unflatten, flatten_with_keys_fn=_flatten_with_keys,
                            serialized_type_name=f"{OrthrosCache.__module__}.{OrthrosCache.__qualname__}")
