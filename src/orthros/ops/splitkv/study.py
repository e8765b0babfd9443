"""Benchmark-only entry points of the split-KV op: the kernel variants kept for A/B studies and the
low-bit reader with every launch setting exposed. Production code never imports this module.

    from_environment()        the study switches of a benchmark run, from its environment:
                                  ORTHROS_LOWBIT_KERNEL=triton|gluon  what reads a low-bit cache's
                                      packed slots (default: Gluon wherever it applies)
                                  ORTHROS_FP8_DOTS=bf16|fp16          the dots over fp8 K/V
                              (`orthros bench` calls it; so do the scripts of benchmarks/).
    lowbit_splitkv_attention  the low-bit reader with its storage as separate tensors and its
                              loop variants and launch settings (`LOOPS`, `loop_options`).
"""

from __future__ import annotations

import os

import torch

from ..kv import LowBitKV
from .common import VARIANTS
from .lowbit import lowbit_attention_tuned

LOOPS = ("planar-f16", "planar-dq", "planar", "interleaved")  # the packed loops, as benchmarks name them


def from_environment(environ=None) -> None:
    """Set `common.VARIANTS` from ORTHROS_LOWBIT_KERNEL and ORTHROS_FP8_DOTS (unset: the defaults)."""
    env = os.environ if environ is None else environ
    packed = env.get("ORTHROS_LOWBIT_KERNEL", "").strip().lower()
    if packed not in ("", "gluon", "triton"):
        raise ValueError(f"ORTHROS_LOWBIT_KERNEL must be 'gluon' or 'triton' (or unset), got {packed!r}")
    dots = env.get("ORTHROS_FP8_DOTS", "fp16").strip().lower()
    if dots not in ("fp16", "bf16"):
        raise ValueError(f"ORTHROS_FP8_DOTS must be 'fp16' or 'bf16' (or unset), got {dots!r}")
    VARIANTS.lowbit_packed = packed if packed == "triton" else None
    VARIANTS.fp8_dots = dots


def loop_options(loop: str) -> dict:
    """A packed loop's name -> `lowbit_splitkv_attention` / `lowbit.launch_plan` keyword arguments:
    bit planes with keys and values dequantized in fp16 (planar-f16, the kernel's default), with
    the keys folded into q and the values dequantized in fp32 (planar-dq), with the value scales
    folded into p (planar), or the interleaving loop."""
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {LOOPS}, got {loop!r}")
    return dict(planar=None if loop.startswith("planar") else False,
                dequant_values=loop in ("planar-f16", "planar-dq"), fp16_dequant=loop == "planar-f16")


def lowbit_splitkv_attention(q, sk, sv, kq, vq, k_scale, k_zero, v_scale, v_zero, rk, rv, q_slot, q_doc, k_doc,
                             bound, length: int, key_bits: int, value_bits: int, key_group: int, window=None,
                             scale=None, window_rows: int | None = None, rotation: torch.Tensor | None = None,
                             num_splits=None, block_n: int = 64, num_warps: int | None = None,
                             num_stages: int | None = None, planar: bool | None = None,
                             dequant_values: bool | None = None, fp16_dequant: bool | None = None,
                             maxnreg: int | None = None, packed_kernel: str | None = None, sinks: int = 0):
    """Queries q [B, M, H, D] (G * M <= MAX_ROWS) over the first `length` slots of a low-bit
    cache layer (`LowBitStaticCache.layer`); q_slot / q_doc [B, M], k_doc [B, >= length],
    bound: [1] int64 tensor (first slot read from the ring); rotation: R [D, D] fp32 of a
    rotated cache (`LowBitStaticCache.rotation`), None for an unrotated one. Same contract
    as `naive_attention` over `ops.lowbit.dense_kv(..., rotated=rotation is not None)`:
    -> [B, M, H, D] in q's dtype. num_splits / block_n (keys per tile, a power of two >= 16;
    packed tiles are also at most the key group's power-of-two factor) / num_warps /
    num_stages / maxnreg (registers a thread, NVIDIA): launch tuning; planar: the bit-plane
    packed loop (None: wherever it applies; False: the interleaving one, for comparisons);
    dequant_values: in the bit-plane loop, values dequantized in registers and read with plain
    2-D dots (None: wherever the loop runs; the faster on an H200), or False: their scales
    folded into p with dots batched over the channel groups (for comparisons); fp16_dequant: in
    the dequantizing loop, keys and values dequantized in fp16 from levels made by packed-bit
    operations, the dots in fp16 (None: wherever that loop runs), or False: keys folded into q
    and values dequantized in fp32 (the loop before, for comparisons). packed_kernel: what reads the
    packed slots: "gluon" (`lowbit_gluon.py`; `lowbit.gluon_refusal` says where it cannot), "triton"
    (`lowbit_kernel.py`, with the loop variants above), or None: the Gluon kernel wherever it applies
    and no Triton loop variant is asked for (`lowbit.gluon_applies`). sinks: windowed rows' attention sinks."""
    kv = LowBitKV(sk, sv, kq, vq, k_scale, k_zero, v_scale, v_zero, rk, rv, bound, length, key_bits, value_bits,
                  key_group, rotation)
    return lowbit_attention_tuned(q, kv, q_slot, q_doc, k_doc, window, scale, window_rows, num_splits, block_n,
                                  num_warps, num_stages, planar, dequant_values, fp16_dequant, maxnreg, packed_kernel,
                                  sinks)
