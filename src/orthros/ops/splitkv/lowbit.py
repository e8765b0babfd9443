"""Split-KV attention over a low-bit cache: a few queries, int4 / int2 keys and values
read in their packed form (the layout of `ops/lowbit/format.py`, described to the op by `ops.kv.LowBitKV`).

The structure is `dense.py`'s: one program per (row, KV head, split),
the G * M queries of a KV head as the rows of one tile, an online softmax
over the split's keys (clipped to what the queries can see), the same
log-sum-exp merge. The split's keys are read in three loops, each clipped to
the split and each with plain loads of one part:

    [0, NS)          the bf16 sinks
    [NS, bound)      the packed storage (where the time goes at long context)
    [bound, end)     the bf16 ring, at j % R

A rotated cache (`ops/lowbit/format.py`: the packed slots hold K R and V R) reads
the packed keys with q R (computed once per call, before the launch) and
accumulates the packed values apart; the program writes both parts, and
after the merge the output is o_bf16 + o_packed R (R is its own inverse).

A windowed query's keys lie at or above `bound` (the cache keeps at least W
slots in bf16), so with every row windowed the packed loop is empty.

By default (`fp16_dequant`, the bit-plane loop's default) keys and values are
dequantized in fp16 registers: every bit plane's levels come from four bytes at
a time by inline PTX (`_levels` in `lowbit_kernel.py`: prmt + lop3 into fp16
lanes, one packed fp16 op per two levels), keys take their group's per-channel
scale / zero, values their token's, and both dots run in fp16 (queries past
2^14 scaled by a power of two). The packed part keeps a softmax state of its
own, merged with the bf16 part's at the end (a packed tile never rescales the
bf16 accumulator), and each tile's scales are loaded a tile ahead into
registers (2-byte loads are not copied asynchronously, so the loads were
waited on in every tile). On an H200 at 1M slots (Llama-3.1-8B shape), one
layer (int4 / int2): 1.71 / 1.63 ms before those two changes, 1.24 / 1.16 ms
after, and 1.10 / 1.04 ms with 168 registers a thread and three times the
splits (three programs an SM instead of two, two full waves): the default
there (`MAXNREG`). ncu of the 2-program build: 0.46 instructions issued a
cycle per scheduler, 1.96 warps each (0.59 eligible), limited by registers;
at three programs an SM the loop's 1,036 instructions a tile (168 registers)
would alone take ~0.52 ms a layer at one issue a cycle, so it is bound by
its per-tile work and its latency, not by bytes (docs/long_context.md).

The forms before it (fp16_dequant=False, for comparisons) never dequantize a
key, and dequantize the values in fp32 registers:

* keys (per channel d a scale s_d and zero z_d per key group): a tile lies
  inside one key group (BLOCK_Q divides `key_group`; the first tile of a
  range is masked below NS), so q.k = (q * s).n + q.z with n the levels: one
  [BLOCK_R, D] multiply and a [BLOCK_R] bias per tile.
* values (per token j and channel group g a scale and zero): dequantized
  (n * s_g + z_g, one bit plane at a time) and read with plain 2-D dots
  (`dequant_values`, the default); or, with `dequant_values=False`, never
  dequantized: the channel groups are the batch axis of the value dot (acc
  [NG, BLOCK_R, VG]), p.v = (p * s_g).n + p.z_g. The folded form does less
  arithmetic but keeps a 3-D accumulator live: on an H200 (Llama-3.1-8B
  shape, 1M slots, 64-key tiles) it spilled 912 / 476 B (int4 / int2) and
  took 2.44 / 4.43 ms a layer, the dequantizing one 496 / 100 B and 1.99 /
  2.05 ms (benchmarks/results/long_context/splitkv-sweep-1m-planar-dq.txt).
* each packed byte is loaded once ([BLOCK_Q, D / P] bytes) and its P levels
  are split with shifts and interleaved back into channel order.
* levels become dot operands without an int-to-float conversion (16 a
  clock per SM on sm_90, an eighth of the FMA rate: it would cap the
  stream): in 16-bit,
  n | bits(MAGIC) is the float MAGIC + n (MAGIC = 128 in bf16, 1024 in
  fp16), and MAGIC times the sum of the scaled operand is taken off in the
  bias, computed from the same rounded operand so that nothing cancels.
  The dequantizing value loop takes the same route in fp32 (n | bits(2^23)
  is 2^23 + n; 2^23 is taken off exactly before the scale and zero).

Why: the kernel that merged sinks / packed / ring in one tile with a
three-way select and dequantized every element (per-element scale and zero
loads, every byte loaded once per channel it holds) ran at ~20 GB/s on an
H200 whatever the split count. Compiled for sm_90 (Llama-3.1-8B shape, int4,
block 64, 4 warps, 2 stages) it took 121 KB of shared memory for its
pipelined loads (238 KB at block 128: over the 227 KB limit, the
OutOfResources) and 209 registers; this one takes 39 KB (73 KB at block 128)
and 255 registers with <= 40 B of spill (the fp8 kernel of dense.py: 23 KB, 234).
The registers go to the value side (channel groups as the batch axis of a 3D
dot); the sweep (benchmarks/splitkv_sweep.py) is what decides.

The 16-bit dots take packed tiles at least 16 bytes wide (D / P key bytes,
VG / P value bytes per group, VG a power of two: the Llama-like shapes,
head size 64 or 128 with groups of 64). Narrower tiles (tiny test heads)
came out wrong on sm_90 in bf16 and fp16 (exact under the interpreter), and
so did their fp32 dots in TF32 (relative errors 1.2-3.4 on the H200, head
sizes 16 and 32); for them the kernel runs its dots in full fp32 (WIDE=False,
IEEE), same structure: slow, but only tiny heads take it.

Layouts the fold does not cover run a slower exact path, chosen at compile
time: key groups whose largest power-of-two factor is < 16 (a tile then spans
groups: per-slot scales, dequantized), value groups not a multiple of P
(bytes straddle groups: loaded per element).

Offsets: 64-bit per program and per tile (scalars), 32-bit within a tile;
slot indices are 32-bit (caches below 2^31 slots).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv import LowBitKV
from .common import MAX_ROWS, VARIANTS, interpreting, launch_options, merge_splits_kernel
from .common import num_sms as _num_sms

LOG2E = 1.4426950408889634
MAXNREG = 168  # the fp16 loop's register cap at head size 128 on a GPU (3 programs an SM)


def _kernel():
    from .lowbit_kernel import splitkv_lowbit_fwd  # imports triton

    return splitkv_lowbit_fwd


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def wide_tiles(D: int, VG: int, key_bits: int, value_bits: int) -> bool:
    """Whether the 16-bit dots apply (see the module docstring)."""
    return D // (8 // key_bits) >= 16 and VG == _pow2(VG) and VG // (8 // value_bits) >= 16


def lowbit_splitkv_attention(q, kv: LowBitKV, q_slot, q_doc, k_doc, window=None, scale=None,
                             window_rows: int | None = None, sinks: int = 0):
    """Queries q [B, M, H, D] (G * M <= MAX_ROWS) over the first `kv.length` slots of a low-bit
    cache layer; q_slot / q_doc [B, M], k_doc [B, >= length]. Same contract as `naive_attention`
    over `ops.lowbit.dense_kv` of the same storage: -> [B, M, H, D] in q's dtype.
    window_rows: only the first `window_rows` queries use `window` (see `ops.attention`); sinks: windowed
    queries also see the first `sinks` slots (attention sinks; at most the cache's bf16 sinks, rows that
    start at slot 0). The packed slots are read by the Gluon kernel wherever it applies (`gluon_applies`), else by
    this module's Triton kernel; launch settings are the measured defaults (their variants:
    `ops.splitkv.study`)."""
    return lowbit_attention_tuned(q, kv, q_slot, q_doc, k_doc, window, scale, window_rows, sinks=sinks)


def lowbit_attention_tuned(q, kv: LowBitKV, q_slot, q_doc, k_doc, window=None, scale=None,
                           window_rows: int | None = None, num_splits=None, block_n: int = 64,
                           num_warps: int | None = None, num_stages: int | None = None, planar: bool | None = None,
                           dequant_values: bool | None = None, fp16_dequant: bool | None = None,
                           maxnreg: int | None = None, packed_kernel: str | None = None, sinks: int = 0):
    """`lowbit_splitkv_attention` with its launch settings and loop variants (for studies:
    `ops.splitkv.study.lowbit_splitkv_attention` documents them)."""
    parts = kv.parts()
    kb, vb, kg, rotation = kv.key_bits, kv.value_bits, kv.key_group, kv.rotation
    k_scale, v_scale = kv.k_scale, kv.v_scale
    row0 = packed_rows(q.shape[1], window, window_rows)
    if packed_kernel is None:  # the Triton kernel's loop variants, when asked for, are the Triton kernel's
        tuned = (planar, dequant_values, fp16_dequant) != (None, None, None)
        gluon = not tuned and gluon_applies(q, k_scale, v_scale, kg, kb, vb, row0, planar)
        packed_kernel = "gluon" if gluon else "triton"
    elif packed_kernel == "gluon":
        why = gluon_refusal(q, k_scale, v_scale, kg, kb, vb, row0, planar)
        if why:
            raise ValueError(f"the Gluon packed kernel does not apply: {why}")
    if packed_kernel == "gluon":
        return _gluon_attention(q, *parts, q_slot, q_doc, k_doc, kv.bound, kv.length, kb, vb, kg, window, scale,
                                window_rows, rotation, row0, num_splits, block_n, num_warps, num_stages, maxnreg,
                                sinks)
    if packed_kernel != "triton":
        raise ValueError(f"packed_kernel must be 'gluon', 'triton' or None, got {packed_kernel!r}")
    plan = launch_plan(q, *parts, q_slot, q_doc, k_doc, kv.bound, kv.length, kb, vb, kg, window, scale, window_rows,
                       rotation, num_splits, block_n, num_warps, num_stages, planar, dequant_values, fp16_dequant,
                       maxnreg, sinks=sinks)
    _kernel()[plan.grid](*plan.args, **plan.meta)
    B, P, M, H, nparts, D = plan.o.shape
    if nparts == 1:
        return merge_splits_kernel(plan.o.view(B, P, M, H, D), plan.lse, q.dtype)
    return merge_parts(plan.o, plan.lse, rotation, q.dtype)


def merge_parts(o: torch.Tensor, lse: torch.Tensor, rotation, dtype: torch.dtype) -> torch.Tensor:
    """Partials of P splits in two parts, o [B, P, M, H, 2, D] (the bf16 slots' values, the packed
    slots' values) sharing each split's softmax, lse [B, P, M, H] -> [B, M, H, D] in `dtype`: merged
    as 2H heads, then the packed part (out of V R space for a rotated cache) added to the other."""
    B, P, M, H, _, D = o.shape
    out = merge_splits_kernel(o.view(B, P, M, 2 * H, D), lse.repeat_interleave(2, dim=-1), torch.float32)
    out = out.view(B, M, H, 2, D)
    packed = out[..., 1, :] if rotation is None else out[..., 1, :] @ rotation
    return (out[..., 0, :] + packed).to(dtype)


# ------------------------------------------------------------------ the Gluon packed kernel
GLUON_ROWS = 8  # output rows a KV head the Gluon kernel takes (G * packed rows)
GLUON_WARPS_PER_SM = 16  # programs (one warp each) an SM, for the default split count


def packed_rows(M: int, window, window_rows) -> int:
    """The first query row that reads packed slots (rows before it are windowed)."""
    if window is None:
        return 0
    return M if window_rows is None else min(M, window_rows)


def gluon_refusal(q, k_scale, v_scale, key_group, key_bits, value_bits, row0, planar=None) -> str | None:
    """Why the Gluon packed kernel cannot read this launch's packed slots (None: it can)."""
    B, M, H, D = q.shape
    G = H // k_scale.shape[2]
    if not q.is_cuda or interpreting():
        return "it needs a CUDA GPU (no interpreter)"
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return "it needs mma.sync (sm_80 or newer)"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return "it needs 16-bit queries"
    if D not in (64, 128) or v_scale.shape[-1] != D // 64:
        return "it needs head size 64 or 128 with value groups of 64"
    if key_group % 64:
        return "it needs key groups of a multiple of 64 slots"
    if key_bits not in (2, 4) or value_bits not in (2, 4):
        return "it needs 2- or 4-bit keys and values"
    if row0 >= M or G * (M - row0) > GLUON_ROWS:
        return f"it takes 1 to {GLUON_ROWS} output rows a KV head, got {G} x {M - row0}"
    if planar is False:
        return "the interleaving loop was asked for"
    if k_scale.shape[1] * key_group * k_scale.shape[2] * (D // 8) >= 2**31:
        return "caches of 2^31 packed units a row or more"
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError:
        return "this Triton has no Gluon"
    return None


def gluon_applies(q, k_scale, v_scale, key_group, key_bits, value_bits, row0, planar=None) -> bool:
    """Whether the packed slots are read by the Gluon kernel by default (`packed_kernel=None`): wherever
    it can, unless a study asked for the Triton kernel (`VARIANTS.lowbit_packed = "triton"`)."""
    if VARIANTS.lowbit_packed == "triton":
        return False
    return gluon_refusal(q, k_scale, v_scale, key_group, key_bits, value_bits, row0, planar) is None


def _gluon_attention(q, sk, sv, kq, vq, k_scale, k_zero, v_scale, v_zero, rk, rv, q_slot, q_doc, k_doc, bound,
                     length, key_bits, value_bits, key_group, window, scale, window_rows, rotation, row0,
                     num_splits, block_n, num_warps, num_stages, maxnreg, sinks=0):
    """The bf16 slots (sinks, ring) by the Triton kernel in `bf16_splits` splits, the packed slots by the
    Gluon kernel in `num_splits` (default GLUON_WARPS_PER_SM programs an SM), merged."""
    B, M, H, D = q.shape
    NB = bf16_splits(rk, key_group)
    P2 = gluon_splits(q, rk.shape[2], length, num_splits)
    o = torch.empty(B, NB + P2, M, H, 2, D, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, NB + P2, M, H, device=q.device, dtype=torch.float32)
    qr = bf16_split(q, sk, sv, kq, vq, k_scale, k_zero, v_scale, v_zero, rk, rv, q_slot, q_doc, k_doc, bound,
                    length, key_bits, value_bits, key_group, o, lse, window, scale, window_rows, rotation, block_n,
                    num_warps, num_stages, maxnreg, splits=NB, sinks=sinks)
    kernel, grid, args, meta = gluon_launch(qr, kq, vq, k_scale, k_zero, v_scale, v_zero, q_doc, k_doc,
                                            bound, o, lse, sk.shape[1], length, key_bits, value_bits, key_group,
                                            scale, row0, P2, split0=NB)
    kernel[grid](*args, **meta)
    return finish(o, lse, row0, rotation, q.dtype, NB)


BF16_SPLIT_SLOTS = 32  # at least this many ring slots a bf16 split (at most 4 splits)


def bf16_splits(rk, key_group: int) -> int:
    """How many programs a (row, KV head) read the bf16 slots, so that the few bf16 tiles are read side
    by side, not one after another by one program: the slots from the bound on (at most ring - key_group:
    191 of the 8B shape's 256-slot ring, read as 4 runs of 48) in runs of at least BF16_SPLIT_SLOTS, at
    most 4 runs, a power of two (the merge's tile)."""
    n = max(1, min(4, (rk.shape[1] - key_group) // BF16_SPLIT_SLOTS))
    return 1 << (n.bit_length() - 1)


def bf16_split(q, sk, sv, kq, vq, k_scale, k_zero, v_scale, v_zero, rk, rv, q_slot, q_doc, k_doc, bound, length,
               key_bits, value_bits, key_group, o, lse, window=None, scale=None, window_rows=None, rotation=None,
               block_n=64, num_warps=None, num_stages=None, maxnreg=None, splits=None, sinks=0) -> torch.Tensor:
    """The Gluon path's bf16 splits: the bf16 slots (sinks, ring) by the Triton kernel, its packed loop
    skipped, into o / lse at splits 0 .. splits - 1 (default `bf16_splits(rk, key_group)`; split 0: the
    sinks and the ring's first run; split i: the ring's i-th run of its slots from the bound on).
    -> q R (q if unrotated; made by that kernel), what the packed kernel reads."""
    splits = bf16_splits(rk, key_group) if splits is None else splits
    plan = launch_plan(q, sk, sv, kq, vq, k_scale, k_zero, v_scale, v_zero, rk, rv, q_slot, q_doc, k_doc, bound,
                       length, key_bits, value_bits, key_group, window, scale, window_rows, rotation, splits,
                       block_n, num_warps, num_stages, None, None, None, maxnreg, out=(o, lse), no_packed=True,
                       sinks=sinks)
    _kernel()[plan.grid](*plan.args, **plan.meta)
    return plan.args[1]


def finish(o, lse, row0: int, rotation, dtype, bf16_splits: int = 1) -> torch.Tensor:
    """The Gluon path's outputs -> [B, M, H, D] in dtype: o [B, P, M, H, 2, D] / lse [B, P, M, H] hold
    the bf16 splits at 0 .. bf16_splits - 1 (a power of two; their packed part empty) and the packed
    splits after them, for the rows from row0 on (their bf16 part unread); see
    `lowbit_kernel.lowbit_finish`."""
    B, P, M, H, _, D = o.shape
    out = torch.empty(B, M, H, D, device=o.device, dtype=dtype)
    if rotation is not None and (D != _pow2(D) or rotation.shape != (D, D)):
        raise ValueError(f"the merge rotates power-of-two heads (Hadamard R [D, D]), got D={D}")
    if bf16_splits != _pow2(bf16_splits) or not 1 <= bf16_splits <= P:
        raise ValueError(f"bf16_splits must be a power of two in [1, {P}], got {bf16_splits}")
    _finish_kernel()[(B * M * H,)](
        o, lse, out, P, M, H, row0, o.stride(0), o.stride(1), o.stride(2), o.stride(3), o.stride(4),
        lse.stride(0), lse.stride(1), lse.stride(2), out.stride(0), out.stride(1), out.stride(2),
        D=D, NB=bf16_splits, BLOCK_P=min(128, _pow2(P)), ROTATED=rotation is not None, HB=D, RSCALE=float(D) ** -0.5,
        num_warps=8)
    return out


def _finish_kernel():
    from .lowbit_kernel import lowbit_finish  # imports triton

    return lowbit_finish


def gluon_splits(q, Hkv: int, length: int, num_splits=None) -> int:
    """The Gluon kernel's programs a (row, KV head): whole tiles each, none empty by construction."""
    import triton

    from .lowbit_gluon import BLOCK

    tiles = triton.cdiv(length, BLOCK.value)
    if num_splits is None:
        num_splits = max(1, GLUON_WARPS_PER_SM * _num_sms(q.device) // max(1, q.shape[0] * Hkv))
    return triton.cdiv(tiles, triton.cdiv(tiles, num_splits))


def gluon_launch(qr, kq, vq, k_scale, k_zero, v_scale, v_zero, q_doc, k_doc, bound, o, lse, sinks, length,
                 key_bits, value_bits, key_group, scale, row0, splits, maxnreg=None, pipe=None, split0=1):
    """The Gluon kernel's launch (kernel, grid, args, meta) over o / lse splits split0 .. split0 + splits - 1
    (after the bf16 splits), for q R (or q, unrotated) qr [B, M, H, D]: what `_gluon_attention` runs, and
    what a benchmark times alone."""
    import triton

    from . import lowbit_gluon as gk

    B, M, H, D = qr.shape
    Hkv = k_scale.shape[2]
    per = triton.cdiv(triton.cdiv(length, gk.BLOCK.value), splits)
    NU = D // 8
    KW = 4 if NU == 16 else 2
    scale = D ** -0.5 if scale is None else scale
    args = [qr, kq, vq, k_scale, k_zero, v_scale, v_zero, q_doc, k_doc, bound, o, lse,
            qr.stride(0), qr.stride(1), qr.stride(2), kq.stride(0), kq.stride(1) // key_bits, kq.stride(2),
            vq.stride(0), vq.stride(1) // value_bits, vq.stride(2),
            k_scale.stride(0), k_scale.stride(1), k_scale.stride(2), v_scale.stride(0), v_scale.stride(1),
            v_scale.stride(2), q_doc.stride(0), k_doc.stride(0),
            o.stride(0), o.stride(1), o.stride(2), o.stride(3), o.stride(4), lse.stride(0), lse.stride(1),
            lse.stride(2), M, Hkv, sinks, key_group, scale * LOG2E, row0, split0, per]
    pipe = D == 128 if pipe is None else pipe
    if pipe and D != 128:
        raise ValueError("the copies a tile ahead (pipe) need head size 128 (4-byte value scale pairs)")
    meta = dict(G=H // Hkv, NU=NU, KBITS=key_bits, VBITS=value_bits, KW=KW, PIPE=pipe,
                **gk.layouts(NU, KW, key_bits, value_bits), **launch_options(num_warps=1, maxnreg=maxnreg))
    return gk.lowbit_packed_fwd, (B * Hkv, splits), args, meta


@dataclass
class LaunchPlan:
    grid: tuple
    args: list  # positional: tensors and scalars
    meta: dict  # constexprs and launch options
    o: torch.Tensor  # the per-split partial outputs [B, P, M, H, parts, D]
    lse: torch.Tensor


def launch_plan(q, sk, sv, kq, vq, k_scale, k_zero, v_scale, v_zero, rk, rv, q_slot, q_doc, k_doc, bound,
                length, key_bits, value_bits, key_group, window=None, scale=None, window_rows=None, rotation=None,
                num_splits=None, block_n=64, num_warps=None, num_stages=None, planar=None,
                dequant_values=None, fp16_dequant=None, maxnreg=None, out=None, no_packed=False,
                sinks=0) -> LaunchPlan:
    """The kernel's launch for `lowbit_splitkv_attention` (also what a compile check builds).
    out: (o, lse) buffers to write split p at (default: new ones of the launch's P splits);
    no_packed: leave the packed slots to another kernel (`lowbit_gluon.py`); sinks: windowed rows' attention
    sinks (the first `sinks` slots, all bf16 sinks of the cache)."""
    import triton

    B, M, H, D = q.shape
    Hkv = rk.shape[2]
    G = H // Hkv
    if G * M > MAX_ROWS:
        raise ValueError(f"split-KV takes at most {MAX_ROWS} query rows per KV head, got {G} x {M}")
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in its last dim")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if rotation is not None and (rotation.shape != (D, D) or rotation.dtype != torch.float32
                                 or not rotation.is_contiguous()):
        raise ValueError(f"rotation must be a contiguous fp32 [{D}, {D}] matrix, got {tuple(rotation.shape)} "
                         f"{rotation.dtype}")
    NG = v_scale.shape[-1]
    VG = D // NG
    scale = D ** -0.5 if scale is None else scale
    slot = q_slot.expand(B, M)
    S = length
    # packed tiles inside one key group: the largest power of two dividing key_group, if >= 16
    block_q = min(block_n, key_group & -key_group)
    key_fold = block_q >= 16
    block_q = block_q if key_fold else block_n
    wide = q.dtype != torch.float32 and wide_tiles(D, VG, key_bits, value_bits)
    can_planar = wide and key_fold and D == _pow2(D)
    if planar and not can_planar:
        raise ValueError("the bit-plane loop needs 16-bit queries, packed tiles >= 16 bytes wide, key groups "
                         "with a power-of-two factor >= 16 and a power-of-two head size")
    planar = can_planar if planar is None else planar
    if dequant_values and not planar:
        raise ValueError("dequant_values is a variant of the bit-plane loop (planar)")
    dequant_values = planar if dequant_values is None else dequant_values
    if fp16_dequant and not dequant_values:
        raise ValueError("fp16_dequant is a variant of the dequantizing bit-plane loop (dequant_values)")
    fp16_dequant = bool(dequant_values) if fp16_dequant is None else fp16_dequant
    # the fp16 loop at head size 128 on a GPU (measured there, see the module docstring): 168 registers
    # a thread, so that three programs share an SM, and two full waves of them
    if maxnreg is None and fp16_dequant and D == 128 and q.is_cuda:
        maxnreg = MAXNREG
    if num_splits is None:
        want = max(1, (6 if maxnreg == MAXNREG else 2) * _num_sms(q.device) // max(1, B * Hkv))
        num_splits = max(1, min(want, triton.cdiv(S, 4 * block_n)))
    per = triton.cdiv(triton.cdiv(max(S, 1), num_splits), block_n) * block_n
    P = max(1, triton.cdiv(S, per))
    if no_packed:  # runs of the slots from the bound on (< ring - key_group; the sinks in split 0): the kernel
        per, P = triton.cdiv(rk.shape[1] - key_group, num_splits), num_splits
    parts = 2 if rotation is not None or planar else 1  # [bf16 part | packed part]
    if out is None:
        o = torch.empty(B, P, M, H, parts, D, device=q.device, dtype=torch.float32)
        lse = torch.empty(B, P, M, H, device=q.device, dtype=torch.float32)
    else:
        o, lse = out
        if o.shape[2:] != (M, H, parts, D) or o.shape[1] < P or lse.shape[1] < P:
            raise ValueError(f"out buffers [B, >= {P}, {M}, {H}, {parts}, {D}] expected, got {tuple(o.shape)}")
    if window is not None and sinks > sk.shape[1]:
        raise ValueError(f"{sinks} attention sinks need as many bf16 sink slots, the cache keeps {sk.shape[1]}")
    if sk.shape[1] == 0:  # no sinks: any valid pointer (never read)
        sk, sv = rk, rv
    if rotation is None:
        qr = q
    elif no_packed:  # the kernel writes q R (`ops.lowbit.rotate`'s transform) for the other kernel to read
        qr = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    else:
        qr = (q.float() @ rotation).to(q.dtype)  # [B, M, H, D], contiguous
    args = [
        q, qr, sk, sv, kq, vq, k_scale, k_zero, v_scale, v_zero, rk, rv, slot, q_doc, k_doc, bound, o, lse,
        q.stride(0), q.stride(1), q.stride(2),
        qr.stride(0), qr.stride(1), qr.stride(2),
        sk.stride(0), sk.stride(1), sk.stride(2),
        kq.stride(0), kq.stride(1), kq.stride(2),
        vq.stride(0), vq.stride(1), vq.stride(2),
        k_scale.stride(0), k_scale.stride(1), k_scale.stride(2),
        v_scale.stride(0), v_scale.stride(1), v_scale.stride(2),
        rk.stride(0), rk.stride(1), rk.stride(2),
        slot.stride(0), q_doc.stride(0), k_doc.stride(0),
        o.stride(0), o.stride(1), o.stride(2), o.stride(3), o.stride(4), lse.stride(0), lse.stride(1), lse.stride(2),
        M, S, Hkv, 0 if sk is rk else sk.shape[1], rk.shape[1], key_group, scale * LOG2E,
        0 if window is None else window, M if window_rows is None else window_rows, per,
    ]
    meta = dict(
        G=G, D=D, KBITS=key_bits, VBITS=value_bits, VG=VG, NG=NG, BLOCK_R=max(16, _pow2(G * M)), BLOCK_N=block_n,
        BLOCK_Q=block_q, BLOCK_D=max(16, _pow2(D)), BLOCK_NG=_pow2(NG), BLOCK_VG=max(16, _pow2(VG)),
        KEY_FOLD=key_fold, VALUE_BYTES=VG % (8 // value_bits) == 0,
        HAS_WINDOW=window is not None, ROTATED=rotation is not None, WIDE=wide, PLANAR=planar, VDQ=bool(dequant_values),
        IEEE=q.dtype == torch.float32 or not wide,  # narrow tiles: no TF32 either (see above)
        F16=bool(fp16_dequant), PTX=not interpreting(), NO_PACKED=bool(no_packed), HB=D & -D,
        RSCALE=float(D & -D) ** -0.5, ATTN_SINKS=sinks if window is not None else 0,
        **launch_options(num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg),
    )
    return LaunchPlan((B * Hkv, P), args, meta, o, lse)
