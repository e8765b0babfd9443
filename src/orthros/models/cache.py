"""The Orthros KV cache: every position of every layer is kept.

Sliding-window caches evict old keys; Orthros cannot, because each output
token reads the whole cache. Besides K/V the cache keeps, per slot, the
document id of the token (padding = -1) and, per row, the next RoPE
position and the current document id.

It is a `transformers.Cache`, so transformers' own `generate()` carries it
from step to step (and returns it with `return_dict_in_generate=True`);
the per-layer storage is Orthros' own ([B, S, Hkv, D], nothing evicted),
not transformers' layer objects.
"""

from __future__ import annotations

import torch
from transformers import Cache


class OrthrosCache(Cache):
    is_compileable = False  # grows by concatenation

    def __init__(self, num_layers: int):
        super().__init__(layers=[])  # no transformers layer objects: K/V live in `keys` / `values`
        self.num_layers = num_layers
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.key_doc: torch.Tensor | None = None  # [B, S]
        self.next_pos: torch.Tensor | None = None  # [B] RoPE position of the next token
        self.last_doc: torch.Tensor | None = None  # [B]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of slots held (padding included)."""
        return 0 if self.key_doc is None else self.key_doc.shape[1]

    @property
    def batch_size(self) -> int | None:
        return None if self.key_doc is None else self.key_doc.shape[0]

    def append_tokens(self, doc: torch.Tensor, next_pos: torch.Tensor, last_doc: torch.Tensor) -> None:
        """Record the new slots' documents [B, T] and the rows' running state."""
        self.key_doc = doc if self.key_doc is None else torch.cat([self.key_doc, doc], dim=1)
        self.next_pos, self.last_doc = next_pos, last_doc

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        """Append k, v [B, T, Hkv, D]; return the layer's whole cache [B, S, Hkv, D].

        (Argument order differs from `transformers.Cache.update`; only Orthros
        layers call it.)"""
        if self.keys[layer_idx] is not None:
            k = torch.cat([self.keys[layer_idx], k], dim=1)
            v = torch.cat([self.values[layer_idx], v], dim=1)
        self.keys[layer_idx], self.values[layer_idx] = k, v
        return k, v

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only batch rows `index` (e.g. drop finished sequences)."""
        for i, k in enumerate(self.keys):
            if k is not None:
                self.keys[i], self.values[i] = k[index], self.values[i][index]
        for name in ("key_doc", "next_pos", "last_doc"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[index])

    # ------------------------------------------------ transformers.Cache API
    def __len__(self) -> int:
        return self.num_layers

    def __repr__(self) -> str:
        return f"OrthrosCache(layers={self.num_layers}, batch={self.batch_size}, slots={self.get_seq_length()})"

    @property
    def is_initialized(self) -> bool:
        return self.key_doc is not None

    @property
    def is_croppable(self) -> bool:
        return False  # the rows' next RoPE positions cannot be recovered after dropping slots

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.num_layers  # nothing is ever evicted

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1  # grows without bound

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i becomes old row beam_idx[i]."""
        if self.key_doc is not None:
            self.select_rows(beam_idx.to(self.key_doc.device))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.key_doc is not None:
            rows = torch.arange(self.key_doc.shape[0], device=self.key_doc.device)
            self.select_rows(rows.repeat_interleave(repeats))

    def reset(self) -> None:
        self.__init__(self.num_layers)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise NotImplementedError("OrthrosCache cannot be cropped (assisted / speculative decoding is not supported)")

    def activate_past_recording(self) -> None:
        pass  # every position is always kept
