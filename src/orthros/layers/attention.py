"""OrthrosAttention: shared Q/K/V/O projections, per-stream scale-offset (SO).

The base stream (every position) makes queries, keys and values and attends
with a sliding window (`attention="orthros"` / `"swa"`) or causally
(`"full"`). The output stream (output positions only) makes queries only and
attends to the whole KV cache. One forward for every phase: the rows arrive
as groups, each group's leading rows base rows (`forward`). When both streams
are short (decoding: one base and one output row per sequence) the model
passes them as one group and every projection, SO/RoPE kernel and attention
call runs once for the two; otherwise short groups still share one GEMM
(`rows`), and long ones are projected apart, which costs the same GEMM time
and saves copying the base stream.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..ops import attend, naive_attention
from ..ops.kv import DenseKV
from ..ops.tracing import exporting
from .mlp import RMSNorm
from .fused import fused_heads


CONCAT_MAX_ROWS = 64  # above this, a concatenation's copy costs more than a second GEMM launch


def rows(fn, xs: list, apart: bool = False) -> list:
    """Apply a row-wise `fn` to [B, *, C] tensors; short ones in one call (concatenated on dim 1)
    unless `apart` (`Layout.shard`). Under torch.export always apart: a program traced with a
    dynamic length then holds for every length, not only for those on the sample's side of
    `CONCAT_MAX_ROWS`."""
    if (apart or len(xs) < 2 or exporting()
            or sum(x.shape[1] for x in xs) > CONCAT_MAX_ROWS):
        return [fn(x) for x in xs]
    out = fn(torch.cat(xs, dim=1))
    return list(out.split([x.shape[1] for x in xs], dim=1))


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
        # SO exists only where there are two streams to tell apart. The last layer's base stream
        # makes K/V only (its queries are never computed for a result), so that layer has no base
        # SO: a parameter outside every forward would get no gradient (DDP without
        # find_unused_parameters fails on one). Checkpoints that hold it load without it
        # (`models.model.unused_checkpoint_tensor`).
        self.scale_offset = c.attention == "orthros" and c.scale_offset
        self.base_so = self.scale_offset and layer_idx < c.num_hidden_layers - 1
        if self.scale_offset:
            n = self.n_heads * self.head_dim
            if self.base_so:
                self.so_alpha = nn.Parameter(torch.ones(n))
                self.so_beta = nn.Parameter(torch.zeros(n))
            self.so_alpha_out = nn.Parameter(torch.ones(n))
            self.so_beta_out = nn.Parameter(torch.zeros(n))
        self._so_rows_kept: dict = {}  # (T, R) -> a two-stream group's per-row SO (`_so_rows`)
        self._so_rows_params = None  # the parameters' identity those rows were made from
        self.base_window = None if c.attention == "full" else c.window_size
        self.out_window = c.window_size if c.attention == "swa" else None
        self.sinks = c.sink_tokens  # the windows also see each document's first tokens

    def _queries(self, q, stream: str, cos, sin):
        """q: [B, M, H*D] raw projection -> SO -> heads -> q-norm -> RoPE: [B, M, H, D]."""
        so = (None, None)
        if self.scale_offset:
            if stream == "base" and not self.base_so:
                raise ValueError(f"layer {self.layer_idx} is the last: its base stream makes keys and values only")
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

    def _so_rows(self, T: int, R: int):
        """SO's (alpha, beta) per row of a group of R rows whose first T are base rows [R, H*D]:
        the base stream's for those, the output stream's for the rest. Without autograd they are
        made once per shape (and per parameter version) and kept: a captured decode graph then
        reads them instead of concatenating them again at every replay (which also keeps them
        alive for the graph).

        The last layer has no base SO: its base rows in such a group (a decode step's) only make
        K/V, which SO does not touch, and their attention output is dropped; the output stream's
        vectors serve every row."""
        if T == 0 or not self.base_so:  # one stream: its vectors as they are
            return self.so_alpha_out, self.so_beta_out
        params = (self.so_alpha, self.so_alpha_out, self.so_beta, self.so_beta_out)
        if T == R:
            return params[0], params[2]

        def make():
            return tuple(torch.cat([p.expand(T, -1), p_out.expand(R - T, -1)])
                         for p, p_out in ((params[0], params[1]), (params[2], params[3])))

        if torch.is_grad_enabled() or torch.compiler.is_compiling() or any(p.is_inference() for p in params):
            return make()  # (inference tensors keep no version to tell a change by)
        ident = tuple((p.data_ptr(), p.dtype, p._version) for p in params)
        if self._so_rows_params != ident:  # changed parameters: drop every kept shape
            self._so_rows_kept, self._so_rows_params = {}, ident
        so = self._so_rows_kept.get((T, R))
        if so is None:
            so = self._so_rows_kept[(T, R)] = make()
        return so

    def _attend_group(self, q, n_base: int, kv, layout, attend_):
        """One group's queries q [B, R, H, D], its first n_base rows base rows -> [B, R, H, D]."""
        B, R = q.shape[:2]
        base = dict(backend=self.backend, sinks=self.sinks)
        if n_base == 0:
            return attend_(q, kv, layout.out_slot, layout.out_doc, layout.key_doc, window=self.out_window,
                           dense_start=layout.out_dense, **base)
        if n_base == R:
            return attend_(q, kv, layout.base_slot, layout.base_doc, layout.key_doc, window=self.base_window,
                           dense_start=layout.base_dense, base_rows=R, **base)
        T = n_base
        if self.out_window is None:  # one call: one launch where the kernel takes both windows
            # (slots and documents joined once a step, or per group: concatenated only where one launch
            # takes both)
            slot, doc = layout.joined_rows or ((layout.base_slot, layout.out_slot), (layout.base_doc, layout.out_doc))
            return attend_(q, kv, slot, doc, layout.key_doc, window=self.base_window, window_rows=T, base_rows=T,
                           dense_start=(layout.base_dense, layout.out_dense), **base)
        return torch.cat([self._attend_group(q[:, :T], T, kv, layout, attend_),
                          self._attend_group(q[:, T:], 0, kv, layout, attend_)], 1)

    def forward(self, xs: list, n_base: list, layout, ropes: list, rope_base, cache=None, skip_base: bool = False,
                probs: list | None = None) -> list:
        """
        Args:
            xs: the forward's normed rows as groups [B, R_i, C]: group i's first n_base[i] rows are
                base-stream rows, the rest output rows. The base rows are all in group 0: the base
                stream [B, T, C] then the output stream [B, N, C]; or both streams as one tensor
                [B, T + N, C] (short streams, a decode step: each projection, SO/RoPE kernel and
                attention call then runs once for the two).
            layout: the batch's `Layout` (slots, documents, positions).
            ropes: (cos, sin) at each group's rows; rope_base: at the base rows (for the keys).
            cache: a `models.kv.KVCache` to write K/V to and read the past from.
            skip_base: compute K/V only for a group of base rows alone (the last layer's base stream
                is never read); its output is None.
            probs: a list: attention then runs the reference op, which appends each group's
                attention probabilities [B, H, M, S] (base first, if computed).
        Returns:
            one [B, R_i, C] (or None) per group
        """
        T = n_base[0]
        live = [i for i, x in enumerate(xs) if not (skip_base and 0 < n_base[i] == x.shape[1])]
        qs = rows(self.q_proj, [xs[i] for i in live], layout.shard)
        x0 = xs[0] if T == xs[0].shape[1] else xs[0][:, :T]
        kv = self._write(cache, *self.keys_values(x0, *rope_base))
        attend_ = attend if probs is None else functools.partial(_reference_attention, probs)
        os_ = []
        for i, q in zip(live, qs):
            so = self._so_rows(n_base[i], q.shape[1]) if self.scale_offset else (None, None)
            q = self._heads(q, *ropes[i], self.n_heads, so, self.q_norm)
            os_.append(self._attend_group(q, n_base[i], kv, layout, attend_).flatten(2))
        out = [None] * len(xs)
        for i, o in zip(live, rows(self.o_proj, os_, layout.shard)):
            out[i] = o
        return out


def _reference_attention(probs: list, q, kv: DenseKV, q_slot, q_doc, k_doc, window=None, backend=None,
                         dense_start=None, base_rows=0, sinks=0):
    """`ops.attend`'s signature on the reference op over dense K/V (`OrthrosCache`, or none); appends the
    probabilities [B, H, M, S] to `probs`."""
    o, p = naive_attention(q, kv.k, kv.v, q_slot, q_doc, k_doc, window=window, return_probs=True, sinks=sinks)
    probs.append(p)
    return o
