"""Single queries over a low-bit block pool (`ops.kv.PagedLowBitKV`): the paged form of the
low-bit reader (`lowbit.py`), each query reading its own blocks through its block table.

A serving engine's output rows (a decode's output query, a prompt's last token) each see
positions 0..pos of their sequence, stored as `LowBitStaticCache` stores them
(`ops/lowbit/format.py`), but in blocks: position p lives at pool slot
`table[r, p // BS] * BS + p % BS` of the packed pool and, while a bf16 copy is kept, at the same
offset of twin block `twins[r, p // BS]`. With bound = max(0, pos + 1 - recent) // KG * KG:

    [0, sinks)        bf16, block 0's twin
    [sinks, bound)    packed (keys per channel over key groups inside a block, values per token)
    [bound, pos]      bf16, the twins

One program per (query, KV head, key split), the G query heads of a KV head as the rows of one
tile, an online softmax (base 2) over the split's keys in three loops, one per part; the packed
slots are dequantized in fp32 registers (levels by `lowbit_kernel._unpack`), a rotated pool's keys
read with q R; the packed values accumulate apart, so that the splits end in `lowbit.merge_parts`
(one log-sum-exp merge, then the packed part times R). Static shapes and no host sync: a decode
step that uses it can be captured in a CUDA graph.

    paged_lowbit_attention      the op: this kernel on CUDA, the reference elsewhere
    paged_lowbit_attention_ref  the same function by gathering and dequantizing every row's
                                visible slots (`ops.lowbit.format`), then the naive op
"""

from __future__ import annotations

import torch

from ..kv import PagedLowBitKV, PagedRows
from ..lowbit.format import dequantize_keys, dequantize_values, packed_bound
from ..masks import PAD_DOC
from ..naive import naive_attention
from .common import MAX_ROWS, split_plan, triton_available
from .lowbit import LOG2E, merge_parts


def paged_lowbit_attention(q, kv: PagedLowBitKV, rows: PagedRows, twins: torch.Tensor, scale=None, out=None):
    """Queries q [R, H, D], one a row of `rows` (its block table, position; `twins` [R, max_blocks] the
    twin of each of its blocks) over the low-bit pool `kv` -> [R, H, D] in q's dtype (into `out` if
    given). The kernel on CUDA (G <= MAX_ROWS query heads a KV head), the reference elsewhere."""
    if q.shape[0] == 0:
        return q if out is None else out
    G = q.shape[1] // kv.kq.shape[1]
    if q.is_cuda and triton_available() and G <= MAX_ROWS:
        o = paged_lowbit_attention_kernel(q, kv, rows.table, twins, rows.pos, scale, rows.max_len)
    else:
        o = paged_lowbit_attention_ref(q, kv, rows.table, twins, rows.pos, scale)
    return o if out is None else out.copy_(o)


def _parts(kv: PagedLowBitKV):
    w = kv.window
    return w.k, w.v, w.block_size


def paged_lowbit_attention_ref(q, kv: PagedLowBitKV, table, twins, pos, scale=None):
    """`paged_lowbit_attention` by gathering each row's slots 0..pos (padded to whole key groups),
    dequantized below the row's bound, bf16 from the twins elsewhere; then the naive op."""
    tk, tv, bs = _parts(kv)
    g, NS = kv.key_group, kv.sinks
    pos = pos.long()
    S = -(-(int(pos.max()) + 1) // g) * g
    j = torch.arange(S, device=q.device)
    blk = table.long()[:, j // bs]  # [R, S]
    slot = blk * bs + j % bs
    tslot = twins.long()[:, j // bs].clamp_min(0) * bs + j % bs  # no twin (-1): masked out below
    kd = dequantize_keys(kv.kq[slot], kv.k_scale[slot[:, ::g] // g], kv.k_zero[slot[:, ::g] // g], kv.key_bits, g)
    vd = dequantize_values(kv.vq[slot], kv.v_scale[slot], kv.v_zero[slot], kv.value_bits)
    if kv.rotation is not None:
        kd, vd = kd @ kv.rotation, vd @ kv.rotation
    hk, hv = tk[tslot].float(), tv[tslot].float()
    if NS:  # the sinks: block 0's twin (also where a later block's twin is gone)
        sink = twins.long()[:, :1] * bs + j[:NS]  # [R, NS]
        hk[:, :NS], hv[:, :NS] = tk[sink].float(), tv[sink].float()
    bound = packed_bound(pos + 1, kv.recent, g)  # the first position a query at pos reads in bf16
    old = ((j[None] >= NS) & (j[None] < bound[:, None]))[..., None, None]
    k, v = torch.where(old, kd, hk).to(q.dtype), torch.where(old, vd, hv).to(q.dtype)
    k_doc = torch.where(j[None] <= pos[:, None], 0, PAD_DOC)
    q_slot = pos[:, None]
    return naive_attention(q[:, None], k, v, q_slot, torch.zeros_like(q_slot), k_doc, scale=scale)[:, 0]


def paged_lowbit_attention_kernel(q, kv: PagedLowBitKV, table, twins, pos, scale=None, max_len: int | None = None,
                                  keys_per_split: int | None = None):
    """`paged_lowbit_attention` through the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1).

    On CUDA the kernel computes in fp32 (IEEE dots) whatever q's dtype: its half-precision tiles gave
    wrong outputs on an H200 with bf16 queries (relative error 1.15 against the reference; fp32 exact).
    Located (H100, 2026-12-05, `python -m tests.ops.splitkv.lowbit_paged_cases --locate`, which
    launches the half-precision tiles on purpose through `launch`): it is the head size, not the key
    group. Packed slots of 16-channel heads are wrong in key groups of 16, 32 and 64 alike (relative
    error 2.2-2.5, fp16 and bf16), 32-channel heads in groups of 16 too (0.83); 64-channel heads are
    right (< 7e-3), and so is every head on the bf16 twins alone. Two chained dots alone (the old
    suspect, Triton issue 1162) are exact at K = 16-64 (<= 1.5e-7). The packed tile is the only one
    made by `tl.interleave` (`_unpack`) and then transposed into a dot; the fp32 launch runs the same
    unpack into FMA dots (`input_precision="ieee"`) and is exact, the 16-bit one into MMA dots. The next
    thing to measure on a GPU: `launch(..., channels=True)` reads the packed slots a channel at a time
    (byte d // P, shifted to its bit plane) instead of interleaved (exact under the interpreter; `--locate`
    prints both). The result is returned in q's dtype."""
    if q.is_cuda and q.dtype != torch.float32:
        return launch(q.float(), kv, table, twins, pos, scale, max_len, keys_per_split).to(q.dtype)
    return launch(q, kv, table, twins, pos, scale, max_len, keys_per_split)


def launch(q, kv: PagedLowBitKV, table, twins, pos, scale=None, max_len: int | None = None,
           keys_per_split: int | None = None, channels: bool = False):
    """The kernel in q's dtype, as is (16-bit queries: 16-bit tiles and dots). `channels` (a study of
    the 16-bit tiles, `--locate`): the packed slots read a channel at a time, each channel's byte
    loaded and shifted to its bit plane, instead of the bytes unpacked by `tl.interleave`."""
    import triton

    from .lowbit_paged_kernel import paged_lowbit_fwd

    tk, tv, bs = _parts(kv)
    R, H, D = q.shape
    Hkv = kv.kq.shape[1]
    G = H // Hkv
    kg = kv.key_group
    block_q = min(64, kg & -kg)
    if block_q < 16 or bs % kg:
        raise ValueError(f"the paged low-bit kernel needs key groups of a multiple of 16 slots inside a block, "
                         f"got key_group={kg}, block_size={bs}")
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in its last dim")
    NG = kv.v_scale.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    block_n = 64
    cap = table.shape[1] * bs
    per = keys_per_split or split_plan(max_len or cap, block_n, R * Hkv, q.device)[0]
    P = max(1, triton.cdiv(cap, per))
    qr = q if kv.rotation is None else (q.float() @ kv.rotation).to(q.dtype)
    o = torch.empty(R, P, 1, H, 2, D, device=q.device, dtype=torch.float32)
    lse = torch.empty(R, P, 1, H, device=q.device, dtype=torch.float32)
    kq, vq, ks, kz, vs, vz = kv.packed()
    paged_lowbit_fwd[(R * Hkv, P)](
        q, qr, tk, tv, kq, vq, ks, kz, vs, vz, table, twins, pos, o, lse,
        q.stride(0), q.stride(1), qr.stride(0), qr.stride(1), tk.stride(0), tk.stride(1), tv.stride(0), tv.stride(1),
        kq.stride(0), kq.stride(1), vq.stride(0), vq.stride(1), ks.stride(0), ks.stride(1), vs.stride(0),
        vs.stride(1), table.stride(0), twins.stride(0), o.stride(0), o.stride(1), o.stride(3), o.stride(4),
        lse.stride(0), lse.stride(1),
        Hkv, kv.sinks, kv.recent, kg, scale * LOG2E, per,
        BS=bs, G=G, D=D, KBITS=kv.key_bits, VBITS=kv.value_bits, VG=D // NG,
        BLOCK_R=max(16, triton.next_power_of_2(G)), BLOCK_N=block_n, BLOCK_Q=block_q,
        BLOCK_D=max(16, triton.next_power_of_2(D)), IEEE=q.dtype == torch.float32, CHANNELS=channels,
    )
    return merge_parts(o, lse, kv.rotation, q.dtype)[:, 0]
