"""A preallocated Orthros KV cache for fast generation (bf16 or fp8 e4m3).

`OrthrosCache` grows by concatenation: every decode step copies the whole
cache and changes every shape, so it can never be captured in a CUDA graph.
`StaticOrthrosCache` allocates every layer's K/V once, [B, S_max, Hkv, D],
and writes new slots in place:

    prefill (eager, through the model's own forward): a chunk of T tokens
        goes to slots [n, n + T); attention reads the filled prefix.
    decode (capturable): one token per row goes to the slot held in the
        tensor `slot`; attention reads the whole buffer, and the kernels
        clip to the keys each query can see, so the work is the filled
        length, not S_max. No host sync anywhere in the step.

fp8 (`kv_dtype="fp8"`): K and V are stored as float8 e4m3 with one scale per
(layer, KV head), taken from the absmax of the first chunk written
(× `FP8_MARGIN`, rounded up to a power of two; later values saturate at
±448). Attention (`ops.attend`, given the scales by `write`) never
materialises a dequantized cache: the K scale is folded into the queries
(q·(s k̂) = (s q)·k̂ per head), the V scale into the output, and the kernel
reads the fp8 values directly (the split-KV kernel casts on load).
Halves the cache: 1M tokens of an 8B model take 64 GiB instead of 128.

int4 / int2 (`kv_dtype="int4"|"int2"|"k4v2"`) is another class, `LowBitStaticCache`
(models/lowbit_cache.py): bf16 for the window and a few sinks, low-bit beyond.
"""

from __future__ import annotations

import torch
from transformers import Cache

from ..ops.attend import decode_attention  # noqa: F401  (its older import path)
from ..ops.kv import DenseKV
from ..ops.masks import PAD_DOC
from .cache import OrthrosCache

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_MARGIN = 2.0  # headroom over the first chunk's absmax for later tokens (then rounded up to 2^k)
KV_DTYPES = ("auto", "bf16", "fp16", "fp32", "fp8", "int4", "int2", "k4v2")
LOWBIT_KV_DTYPES = ("int4", "int2", "k4v2")  # LowBitStaticCache (k4v2: int4 keys, int2 values)


def kv_storage_dtype(kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element dtype of a cache that stores every slot alike (not int4 / int2)."""
    if kv_dtype in LOWBIT_KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r} is the fast path's low-bit cache (generate, orthros bench "
                         "decode / e2e); this cache takes one of auto, bf16, fp16, fp32, fp8")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    return {"auto": model_dtype, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
            "fp8": FP8}[kv_dtype]


class StaticOrthrosCache(OrthrosCache):
    """Fixed-capacity cache: K/V [B, capacity, Hkv, D] per layer, written in place."""

    is_compileable = True
    reference_reads = False  # its reads run kernels (fp8, captured decode steps)

    def __init__(self, config, batch_size: int, capacity: int, device, dtype: torch.dtype,
                 kv_dtype: str = "auto"):
        Cache.__init__(self, layers=[])
        if capacity < 1 or batch_size < 1:
            raise ValueError(f"batch_size and capacity must be >= 1, got {batch_size}, {capacity}")
        L, Hkv, D = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        self.num_layers, self.capacity = L, capacity
        self.storage = kv_storage_dtype(kv_dtype, dtype)
        self.fp8 = self.storage == FP8
        # zeros, not empty: unread slots must never hold NaN bit patterns
        self.k = [torch.zeros(batch_size, capacity, Hkv, D, device=device, dtype=self.storage) for _ in range(L)]
        self.v = [torch.zeros(batch_size, capacity, Hkv, D, device=device, dtype=self.storage) for _ in range(L)]
        self.k_scale = torch.ones(L, Hkv, device=device, dtype=torch.float32)
        self.v_scale = torch.ones(L, Hkv, device=device, dtype=torch.float32)
        self._scaled = [False] * L
        self.doc = torch.full((batch_size, capacity), PAD_DOC, device=device, dtype=torch.long)
        self.slot = torch.zeros(1, device=device, dtype=torch.long)  # the decode step's slot
        self.next_pos = torch.zeros(batch_size, device=device, dtype=torch.long)
        self.last_doc = torch.full((batch_size,), -1, device=device, dtype=torch.long)
        self.length = 0  # slots filled (host-side count, no sync needed)
        self.decoding = False  # set by the decode step: one token per row at `slot`
        self._start = 0

    # ---------------------------------------------------------------- state
    def buffers(self) -> list[torch.Tensor]:
        """Every tensor a captured decode step reads or writes (static addresses)."""
        return [*self.k, *self.v, self.k_scale, self.v_scale, self.doc, self.slot, self.next_pos, self.last_doc]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    @property
    def key_doc(self):
        return None if self.length == 0 else self.doc[:, : self.length]

    @key_doc.setter
    def key_doc(self, value):
        if value is not None:
            raise AttributeError("StaticOrthrosCache.key_doc is a view of its buffer")

    @property
    def batch_size(self) -> int:
        return self.doc.shape[0]

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.capacity

    def append_tokens(self, doc: torch.Tensor, next_pos: torch.Tensor, last_doc: torch.Tensor,
                      pos: torch.Tensor | None = None) -> None:
        """Prefill: record a chunk's documents [B, T]; the layers' `update` then fill the same slots.
        (Per-slot positions are not kept: this cache is never cropped.)"""
        T = doc.shape[1]
        if self.length + T > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} slots; {self.length} are filled and {T} more "
                             "were given (allocate a larger capacity)")
        self._start = self.length
        self.doc[:, self.length: self.length + T] = doc
        self.length += T
        self.slot.fill_(self.length)
        self.next_pos.copy_(next_pos)
        self.last_doc.copy_(last_doc)

    def advance(self) -> None:
        """After a decode step: the token at `slot` is in; move to the next slot (no sync)."""
        self.length += 1
        self.slot.add_(1)
        self.next_pos.add_(1)

    # ----------------------------------------------------------- K/V storage
    def _quantize(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        if not self.fp8:
            return k.to(self.storage), v.to(self.storage)
        if not self._scaled[layer_idx]:  # first write (prefill): one host-side decision per layer
            for s, x in ((self.k_scale, k), (self.v_scale, v)):
                amax = x.detach().abs().float().amax(dim=(0, 1, 3))
                # a power of two: exact when folded into bf16 queries / outputs
                s[layer_idx] = torch.exp2(torch.ceil(torch.log2((amax * FP8_MARGIN / FP8_MAX).clamp_min(2.0**-60))))
            self._scaled[layer_idx] = True
        ks = self.k_scale[layer_idx][:, None]
        vs = self.v_scale[layer_idx][:, None]
        kq = (k.float() / ks).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        vq = (v.float() / vs).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return kq, vq

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [B, T, Hkv, D]; return what attention reads: the filled prefix
        (prefill) or the whole buffer (decode), in the storage dtype."""
        kq, vq = self._quantize(layer_idx, k, v)
        kb, vb = self.k[layer_idx], self.v[layer_idx]
        if self.decoding:
            if self.fp8 and not torch.compiler.is_compiling():  # eager index_copy_ has no fp8 kernels: copy bytes
                # (Compiled, the byte view would make inductor copy the whole buffer every step:
                # it writes fp8 itself, in place.)
                kb.view(torch.uint8).index_copy_(1, self.slot, kq.view(torch.uint8))
                vb.view(torch.uint8).index_copy_(1, self.slot, vq.view(torch.uint8))
            else:
                kb.index_copy_(1, self.slot, kq)
                vb.index_copy_(1, self.slot, vq)
            return kb, vb
        a, T = self._start, k.shape[1]
        kb[:, a: a + T] = kq
        vb[:, a: a + T] = vq
        return kb[:, : self.length], vb[:, : self.length]

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> DenseKV:
        """Write k, v [B, T, Hkv, D]; describe what attention reads (fp8: with the layer's scales; a
        decode step: the whole buffer, read by one capturable op)."""
        kb, vb = self.update(layer_idx, k, v)
        scales = (self.k_scale[layer_idx], self.v_scale[layer_idx]) if self.fp8 else (None, None)
        return DenseKV(kb, vb, *scales, capturable=self.decoding)

    @property
    def is_initialized(self) -> bool:
        return self.length > 0

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.num_layers  # nothing is ever evicted

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.length + query_length, 0

    # --------------------------------------------------------- unsupported
    def select_rows(self, index: torch.Tensor) -> None:
        raise NotImplementedError("StaticOrthrosCache keeps its rows (finished rows are masked instead)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.select_rows(torch.arange(self.batch_size))

    @property
    def is_croppable(self) -> bool:
        return False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise NotImplementedError("StaticOrthrosCache cannot be cropped (use an OrthrosCache: model.new_cache())")

    def reset(self) -> None:
        self.length, self._start, self.decoding = 0, 0, False
        self._scaled = [False] * self.num_layers
        self.doc.fill_(PAD_DOC)
        self.slot.zero_()
        self.next_pos.zero_()
        self.last_doc.fill_(-1)

    def __repr__(self) -> str:
        return (f"StaticOrthrosCache(layers={self.num_layers}, batch={self.batch_size}, slots={self.length}/"
                f"{self.capacity}, storage={self.storage})")
