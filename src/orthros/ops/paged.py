"""Moved to `ops/splitkv/paged.py` (the paged reader of the split-KV op); kept as an alias."""

from .splitkv.paged import paged_attention, paged_attention_kernel, paged_attention_ref, paged_splits  # noqa: F401
