"""Attention ops and the dispatchers that pick one per call.

`attend(q, kv, ...)` reads a cache layer's stored K/V as the cache describes it (`ops.kv`:
dense, paged, low-bit; `attend.py`): the one place where a kernel is chosen for a cache.
`attention(...)` is its dense case and has the contract of `naive_attention` (the reference);
the fast paths below compute the same function:

    chunked — blocked SDPA (`chunked.py`, `sdpa_cpu.py`): each query chunk
              reads only the keys it can see (O(T·W) scores for the base
              stream), through SDPA's CPU flash kernel. CPU default, and the
              fallback wherever nothing faster applies.
    sdpa    — F.scaled_dot_product_attention (cuDNN first), only for a plain
              causal batch whose queries are slots 0..M-1 and no window; and,
              without autograd, slots s..s+M-1 (a later prefill chunk: two
              cuDNN calls merged by log-sum-exp, `dense.sdpa_causal_offset`).
    flex    — compiled FlexAttention with a block mask built from tile
              metadata: many queries, forward and backward, any mask.
    triton  — split-KV (flash-decoding) kernel (`ops/splitkv/`): a few queries
              over a long cache, inference only; `splitkv_takes` says when.

`backend="auto"` picks, on CUDA: split-KV for few queries without autograd,
SDPA for a plain causal batch (a prefix, or a later chunk without autograd),
FlexAttention otherwise; on CPU: chunked. An exported program (torch.export) runs naive.
A named backend is used where it applies and falls back (in the order
above) where it does not, e.g. "triton" with autograd runs FlexAttention.
Kernels are imported lazily: `import orthros` never needs Triton.
"""

from __future__ import annotations

import torch

from .chunked import chunked_attention
from .kv import DenseKV
from .masks import NO_QUERY_DOC, PAD_DOC, visible
from .naive import naive_attention
from .splitkv.common import interpreting as _interpreting  # noqa: F401  (older import path)
from .splitkv.common import splitkv_takes, triton_available
from .tracing import exporting as _exporting

__all__ = ["attention", "naive_attention", "chunked_attention", "visible", "PAD_DOC", "NO_QUERY_DOC", "BACKENDS"]

BACKENDS = ("auto", "naive", "chunked", "sdpa", "flex", "triton")


def _splitkv_applies(q, k, v, backend: str) -> bool:
    return splitkv_takes(q, k.shape[2], backend, k, v)


def attention(q, k, v, q_slot, q_doc, k_doc, window=None, scale=None, backend: str = "auto",
              dense_start: int | None = None, window_rows: int | None = None, sinks: int = 0):
    """Orthros attention for either stream; see `naive_attention` for shapes.

    dense_start: an optional promise by the caller that every row is one
        document without padding and q_slot[:, i] == dense_start + i. It
        changes no result; it lets kernels skip the document lookups.
    window_rows: only the first `window_rows` queries use `window`, the rest
        see their whole document: both streams of a decode step in one call
        (base rows first). The split-KV kernel does it in one launch; other
        paths make one call per group.
    sinks: windowed rows also see their document's first `sinks` keys (attention sinks). Taken
        by the reference op, the split-KV kernel, FlexAttention and the chunked CPU path; the
        dense SDPA paths do not read them.
    """
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    M = q.shape[1]
    # torch.export traces neither the Triton kernels' launch arithmetic (split counts guard on the
    # symbolic length), the chunked op's host sync (its chunks' key ranges) nor FlexAttention's
    # block mask: an exported program attends with the reference op, on every device
    exporting = _exporting()
    sinks = sinks if window is not None else 0
    if sinks and backend == "sdpa":  # SDPA knows no sinks: the next op that does
        backend = "auto"
    if window is not None and window_rows is not None and window_rows < M:
        if not exporting and _splitkv_applies(q, k, v, backend):
            from .splitkv.dense import splitkv_attention

            return splitkv_attention(q, k, v, q_slot, q_doc, k_doc, window=window, scale=scale,
                                     window_rows=window_rows, sinks=sinks)
        r = window_rows
        slot = q_slot.expand(q.shape[0], M)
        a = attention(q[:, :r], k, v, slot[:, :r], q_doc[:, :r], k_doc, window, scale, backend, sinks=sinks)
        b = attention(q[:, r:], k, v, slot[:, r:], q_doc[:, r:], k_doc, None, scale, backend)
        return torch.cat([a, b], 1)
    if backend == "naive" or exporting:
        return naive_attention(q, k, v, q_slot, q_doc, k_doc, window=window, scale=scale, sinks=sinks)
    if _splitkv_applies(q, k, v, backend):
        from .splitkv.dense import splitkv_attention

        if dense_start is not None and window is not None and not sinks:  # only the last W keys can be seen
            w = DenseKV.seen(k, v, dense_start, None, window)
            k, v, k_doc, q_slot = w.k, w.v, w.key_docs(k_doc), w.local(q_slot)
        return splitkv_attention(q, k, v, q_slot, q_doc, k_doc, window=window, scale=scale, sinks=sinks)
    if sinks and q.is_cuda and backend != "chunked":  # (dense SDPA, below, knows no sinks)
        from .flex import flex_attention_op

        return flex_attention_op(q, k, v, q_slot, q_doc, k_doc, window, scale, dense_start, sinks=sinks)
    if not q.is_cuda or backend == "chunked":
        if backend == "flex":  # uncompiled FlexAttention on CPU: for tests of the mask logic
            from .flex import flex_attention_op

            return flex_attention_op(q, k, v, q_slot, q_doc, k_doc, window, scale, dense_start, sinks=sinks)
        return chunked_attention(q, k, v, q_slot, q_doc, k_doc, window=window, scale=scale, dense_start=dense_start,
                                 sinks=sinks)
    if dense_start is not None and window is not None and window >= dense_start + M:
        window = None  # the window covers every key of every query
    if dense_start == 0 and window is None and backend in ("auto", "sdpa"):
        from .dense import sdpa_causal

        return sdpa_causal(q, k, v, scale=scale)
    if (dense_start and window is None and backend in ("auto", "sdpa") and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[-1] <= 128 and q.shape[-1] % 8 == 0  # head sizes cuDNN's kernel takes
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))):
        from .dense import sdpa_causal_offset  # a later chunk of a chunked prefill

        return sdpa_causal_offset(q, k, v, dense_start, scale=scale)
    from .flex import flex_attention_op

    return flex_attention_op(q, k, v, q_slot, q_doc, k_doc, window, scale, dense_start)


from .attend import attend  # noqa: E402  (it calls `attention`, defined above)

__all__ += ["attend"]
