"""Split-KV (flash-decoding) attention: a few queries over a long cache, forward only.

One op, one reader per storage, all sharing `common.py` (the dispatch predicate `splitkv_takes`,
the split plan, the log-sum-exp merge) and, for the 16-bit / fp8 readers, the Triton helpers of
`kernels.py` (the fp16 query prologue, the online-softmax step):

    dense.py         K/V [B, S, Hkv, D] (16-bit or fp8): `splitkv_attention`
    paged.py         a block pool through block tables: `paged_attention`
    lowbit.py        a low-bit cache (bf16 sinks and ring, int4 / int2 packed slots):
                     `lowbit_splitkv_attention`; its packed slots read by the Triton kernel of
                     `lowbit_kernel.py` or the Gluon kernel of `lowbit_gluon.py`
    study.py         benchmark-only entry points: kernel variants and launch settings

Nothing here imports Triton at module load.
"""

from .common import MAX_ROWS, VARIANTS, launch_options, merge_splits_kernel, splitkv_takes, use_fp16_dots
from .common import num_sms as _num_sms
from .dense import splitkv_attention
from .lowbit import lowbit_splitkv_attention
from .paged import paged_attention, paged_attention_kernel, paged_attention_ref

__all__ = ["MAX_ROWS", "VARIANTS", "launch_options", "merge_splits_kernel", "splitkv_takes", "use_fp16_dots",
           "splitkv_attention", "lowbit_splitkv_attention", "paged_attention", "paged_attention_kernel",
           "paged_attention_ref"]
