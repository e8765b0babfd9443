"""Attention ops and the dispatcher that picks one per call.

`attention(...)` has the signature of `naive_attention`; the backend is
chosen by name ("naive", "flex", "triton") or "auto". Optional kernels are
imported lazily so that `import orthros` never needs Triton.
"""

from __future__ import annotations

import torch

from .masks import NO_QUERY_DOC, PAD_DOC, visible
from .naive import naive_attention

__all__ = ["attention", "naive_attention", "visible", "PAD_DOC", "NO_QUERY_DOC"]


def attention(q, k, v, q_slot, q_doc, k_doc, window=None, scale=None, backend: str = "auto"):
    """Orthros attention for either stream; see `naive_attention` for shapes."""
    if backend in ("auto", "naive"):
        return naive_attention(q, k, v, q_slot, q_doc, k_doc, window=window, scale=scale)
    raise ValueError(f"attention backend {backend!r} is not available in this build")
