"""Merging partial attention results by their log-sum-exps.

Attention over a key set split into disjoint parts is exact from each part's
softmax-normalised output and log-sum-exp: the split-KV kernel's splits, a
prefill chunk's past keys and causal block (`dense.sdpa_causal_offset`), the
shards of a context-parallel cache (`orthros.parallel`).
"""

from __future__ import annotations

import torch


def lse_merge(o, lse: torch.Tensor):
    """o: R partials [..., D] (a stacked tensor [R, ..., D] or a sequence), lse [R, ...]
    (natural log-sum-exp of each part's scaled scores) -> (o [..., D] fp32, lse [...]).
    Rows that see no key in any part get 0 and -inf. One fp32 partial at a time is
    materialised: no [R, ..., D] product."""
    top = lse.amax(0, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(lse - top)  # 0 for parts that see nothing
    total = w.sum(0)
    out = None
    for r in range(len(o)):
        term = o[r].to(torch.float32, copy=True).mul_(w[r][..., None])
        out = term if out is None else out.add_(term)
    out.div_(torch.where(total > 0, total, torch.ones_like(total))[..., None])
    return out, torch.log(total) + top[0]
