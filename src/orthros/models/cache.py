"""The Orthros KV cache: every position of every layer is kept.

Sliding-window caches evict old keys; Orthros cannot, because each output
token reads the whole cache. Besides K/V the cache keeps, per slot, the
document id of the token (padding = -1) and, per row, the next RoPE
position and the current document id.
"""

from __future__ import annotations

import torch


class OrthrosCache:
    def __init__(self, num_layers: int):
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
        """Append k, v [B, T, Hkv, D]; return the layer's whole cache [B, S, Hkv, D]."""
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
