"""What every split-KV reader shares: whether the kernel takes a call, the split plan, the merge.

The readers (`dense.py`, `paged.py`, `lowbit.py`) differ only in how a program finds and
decodes its keys; each cuts the key axis into P splits, one program per (row, KV head,
split) computes a partial softmax over its keys for the G * M query rows of that head, and
the partials are merged by log-sum-exp:

    lse = logsumexp_p lse_p,    o = sum_p exp(lse_p - lse) * o_p

Triton is imported on first use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..tracing import exporting

MAX_ROWS = 64  # G * M queries per program tile


@dataclass
class Variants:
    """Kernel variants kept for studies (A/B runs of benchmarks); production leaves the defaults.
    Only benchmark entry points change them (`study.from_environment`).

    fp8_dots: "fp16" (default) or "bf16": the dots of 16-bit queries over fp8 K/V (`use_fp16_dots`).
    lowbit_packed: None (default: the Gluon kernel wherever it applies) or "triton": what reads
        a low-bit cache's packed slots (`lowbit.gluon_applies`)."""

    fp8_dots: str = "fp16"
    lowbit_packed: str | None = None


VARIANTS = Variants()


_TRITON: bool | None = None


def triton_available() -> bool:
    """Whether Triton imports (checked once). A plain global, not functools.cache: this runs
    inside compiled decode steps, where dynamo warns about every lru_cache-wrapped call."""
    global _TRITON
    if _TRITON is None:
        try:
            import triton  # noqa: F401

            _TRITON = True
        except ImportError:
            _TRITON = False
    return _TRITON


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def splitkv_takes(q: torch.Tensor, kv_heads: int, backend: str = "auto", *kv: torch.Tensor) -> bool:
    """Does the split-KV kernel take this call? The one predicate every caller asks.

    q [B, M, H, D] over K/V of `kv_heads` heads (`kv`: the K/V tensors, for the autograd
    check): few query rows a KV head (G * M <= MAX_ROWS), no autograd, Triton on CUDA, or
    under Triton's CPU interpreter when the "triton" backend is asked for."""
    if backend not in ("auto", "triton") or exporting():  # an exported program runs naive
        return False
    rows = (q.shape[2] // kv_heads) * q.shape[1]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, *kv))
    device_ok = q.is_cuda or (interpreting() and backend == "triton")
    return device_ok and not needs_grad and triton_available() and rows <= MAX_ROWS


def num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def launch_options(**options) -> dict:
    """The Triton launch options given (num_warps, num_stages, maxnreg, ...): None means Triton's default."""
    return {k: v for k, v in options.items() if v is not None}


def split_plan(S: int, block_n: int, programs: int, device, num_splits: int | None = None,
               per_sm: int = 2) -> tuple[int, int]:
    """(keys per split, P splits) over S keys for `programs` (rows x KV heads) programs: by default
    enough splits for `per_sm` programs an SM, at least 4 tiles a split; whole tiles each."""
    cdiv = lambda a, b: -(-a // b)
    if num_splits is None:
        want = max(1, per_sm * num_sms(device) // max(1, programs))
        num_splits = max(1, min(want, cdiv(S, 4 * block_n)))
    per = cdiv(cdiv(max(S, 1), num_splits), block_n) * block_n
    return per, max(1, cdiv(S, per))


def use_fp16_dots(q: torch.Tensor, k: torch.Tensor, want: bool | None = None) -> bool:
    """Whether a kernel over fp8 K/V runs its dots in fp16 (None: wherever it can, i.e. 16-bit
    queries over fp8 keys). Hopper converts e4m3 to fp16 two values per instruction, but to bf16
    only through fp16, one more instruction per value: in a kernel that streams a 1M fp8 cache,
    those conversions are most of its instructions. fp16 holds every e4m3 value exactly and bf16
    queries to 3 more mantissa bits; queries above 2^14 are scaled by a power of two first.
    (`VARIANTS.fp8_dots = "bf16"` makes None mean bf16 dots, for A/B runs.)"""
    can = k.dtype == torch.float8_e4m3fn and q.dtype in (torch.bfloat16, torch.float16)
    if want and not can:
        raise ValueError(f"fp16 dots are for 16-bit queries over fp8 keys, got {q.dtype} over {k.dtype}")
    if want is None:
        return can and VARIANTS.fp8_dots != "bf16"
    return bool(want)


MERGE_BLOCK_P = 32
"""Splits the merge reads at a time, whatever their number P (a loop): one build for every P."""


def merge_splits_kernel(o: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype, return_lse: bool = False,
                        out: torch.Tensor | None = None):
    """Partial results o [B, P, M, H, D], lse [B, P, M, H] (fp32) of P splits -> [B, M, H, D] in
    `dtype` (and the merged lse [B, M, H]): one merge kernel (the PyTorch `lse_merge` is a
    dozen launches per call), none for P = 1. out: [B, M, H, D] to store into (a view is fine)."""
    import triton

    from .kernels import splitkv_merge

    B, P, M, H, D = o.shape
    if P == 1:
        out_, lse_out = o[:, 0].to(dtype), lse[:, 0]
        if out is not None:
            out_ = out.copy_(out_)
        return (out_, lse_out) if return_lse else out_
    out = torch.empty(B, M, H, D, device=o.device, dtype=dtype) if out is None else out
    lse_out = torch.empty(B, M, H, device=o.device, dtype=torch.float32)
    splitkv_merge[(B * M * H,)](
        o, lse, out, lse_out, P, M, H,
        o.stride(0), o.stride(1), o.stride(2), o.stride(3), lse.stride(0), lse.stride(1), lse.stride(2),
        out.stride(0), out.stride(1), out.stride(2), lse_out.stride(0), lse_out.stride(1),
        D=D, BLOCK_P=MERGE_BLOCK_P, BLOCK_D=max(16, triton.next_power_of_2(D)),
    )
    return (out, lse_out) if return_lse else out
