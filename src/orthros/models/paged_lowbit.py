"""A block pool in the low-bit format of `LowBitStaticCache` (int4 / int2 / k4v2), for a serving engine.

Every block holds its slots packed (`ops/lowbit/format.py`: keys per channel over key groups of
`key_group` slots, values per token over groups of `value_group` channels, both after the Hadamard
rotation; fp16 scales and zeros), a key group inside one block (block_size % key_group == 0). What a
sequence still reads in bf16, the sink slots of its block 0 and the slots from its bound on (the
base stream's window and the last `recent + key_group` slots or fewer, `ops.lowbit.format.packed_bound`), is kept in
bf16 **twin blocks**: a second, small pool of `num_twins` blocks; `twin_map` [num_blocks] says which
twin holds a block's bf16 copy (-1: none). Which blocks keep a twin is the engine's bookkeeping
(`serve.kv_twins`); a twin outlives its need while it is not wanted for another block, so that a
prefix-cache hit finds the bf16 tail of the prefix.

Writes, one forward (`PagedStepCache` calls `write`; tensor indices only, so a decode step is capturable):
    every new token's K, V (rounded to bf16) into its block's twin; its value quantized into its
    packed slot (per token: the same bits whenever it is written);
    each key group the forward completes quantized from the twin (the engine's plan); a captured
    decode step has no plan: it quantizes the group of each row's token every step (the group is
    complete, and stored for good, on the step of its last slot; before that nothing reads it).

The stored bits equal `LowBitStaticCache`'s for the same sequence, so a request served from this pool
reads what `generate(kv_dtype=...)` reads, whatever blocks and chunks it was written through.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.kv import PagedChunk, PagedKV, PagedLowBitKV, PagedRows
from ..ops.lowbit import BITS, quantize_keys, quantize_values, rotate, rotation_matrix
from .lowbit_cache import KEY_GROUP, VALUE_GROUP, bf16_sinks, high_dtype, layer_key_bits


def check_lowbit_pool(config, kv_dtype: str, block_size: int, key_group: int = KEY_GROUP) -> None:
    """ValueError unless this model and block size can use a low-bit pool."""
    if kv_dtype not in BITS:
        raise ValueError(f"a low-bit KV pool's kv_dtype is one of {tuple(BITS)}, got {kv_dtype!r}")
    if config.attention != "orthros":
        raise ValueError(f"--kv-dtype {kv_dtype} needs an Orthros model (attention='orthros': its base stream reads "
                         f"only a bf16 window); this model's attention is {config.attention!r}: use bf16 or fp8")
    if block_size % key_group:
        raise ValueError(f"--kv-dtype {kv_dtype} stores key groups of {key_group} slots inside a block: the block "
                         f"size must be a multiple of {key_group}, got {block_size}")
    if getattr(config, "sink_tokens", 0) > block_size:
        raise ValueError(f"--kv-dtype {kv_dtype} keeps the attention sinks in a sequence's first block: the block "
                         f"size must be at least sink_tokens={config.sink_tokens}, got {block_size}")
    D = config.head_dim
    bits = min(min(layer_key_bits(config, kv_dtype)), BITS[kv_dtype][1])
    if D % (8 // bits) or D % min(VALUE_GROUP, D):
        raise ValueError(f"--kv-dtype {kv_dtype}: head_dim {D} must be a multiple of {8 // bits} and of the value "
                         f"group {min(VALUE_GROUP, D)}")


def lowbit_bytes_per_token(config, kv_dtype: str, key_group: int = KEY_GROUP, value_group: int = VALUE_GROUP) -> float:
    """Bytes one token takes in the packed pool over all layers: K and V packed, the key groups'
    fp16 scale and zero (a share), the value groups'."""
    Hkv, D = config.num_key_value_heads, config.head_dim
    vb, NG = BITS[kv_dtype][1], D // min(value_group, D)
    per_layer = [D * kb / 8 + D * vb / 8 + 4 * D / key_group + 4 * NG for kb in layer_key_bits(config, kv_dtype)]
    return Hkv * sum(per_layer)


def twin_bytes_per_block(config, model_dtype: torch.dtype, block_size: int) -> int:
    """Bytes of one bf16 twin block over all layers."""
    item = torch.empty(0, dtype=high_dtype(model_dtype)).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * item


@dataclass
class LowBitPlan:
    """One forward's write and read addresses in a low-bit pool (made at its first layer)."""

    twin_slots: torch.Tensor  # [T] twin slot of every new token
    group_slots: torch.Tensor  # [G, key_group] pool slots of the key groups to quantize
    group_twins: torch.Tensor  # [G, key_group] their twin slots
    group_valid: torch.Tensor  # [G, key_group] bool: not a sink slot
    window: PagedKV  # the base rows' reads, over the twins (k / v set per layer)
    out_twins: torch.Tensor  # [R, max_blocks] twin blocks of the output rows' blocks


class PagedLowBitPool:
    """Packed blocks and bf16 twin blocks for every layer (see the module docstring)."""

    def __init__(self, config, num_blocks: int, block_size: int, device, dtype: torch.dtype, kv_dtype: str,
                 num_twins: int, rotate: bool = True):
        check_lowbit_pool(config, kv_dtype, block_size)
        if num_blocks < 1 or num_twins < 1:
            raise ValueError(f"num_blocks and num_twins must be >= 1, got {num_blocks}, {num_twins}")
        L, Hkv, D = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        kg, VG = KEY_GROUP, min(VALUE_GROUP, D)
        self.num_layers, self.num_blocks, self.block_size, self.num_twins = L, num_blocks, block_size, num_twins
        self.device, self.dtype = torch.device(device), dtype
        self.kv_dtype = self.storage = kv_dtype
        self.fp8 = False
        self.layer_key_bits = layer_key_bits(config, kv_dtype)
        self.value_bits = BITS[kv_dtype][1]
        # bf16 sink slots in block 0's twin, as `LowBitStaticCache` keeps them; the base rows read those
        self.key_group, self.value_group, self.sinks, self.recent = kg, VG, bf16_sinks(config), config.window_size
        self.rotated = rotate
        self.rotation = rotation_matrix(D, device) if rotate else None
        self.hi = high_dtype(dtype)
        n, t = num_blocks * block_size, num_twins * block_size

        def zeros(*shape, dt):  # zeros, not empty: slots never written must not hold NaN bit patterns
            return [torch.zeros(*shape, device=device, dtype=dt) for _ in range(L)]

        self.kq = [torch.zeros(n, Hkv, D * b // 8, device=device, dtype=torch.uint8) for b in self.layer_key_bits]
        self.vq = zeros(n, Hkv, D * self.value_bits // 8, dt=torch.uint8)
        self.k_scale, self.k_zero = zeros(n // kg, Hkv, D, dt=torch.float16), zeros(n // kg, Hkv, D, dt=torch.float16)
        self.v_scale, self.v_zero = zeros(n, Hkv, D // VG, dt=torch.float16), zeros(n, Hkv, D // VG, dt=torch.float16)
        self.tk, self.tv = zeros(t, Hkv, D, dt=self.hi), zeros(t, Hkv, D, dt=self.hi)
        self.twin_map = torch.full((num_blocks,), -1, device=device, dtype=torch.int32)
        self.compiled_chunks: frozenset[int] | None = None  # as `PagedKVPool`'s (the window's chunks)

    @property
    def memory_bytes(self) -> int:
        parts = (self.kq, self.vq, self.k_scale, self.k_zero, self.v_scale, self.v_zero, self.tk, self.tv)
        return sum(t.numel() * t.element_size() for p in parts for t in p)

    def set_twins(self, blocks: list[int], twins: list[int]) -> None:
        """twin_map[blocks] := twins (the engine's bookkeeping changed them)."""
        if blocks:
            idx = torch.tensor(blocks, dtype=torch.long)
            self.twin_map.index_copy_(0, idx.to(self.device), torch.tensor(twins, dtype=torch.int32).to(self.device))

    # ------------------------------------------------------------------ one forward
    def twin_slots(self, slots: torch.Tensor) -> torch.Tensor:
        bs = self.block_size
        return self.twin_map[slots // bs].long() * bs + slots % bs

    def plan(self, cache, groups: tuple[torch.Tensor, torch.Tensor] | None) -> LowBitPlan:
        """The addresses of one forward through `cache` (a `PagedStepCache`); groups: (pool slot, position)
        [G] of the first slot of each key group the forward completes, or None (a captured decode step:
        each row's current group). Device ops only."""
        bs, kg = self.block_size, self.key_group
        dev = self.twin_map.device
        if groups is None:  # one token a row, rows = the output rows
            rows = cache._out_single
            gp = rows.pos // kg * kg
            gs = rows.table.long().gather(1, (gp // bs)[:, None])[:, 0] * bs + gp % bs
        else:
            gs, gp = groups
        ar = torch.arange(kg, device=dev)
        gslots = gs[:, None] + ar
        twin_table = lambda t: self.twin_map[t.long()]  # noqa: E731
        single = lambda r: PagedRows(r.rows, twin_table(r.table), r.pos, r.max_len)  # noqa: E731
        chunks = [PagedChunk(c.r0, c.r1, c.dense_start, self.twin_slots(c.slots), c.q_slot, c.q_doc, c.k_doc)
                  for c in cache._dense]
        window = PagedKV(self.tk[0], self.tv[0], bs, single(cache._base_single), single(cache._out_single), chunks,
                         self.compiled_chunks, sinks=cache.sinks)
        return LowBitPlan(self.twin_slots(cache.slots), gslots, self.twin_slots(gslots),
                          (gp[:, None] + ar) >= self.sinks, window, twin_table(cache._out_single.table))

    def write(self, layer: int, plan: LowBitPlan, out: PagedRows, k: torch.Tensor, v: torch.Tensor,
              slots: torch.Tensor) -> PagedLowBitKV:
        """Store the new tokens' k, v [T, Hkv, D] at pool slots [T] (see the module docstring); describe
        what this forward's rows read of layer `layer`."""
        hk, hv = k.to(self.hi), v.to(self.hi)
        tk, tv = self.tk[layer], self.tv[layer]
        tk.index_copy_(0, plan.twin_slots, hk)
        tv.index_copy_(0, plan.twin_slots, hv)
        pv, s, z = quantize_values(self._rot(hv), self.value_bits, self.value_group)
        self.vq[layer].index_copy_(0, slots, pv)
        self.v_scale[layer].index_copy_(0, slots, s)
        self.v_zero[layer].index_copy_(0, slots, z)
        G, kg = plan.group_slots.shape
        if G:
            kb = self.layer_key_bits[layer]
            src = tk[plan.group_twins.flatten()].unflatten(0, (G, kg))  # [G, kg, Hkv, D]
            pk, s, z = quantize_keys(self._rot(src), kb, kg, plan.group_valid)
            self.kq[layer].index_copy_(0, plan.group_slots.flatten(), pk.flatten(0, 1))
            gid = plan.group_slots[:, 0] // kg
            self.k_scale[layer].index_copy_(0, gid, s[:, 0])
            self.k_zero[layer].index_copy_(0, gid, z[:, 0])
        w = plan.window
        window = PagedKV(tk, tv, w.block_size, w.base, w.out, w.chunks, w.compiled_chunks, sinks=w.sinks)
        return PagedLowBitKV(window, out, plan.out_twins, self.kq[layer], self.vq[layer], self.k_scale[layer],
                             self.k_zero[layer], self.v_scale[layer], self.v_zero[layer], self.layer_key_bits[layer],
                             self.value_bits, self.key_group, self.sinks, self.recent, self.rotation)

    def _rot(self, x: torch.Tensor) -> torch.Tensor:
        return rotate(x) if self.rotated else x
