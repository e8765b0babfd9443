"""A preallocated Orthros KV cache with int4 / int2 storage beyond the window.

Orthros' base stream reads only the last W keys; only the output query reads
the whole past. So the cache keeps in bf16 only what the base stream can
see, plus a few sink tokens, and stores everything older in 4 or 2 bits
(`ops/lowbit.py`: keys per channel over groups of `key_group` slots, values
per token over groups of `value_group` channels, both after a Hadamard
rotation of the head's channels; fp16 scale and zero; rotate=False keeps the
unrotated layout, for studies).
kv_dtype "int4" and "int2" store keys and values alike; "k4v2" int4 keys and
int2 values (keys are what int2 costs in retrieval: docs/long_context.md).
`key_bits` sets the key bits per layer: on the real model one layer's int2
keys cost almost all of int2's copy-probe loss, so an int2 cache keeps the
keys of the layers in `config.kv_int4_key_layers` (chosen once per model by
`models.lowbit_calibrate`) in int4; each such layer adds 1 / num_layers bits per element.

    slot j of a row with L slots filled, bound = max(0, (L - recent) // key_group * key_group):
        j < sinks            bf16 sink buffer  [B, sinks, Hkv, D]
        sinks <= j < bound   packed int4 / int2 + scales (every layer, the whole capacity)
        bound <= j < L       bf16 ring of the last `ring` slots, at j % ring

`bound` is a multiple of `key_group`, so a key group is quantized only when
all its slots are in; between `recent` and `recent + key_group - 1` slots
stay bf16 (`recent` >= W: the base stream never reads a quantized key).

Writes (both from the bf16-rounded K/V, so the stored cache depends only on
the sequence, not on how it was chunked):
    prefill  a chunk's values are quantized as they arrive; the key groups
             that the chunk pushes below `bound` are quantized from the ring
             and the chunk; then the chunk's last slots go to the ring.
    decode   (capturable, no host sync) the token goes to the ring (and the
             sinks) and its value is quantized; on the step where `bound`
             moves, the key group just below it is quantized from the ring
             (recent + 2 key_group slots: it still holds that group). One
             Triton launch a layer on CUDA (`ops/lowbit/write.py`, the same
             bits as the PyTorch ops); the PyTorch form (elsewhere) has no
             branch and quantizes that group again every step, the same bits
             each time.

Reads: the base stream gets its window in bf16 (prefill: ring + chunk;
decode: the ring); the output queries read all three parts through the
split-KV kernel (`ops/splitkv/lowbit.py`, dequantizing on the fly) on CUDA, or
the reference (dequantize the whole prefix, then `ops.attention`) elsewhere.
"""

from __future__ import annotations

import torch
from transformers import Cache

from ..ops.attend import lowbit_decode_attention  # noqa: F401  (its older import path)
from ..ops.kv import DenseKV, LowBitKV
from ..ops.lowbit import BITS, dense_kv, quantize_keys, quantize_values, rotate, rotation_matrix
from ..ops.lowbit.format import packed_bound
from ..ops.lowbit.write import decode_write, write_kernel_applies
from ..ops.masks import PAD_DOC
from .static_cache import StaticOrthrosCache

KEY_GROUP = 64  # slots per key (scale, zero) group
VALUE_GROUP = 64  # channels per value (scale, zero) group (the head size if smaller)
SINKS = 4  # first slots kept in bf16


def bf16_sinks(config, sinks: int = SINKS) -> int:
    """The first slots a low-bit cache or pool keeps in bf16: `sinks`, or the model's attention sinks
    (`sink_tokens`, which the base stream reads there) if more."""
    return max(sinks, getattr(config, "sink_tokens", 0))


def high_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the sink and recent slots: the model's if 16-bit, else bf16."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


class LowBitStaticCache(StaticOrthrosCache):
    """Fixed-capacity Orthros cache, int4 / int2 beyond the window (see the module docstring)."""

    is_compileable = True

    def __init__(self, config, batch_size: int, capacity: int, device, dtype: torch.dtype, kv_dtype: str = "int4",
                 key_group: int = KEY_GROUP, value_group: int = VALUE_GROUP, sinks: int = SINKS,
                 recent: int | None = None, rotate: bool = True, key_bits=None):
        Cache.__init__(self, layers=[])
        if kv_dtype not in BITS:
            raise ValueError(f"a low-bit cache's kv_dtype is one of {tuple(BITS)}, got {kv_dtype!r}")
        if config.attention != "orthros":
            raise ValueError(f"kv_dtype={kv_dtype!r} needs attention='orthros' (the base stream reads only its "
                             f"window); this model's attention is {config.attention!r}: use bf16 or fp8")
        if capacity < 1 or batch_size < 1:
            raise ValueError(f"batch_size and capacity must be >= 1, got {batch_size}, {capacity}")
        L, Hkv, D = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        kb, vb = BITS[kv_dtype]
        self.layer_key_bits = layer_key_bits(config, kv_dtype, key_bits)
        value_group = min(value_group, D)
        recent = config.window_size if recent is None else recent
        kmin = min(self.layer_key_bits)
        if D % (8 // min(kmin, vb)) or D % value_group:
            raise ValueError(f"{kv_dtype} packs {8 // min(kmin, vb)} channels a byte in value groups of {value_group}: "
                             f"head_dim {D} must be a multiple of both")
        if key_group < 1 or sinks < 0 or recent < config.window_size:
            raise ValueError(f"key_group must be >= 1, sinks >= 0 and recent >= the window ({config.window_size}); "
                             f"got {key_group}, {sinks}, {recent}")
        # the model's attention sinks (`sink_tokens`) are read by the base stream from the bf16 sinks
        self.attn_sinks = getattr(config, "sink_tokens", 0)
        sinks = bf16_sinks(config, sinks)
        # key_bits: the kv_dtype's (every layer unless `layer_key_bits` says otherwise)
        self.kv_dtype, self.key_bits, self.value_bits = kv_dtype, kb, vb
        self.key_group, self.value_group, self.sinks, self.recent = key_group, value_group, sinks, recent
        self.rotated = rotate
        # R for the kernel (the reference and the writes use `ops.lowbit.rotate`)
        self.rotation = rotation_matrix(D, device) if rotate else None
        self.ring = recent + 2 * key_group
        self.num_layers, self.capacity = L, capacity
        self.window = config.window_size
        self.hi = high_dtype(dtype)
        self.storage = torch.uint8
        self.fp8 = False
        C = -(-capacity // key_group) * key_group  # whole key groups
        B = batch_size

        def zeros(*shape, dt=torch.uint8):  # zeros, not empty: unread slots never hold NaN bit patterns
            return [torch.zeros(*shape, device=device, dtype=dt) for _ in range(L)]

        self.kq = [torch.zeros(B, C, Hkv, D * b // 8, device=device, dtype=torch.uint8) for b in self.layer_key_bits]
        self.vq = zeros(B, C, Hkv, D * vb // 8)
        self.k_scale, self.k_zero = zeros(B, C // key_group, Hkv, D, dt=torch.float16), \
            zeros(B, C // key_group, Hkv, D, dt=torch.float16)
        # value scales / zeros [B, C, Hkv, D / value_group], stored head-major (a view of [B, Hkv, C, ...]):
        # a KV head's slots are contiguous, so a kernel reading one head streams whole sectors (slot-major,
        # a head's 4 bytes a slot took a 32-byte sector each through L2)
        # (the decode step writes and passes the head-major buffers themselves, `_v_head_major`: under
        # torch.compile a write through the transposed view, or the view handed to an op, copies the whole buffer)
        self._v_head_major = [zeros(B, Hkv, C, D // value_group, dt=torch.float16) for _ in range(2)]
        self.v_scale, self.v_zero = ([x.transpose(1, 2) for x in hm] for hm in self._v_head_major)
        self.rk, self.rv = zeros(B, self.ring, Hkv, D, dt=self.hi), zeros(B, self.ring, Hkv, D, dt=self.hi)
        self.sk, self.sv = zeros(B, sinks, Hkv, D, dt=self.hi), zeros(B, sinks, Hkv, D, dt=self.hi)
        self.doc = torch.full((B, capacity), PAD_DOC, device=device, dtype=torch.long)
        self.slot = torch.zeros(1, device=device, dtype=torch.long)
        self.next_pos = torch.zeros(B, device=device, dtype=torch.long)
        self.last_doc = torch.full((B,), -1, device=device, dtype=torch.long)
        self.length = 0
        self.decoding = False
        self._start = 0
        self._scaled = [True] * L  # no per-layer scale decision (the parent's fp8 state)
        self._win_start = 0
        self._hi = (0, None, None)

    # ---------------------------------------------------------------- state
    def buffers(self) -> list[torch.Tensor]:
        vs, vz = self._v_head_major
        return [*self.kq, *self.vq, *self.k_scale, *self.k_zero, *vs, *vz, *self.rk, *self.rv,
                *self.sk, *self.sv, self.doc, self.slot, self.next_pos, self.last_doc]

    def layer(self, i: int) -> tuple[torch.Tensor, ...]:
        """Layer i's storage in the order the attention ops take it: (sk, sv, kq, vq, k_scale,
        k_zero, v_scale, v_zero, rk, rv)."""
        return (self.sk[i], self.sv[i], self.kq[i], self.vq[i], self.k_scale[i], self.k_zero[i],
                self.v_scale[i], self.v_zero[i], self.rk[i], self.rv[i])

    def bound_at(self, length):
        """First slot kept in bf16 when `length` slots are filled (an int, or a tensor: no sync)."""
        return packed_bound(length, self.recent, self.key_group)

    @property
    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers()[: 10 * self.num_layers])

    def slot_bytes(self) -> float:
        """Bytes of K + V one quantized slot takes per layer and row (scales included; the
        mean over the layers)."""
        slots = self.kq[0].shape[0] * self.kq[0].shape[1] * self.num_layers
        return sum(x.numel() * x.element_size() for i in range(self.num_layers) for x in self.layer(i)[2:8]) / slots

    def append_tokens(self, doc, next_pos, last_doc, pos=None) -> None:
        if self.attn_sinks and self.length == 0 and bool((doc[:, 0] == PAD_DOC).any()):
            from ..errors import Unsupported

            raise Unsupported(f"LowBitStaticCache keeps attention sinks (sink_tokens={self.attn_sinks}) for rows that "
                              "start at the first slot: this batch is left-padded (generate its rows one at a time, "
                              "or without a low-bit kv_dtype)")
        super().append_tokens(doc, next_pos, last_doc, pos)

    # ----------------------------------------------------------- K/V storage
    def _ring_slots(self, a: int, b: int) -> torch.Tensor:
        return torch.arange(a, b, device=self.doc.device) % self.ring

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [B, T, Hkv, D]; return the base stream's bf16 keys: the window before
        the chunk and the chunk itself (prefill), the ring (decode)."""
        hk, hv = k.to(self.hi), v.to(self.hi)
        if self.decoding:
            self._decode_write(layer_idx, hk, hv)
            return self.rk[layer_idx], self.rv[layer_idx]
        a, T = self._start, k.shape[1]
        end = a + T
        rk, rv = self.rk[layer_idx], self.rv[layer_idx]
        # The base stream's keys, read from the ring before the chunk overwrites it.
        w0 = max(0, a - self.window + 1)
        old = self._ring_slots(w0, a)
        win_k, win_v = torch.cat([rk[:, old], hk], 1), torch.cat([rv[:, old], hv], 1)
        self._win_start = w0
        if a < self.sinks:
            n = min(self.sinks, end) - a
            self.sk[layer_idx][:, a: a + n] = hk[:, :n]
            self.sv[layer_idx][:, a: a + n] = hv[:, :n]
        pv, s, z = quantize_values(self._rot(hv), self.value_bits, self.value_group)
        self.vq[layer_idx][:, a:end], self.v_scale[layer_idx][:, a:end], self.v_zero[layer_idx][:, a:end] = pv, s, z
        b0, b1 = self.bound_at(a), self.bound_at(end)
        old = self._ring_slots(b0, a)
        # bf16 of slots [b0, end): what a query of this chunk at slot t < end reads at and above
        # bound(t + 1) >= b0 (kept for `attend`, one layer at a time)
        self._hi = (b0, torch.cat([rk[:, old], hk], 1), torch.cat([rv[:, old], hv], 1))
        if b1 > b0:  # whole key groups pushed out of the bf16 part by this chunk
            self._write_key_groups(layer_idx, self._hi[1][:, : b1 - b0], b0)
        n = min(T, self.ring)
        rs = self._ring_slots(end - n, end)
        rk[:, rs], rv[:, rs] = hk[:, T - n:], hv[:, T - n:]
        return win_k, win_v

    def _rot(self, x: torch.Tensor) -> torch.Tensor:
        """What gets quantized: x times R (fp32), or x itself with rotate=False."""
        return rotate(x) if self.rotated else x

    def _write_key_groups(self, layer_idx: int, src: torch.Tensor, first: int):
        """Quantize whole key groups src [B, n * key_group, Hkv, D] starting at slot `first`; sink
        slots do not count in a group's range."""
        g, n = self.key_group, src.shape[1]
        pk, s, z = quantize_key_groups(src, torch.arange(first, first + n, device=src.device), self.sinks,
                                       self.layer_key_bits[layer_idx], g, self.rotated)
        self.kq[layer_idx][:, first: first + n] = pk
        self.k_scale[layer_idx][:, first // g: (first + n) // g] = s
        self.k_zero[layer_idx][:, first // g: (first + n) // g] = z

    def _decode_write(self, layer_idx: int, hk: torch.Tensor, hv: torch.Tensor) -> None:
        """One token per row at `slot` (tensor indices only: capturable): one Triton launch on CUDA
        (`ops/lowbit/write.py`), PyTorch ops elsewhere; the same bits either way."""
        i = layer_idx
        vs, vz = (x[i] for x in self._v_head_major)
        lowbit_decode_write(hk, hv, self.rk[i], self.rv[i], self.sk[i], self.sv[i], self.kq[i], self.vq[i],
                            self.k_scale[i], self.k_zero[i], vs, vz, self.slot, self.recent, self.key_group,
                            self.layer_key_bits[i], self.value_bits, self.rotated,
                            write_kernel_applies(hv, self.value_group, self.key_group))

    # ---------------------------------------------------------------- reads
    def dense(self, layer_idx: int, length: int, bound) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, length, Hkv, D] (fp32) as the output stream reads them: dequantized below
        `bound`, bf16 sinks and recent slots (the reference; `bound` an int or a tensor)."""
        return dense_kv(*self.layer(layer_idx), bound, length, self.layer_key_bits[layer_idx], self.value_bits,
                        self.key_group, self.rotated)

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> LowBitKV:
        """Store k, v [B, T, Hkv, D]; describe what attention reads: windowed queries the bf16 window,
        the others the whole cache (low-bit below the bound). Decode: the whole capacity, read by one
        capturable op (value scales head-major, as stored)."""
        wk, wv = self.update(layer_idx, k, v)
        if self.decoding:
            return self.read(layer_idx)
        S = self.attn_sinks  # attention sinks below the window: read before it
        sinks = (self.sk[layer_idx][:, :S], self.sv[layer_idx][:, :S]) if S else ()
        return self.read(layer_idx, DenseKV.window(wk, wv, self._win_start, *sinks))

    def read(self, layer_idx: int, window: DenseKV | None = None) -> LowBitKV:
        """What attention reads of layer `layer_idx` as the cache stands (`write` gives a prefill
        chunk's base stream its `window`: the bf16 keys before the chunk and the chunk's own)."""
        i, kb = layer_idx, self.layer_key_bits[layer_idx]
        if self.decoding:
            vs, vz = (x[i] for x in self._v_head_major)
            return LowBitKV(self.sk[i], self.sv[i], self.kq[i], self.vq[i], self.k_scale[i], self.k_zero[i], vs, vz,
                            self.rk[i], self.rv[i], self.bound_at(self.slot + 1), self.capacity, kb, self.value_bits,
                            self.key_group, self.rotation, self.recent, capturable=True)
        bound = torch.full((1,), self.bound_at(self.length), device=self.doc.device, dtype=torch.long)
        return LowBitKV(*self.layer(i), bound, self.length, kb, self.value_bits, self.key_group, self.rotation,
                        self.recent, window=window, high=self._hi)

    def __repr__(self) -> str:
        return (f"LowBitStaticCache(layers={self.num_layers}, batch={self.batch_size}, slots={self.length}/"
                f"{self.capacity}, {self.kv_dtype}, key_group={self.key_group}, value_group={self.value_group}, "
                f"sinks={self.sinks}, recent={self.recent}, rotate={self.rotated}"
                + ("" if len(set(self.layer_key_bits)) == 1 else f", key_bits={self.layer_key_bits}") + ")")


def layer_key_bits(config, kv_dtype: str, key_bits=None) -> list[int]:
    """Key bits per layer: `key_bits` (an int, or one int per layer), else the kv_dtype's, with
    int2's keys in int4 in the layers of `config.kv_int4_key_layers` (if the model has one)."""
    L, kb = config.num_hidden_layers, BITS[kv_dtype][0]
    if key_bits is None:
        keep = (getattr(config, "kv_int4_key_layers", None) or ()) if kv_dtype == "int2" else ()
        key_bits = [4 if i in set(keep) else kb for i in range(L)]
    elif isinstance(key_bits, int):
        key_bits = [key_bits] * L
    key_bits = [int(b) for b in key_bits]
    if len(key_bits) != L or not set(key_bits) <= {2, 4}:
        raise ValueError(f"key_bits must be 2 or 4, one per layer ({L}), got {key_bits}")
    return key_bits


def quantize_key_groups(src, slots, sinks: int, bits: int, group: int, rotated: bool):
    """Whole key groups src [B, n * group, Hkv, D] at slots `slots` [n * group] -> (packed, scale, zero)
    (`ops.lowbit.quantize_keys`, after the rotation if the cache is rotated); sink slots do not count
    in a group's range."""
    valid = (slots >= sinks)[None].expand(src.shape[0], -1)
    return quantize_keys(rotate(src) if rotated else src, bits, group, valid)


@torch.library.custom_op("orthros::lowbit_decode_write",
                         mutates_args=("rk", "rv", "sk", "sv", "kq", "vq", "k_scale", "k_zero", "v_scale", "v_zero"))
def lowbit_decode_write(hk: torch.Tensor, hv: torch.Tensor, rk: torch.Tensor, rv: torch.Tensor, sk: torch.Tensor,
                        sv: torch.Tensor, kq: torch.Tensor, vq: torch.Tensor, k_scale: torch.Tensor,
                        k_zero: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor, slot: torch.Tensor,
                        recent: int, key_group: int, key_bits: int, value_bits: int, rotated: bool,
                        kernel: bool) -> None:
    """A decode step's write of one layer (`LowBitStaticCache._decode_write`; v_scale / v_zero
    head-major, [B, Hkv, C, NG]): the Triton kernel (`ops.lowbit.write.decode_write`), or PyTorch ops.
    Opaque to torch.compile (the ops' form compiled to a dozen kernels a layer), captured as is in
    CUDA graphs."""
    if kernel:
        decode_write(hk, hv, rk, rv, sk, sv, kq, vq, k_scale, k_zero, v_scale, v_zero, slot, recent, key_group,
                     key_bits, value_bits, rotated)
        return
    ring, sinks = rk.shape[1], sk.shape[1]
    r = slot % ring
    rk.index_copy_(1, r, hk)
    rv.index_copy_(1, r, hv)
    if sinks:
        i = slot.clamp_max(sinks - 1)
        keep = (slot < sinks).view(1, 1, 1, 1)
        for buf, x in ((sk, hk), (sv, hv)):
            buf.index_copy_(1, i, torch.where(keep, x, buf.index_select(1, i)))
    pv, s, z = quantize_values(rotate(hv) if rotated else hv, value_bits, hv.shape[-1] // v_scale.shape[-1])
    vq.index_copy_(1, slot, pv)
    v_scale.index_copy_(2, slot, s.transpose(1, 2))
    v_zero.index_copy_(2, slot, z.transpose(1, 2))
    # The key group just below the bound after this token, every step (no branch without a host sync:
    # the same group with the same bits for key_group steps; while bound is 0 a group nothing reads,
    # written again once it is complete).
    g = key_group
    first = (((slot + 1 - recent).clamp_min(0) // g) * g - g).clamp_min(0)
    slots = first + torch.arange(g, device=slot.device)
    pk, s, z = quantize_key_groups(rk.index_select(1, slots % ring), slots, sinks, key_bits, g, rotated)
    kq.index_copy_(1, slots, pk)
    k_scale.index_copy_(1, first // g, s)
    k_zero.index_copy_(1, first // g, z)
