"""OrthrosAttention: shared Q/K/V/O projections, per-stream scale-offset (SO).

The base stream (every position) makes queries, keys and values and attends
with a sliding window (`attention="orthros"` / `"swa"`) or causally
(`"full"`). The output stream (output positions only) makes queries only and
attends to the whole KV cache. When both streams are short (decoding: one
base and one output row per sequence) they go through `q_proj` / `o_proj`
as one batched GEMM; long streams are projected separately, which costs the
same GEMM time and saves copying the base stream.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..ops import attend, naive_attention
from ..ops.kv import DenseKV
from .mlp import RMSNorm
from .fused import fused_heads


CONCAT_MAX_ROWS = 64  # above this, a concatenation's copy costs more than a second GEMM launch


def rows(fn, a: torch.Tensor | None, b: torch.Tensor | None):
    """Apply a row-wise `fn` to two [B, *, C] tensors; short ones in one call (concatenated on dim 1)."""
    if a is None or b is None or a.shape[1] + b.shape[1] > CONCAT_MAX_ROWS:
        return (None if a is None else fn(a)), (None if b is None else fn(b))
    out = fn(torch.cat([a, b], dim=1))
    return out[:, : a.shape[1]], out[:, a.shape[1]:]


class OrthrosAttention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.backend = c.attn_backend
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * self.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # SO exists only where there are two streams to tell apart.
        self.scale_offset = c.attention == "orthros" and c.scale_offset
        if self.scale_offset:
            n = self.n_heads * self.head_dim
            self.so_alpha = nn.Parameter(torch.ones(n))
            self.so_beta = nn.Parameter(torch.zeros(n))
            self.so_alpha_out = nn.Parameter(torch.ones(n))
            self.so_beta_out = nn.Parameter(torch.zeros(n))
        self._pair_so_rows: dict = {}  # (T, R) -> the pair path's per-row SO (_pair_so)
        self._pair_so_params = None  # the parameters' identity those rows were made from
        self.base_window = None if c.attention == "full" else c.window_size
        self.out_window = c.window_size if c.attention == "swa" else None

    def _queries(self, q, stream: str, cos, sin):
        """q: [B, M, H*D] raw projection -> SO -> heads -> q-norm -> RoPE: [B, M, H, D]."""
        so = (None, None)
        if self.scale_offset:
            so = (self.so_alpha, self.so_beta) if stream == "base" else (self.so_alpha_out, self.so_beta_out)
        return self._heads(q, cos, sin, self.n_heads, so, self.q_norm)

    def _heads(self, x, cos, sin, n_heads: int, so=(None, None), norm=None):
        """[B, M, n_heads * D] projection -> SO -> heads -> head norm -> RoPE, as one fused op."""
        w, eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
        return fused_heads(x, cos, sin, n_heads, self.head_dim, *so, w, eps)

    def keys_values(self, x, cos, sin):
        """x: [B, T, C] normed base stream -> k (k-norm, RoPE), v: [B, T, Hkv, D]."""
        k = self._heads(self.k_proj(x), cos, sin, self.n_kv, norm=self.k_norm)
        return k, self.v_proj(x).unflatten(-1, (self.n_kv, self.head_dim))

    def _write(self, cache, k, v):
        """The new base tokens' k, v [B, T, Hkv, D] -> what attention reads: the cache's description
        of its storage after the write (`models.kv.KVCache`), or these K/V alone."""
        return DenseKV(k, v) if cache is None else cache.write(self.layer_idx, k, v)

    def _pair_so(self, T: int, R: int):
        """SO's (alpha, beta) per row of a decode pair [R, H*D]: the base stream's for the T
        base rows, the output stream's for the rest. Without autograd they are made once per
        shape (and per parameter version) and kept: a captured decode graph then reads them
        instead of concatenating them again at every replay (which also keeps them alive for
        the graph)."""
        params = (self.so_alpha, self.so_alpha_out, self.so_beta, self.so_beta_out)

        def make():
            return tuple(torch.cat([p.expand(T, -1), p_out.expand(R - T, -1)])
                         for p, p_out in ((params[0], params[1]), (params[2], params[3])))

        if torch.is_grad_enabled() or torch.compiler.is_compiling() or any(p.is_inference() for p in params):
            return make()  # (inference tensors keep no version to tell a change by)
        ident = tuple((p.data_ptr(), p.dtype, p._version) for p in params)
        if self._pair_so_params != ident:  # changed parameters: drop every kept shape
            self._pair_so_rows, self._pair_so_params = {}, ident
        so = self._pair_so_rows.get((T, R))
        if so is None:
            so = self._pair_so_rows[(T, R)] = make()
        return so

    def _forward_pair(self, x, layout, rope, rope_base, cache=None):
        """Both streams as one tensor x [B, T + N, C], base rows first (a decode step): one
        projection, one SO/RoPE kernel and, where the cache's kernel takes both windows,
        one attention launch for the two. -> [B, T + N, C]."""
        B, R, _ = x.shape
        T = layout.base_slot.shape[1]
        q = self.q_proj(x)
        kv = self._write(cache, *self.keys_values(x[:, :T], *rope_base))
        so = self._pair_so(T, R) if self.scale_offset else (None, None)
        q = self._heads(q, *rope, self.n_heads, so, self.q_norm)
        if self.out_window is None:  # one call; one launch where the kernel takes both windows
            slot = torch.cat([layout.base_slot.expand(B, T), layout.out_slot], 1)
            doc = torch.cat([layout.base_doc, layout.out_doc], 1)
            o = attend(q, kv, slot, doc, layout.key_doc, window=self.base_window, backend=self.backend,
                       dense_start=(layout.base_dense, layout.out_dense), window_rows=T, base_rows=T)
        else:
            ob = attend(q[:, :T], kv, layout.base_slot, layout.base_doc, layout.key_doc, window=self.base_window,
                        backend=self.backend, dense_start=layout.base_dense, base_rows=T)
            oo = attend(q[:, T:], kv, layout.out_slot, layout.out_doc, layout.key_doc, window=self.out_window,
                        backend=self.backend, dense_start=layout.out_dense)
            o = torch.cat([ob, oo], 1)
        return self.o_proj(o.flatten(2))

    def forward(self, xb, xo, layout, rope_base, rope_out, cache=None, skip_base: bool = False, pair_rope=None,
                probs: list | None = None):
        """
        Args:
            xb: [B, T, C] normed base stream (always needed: it makes K/V).
            xo: [B, N, C] normed output stream, or None.
            layout: the batch's `Layout` (slots, documents, positions).
            rope_base / rope_out: (cos, sin) at base / output positions.
            cache: a `models.kv.KVCache` to write K/V to and read the past from.
            skip_base: compute K/V only (the last layer's base stream is never read).
            pair_rope: (cos, sin) of both streams' rows: xb then holds both streams as one
                tensor [B, T + N, C] (base rows first), xo is None, and so is the second output.
            probs: a list: both streams then run the reference op, which appends each
                stream's attention probabilities [B, H, M, S] (base first, if computed).
        Returns:
            (ob [B, T, C] or None, oo [B, N, C] or None)
        """
        if pair_rope is not None:
            return self._forward_pair(xb, layout, pair_rope, rope_base, cache), None
        B, T, _ = xb.shape
        qb, qo = rows(self.q_proj, None if skip_base else xb, xo)
        kv = self._write(cache, *self.keys_values(xb, *rope_base))
        attend_ = attend
        if probs is not None:
            attend_ = functools.partial(_reference_attention, probs)
        ob = oo = None
        if qb is not None:
            qb = self._queries(qb, "base", *rope_base)
            ob = attend_(qb, kv, layout.base_slot, layout.base_doc, layout.key_doc, window=self.base_window,
                         backend=self.backend, dense_start=layout.base_dense, base_rows=qb.shape[1]).flatten(2)
        if qo is not None:
            qo = self._queries(qo, "out", *rope_out)
            oo = attend_(qo, kv, layout.out_slot, layout.out_doc, layout.key_doc, window=self.out_window,
                         backend=self.backend, dense_start=layout.out_dense).flatten(2)
        return rows(self.o_proj, ob, oo)


def _reference_attention(probs: list, q, kv: DenseKV, q_slot, q_doc, k_doc, window=None, backend=None,
                         dense_start=None, base_rows=0):
    """`ops.attend`'s signature on the reference op over dense K/V (`OrthrosCache`, or none); appends the
    probabilities [B, H, M, S] to `probs`."""
    o, p = naive_attention(q, kv.k, kv.v, q_slot, q_doc, k_doc, window=window, return_probs=True)
    probs.append(p)
    return o
