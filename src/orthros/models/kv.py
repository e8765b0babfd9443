"""The cache contract: what a layer asks of any KV cache.

A cache owns its storage and its row state; per layer it takes the new base tokens' K/V and
answers with a description of what attention reads (`ops.kv`: `DenseKV`, `PagedKV`,
`LowBitKV`, `ShardedKV`). It never picks a kernel: `ops.attend` does, from that description.

    OrthrosCache        growing dense K/V (transformers' generate(), cropping)   -> DenseKV
    StaticOrthrosCache  preallocated bf16 / fp8, capturable decode steps         -> DenseKV
    LowBitStaticCache   bf16 window + sinks, int4 / int2 beyond                  -> LowBitKV
    PagedStepCache      one forward over a serving engine's block pool           -> PagedKV
                        (over a low-bit pool, `PagedLowBitPool`)                 -> PagedLowBitKV
    ShardedCache        this rank's shard of a context-parallel cache            -> ShardedKV
"""

from __future__ import annotations

from typing import Protocol, Union, runtime_checkable

import torch

from ..ops.kv import DenseKV, LowBitKV, PagedKV, PagedLowBitKV, ShardedKV

KVRead = Union[DenseKV, PagedKV, LowBitKV, PagedLowBitKV, ShardedKV]


@runtime_checkable
class KVCache(Protocol):
    """Storage for every layer's K/V, written by the base stream and read by both streams.

    reference_reads: whether attention over it may run the reference op that also returns the
    probabilities (`output_attentions`): dense K/V on one key axis, nothing captured."""

    reference_reads: bool

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Slots already held before this forward (the key axis' offset of the new tokens)."""

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> KVRead:
        """Store the new base tokens' k, v [B, T, Hkv, D] of layer `layer_idx`; return what that
        layer's queries read (the past and the new tokens)."""
