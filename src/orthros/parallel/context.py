"""Context-parallel prefill and decoding of an Orthros model over processes.

The prompt [B, T] is cut into contiguous shards, one per rank; every rank
runs the whole stack of layers on its shard and keeps its shard of every
layer's KV cache (`ShardedCache`). Per layer:

    base stream   SWA needs only the W - 1 keys before the shard: a halo
                  from the previous rank(s) (`halo_exchange`), then local
                  attention. No ring: communication O(W) per rank and layer.
    output stream one token (the last prompt token), replicated on every
                  rank: each rank attends its query to its own keys and one
                  all-gather of (o, lse) merges the partials (`gather_merge`).
                  Residual and MLP of that token run on every rank, so the
                  query never has to be broadcast.

Decoding continues on the sharded cache: the new token's (base, output) pair
is replicated on every rank, its K/V are appended on the last rank, and both
of its queries (the base query with its window, the output query over all
keys) fan out to every shard and merge in one all-gather per layer. So the
window may span any number of shards, and the last shard may be shorter
than W - 1.

The baselines run in the same code: `attention="swa"` exactly as above, and
`"full"` with a halo that is the whole prefix (all-gather context
parallelism; its causal cost grows along the sequence, see
`balanced_bounds`). Their last layer reads the last token's hidden state,
broadcast from the last rank.

Exact: logits equal the single-process `prefill` / `decode_one_token` up to
floating-point rounding. Inference only (no autograd through the exchange).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..generate import SamplingConfig, sample
from ..models.layout import build_layout
from ..ops import _interpreting, attention
from ..ops.splitkv import splitkv_takes
from ..ops.kv import DenseKV
from ..ops.lse import lse_merge
from ..ops.naive import naive_attention
from .comm import CPGroup, all_gather, gather_merge, halo_exchange, shard_bounds

MLP_CHUNK = 1 << 16  # rows per MLP call: bounds the [rows, intermediate] activations
KEY_CHUNK = 1 << 15  # keys per reference-op call in the CPU / no-Triton path


class ShardedCache:
    """This rank's part of an Orthros KV cache: global slots [start, start + n). Implements
    `models.kv.KVCache` (`write`).

    keys / values: per layer [B, n, Hkv, D]; key_doc: [B, n]. `total` counts the
    slots of all ranks; next_pos / last_doc ([B]) are the same on every rank.
    Slots appended by decoding are stored on the last rank.
    """

    def __init__(self, num_layers: int, start: int, cp: CPGroup):
        self.num_layers, self.start, self.cp = num_layers, start, cp
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.key_doc: torch.Tensor | None = None
        self.total = 0
        self.next_pos: torch.Tensor | None = None
        self.last_doc: torch.Tensor | None = None

    def get_seq_length(self) -> int:
        return self.total

    @property
    def local_length(self) -> int:
        return 0 if self.key_doc is None else self.key_doc.shape[1]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k, v
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=1)
            self.values[layer] = torch.cat([self.values[layer], v], dim=1)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> DenseKV:
        """`models.kv.KVCache.write`: append k, v [B, T, Hkv, D] (new slots live on the rank that
        holds them: prefill, every rank its shard; decoding, the last rank); return this rank's
        keys, whose key 0 is global slot `start`. Other ranks' keys are reached by merging
        partial results (`gather_merge`), not by the read."""
        if k.shape[1]:
            self.append(layer, k, v)
        return DenseKV(self.keys[layer], self.values[layer], start=self.start)

    def __repr__(self) -> str:
        return (f"ShardedCache(rank={self.cp.rank}/{self.cp.world}, slots=[{self.start}, "
                f"{self.start + self.local_length}) of {self.total})")


# ------------------------------------------------------------------ pieces
def _kv(attn, x, rope):
    """Base-stream keys (k-norm, RoPE) and values of x [B, T, C]: [B, T, Hkv, D] each."""
    return attn.keys_values(x, *rope)


def _mlp_residual(block, h, chunk: int = MLP_CHUNK):
    """h + MLP(norm(h)), in row chunks (in place) so long shards fit in memory."""
    if h.shape[1] <= chunk:
        return h + block.mlp(block.post_attention_layernorm(h))
    for s in range(0, h.shape[1], chunk):
        x = h[:, s:s + chunk]
        x += block.mlp(block.post_attention_layernorm(x))
    return h


def partial_attention(q, k, v, q_slot, q_doc, k_doc, window=None, key_chunk: int = KEY_CHUNK):
    """Attention of a few queries over this rank's keys only: (o [B, M, H, D], lse [B, M, H]).

    Slots are local (key i of k is slot i). Keys before every query's window are
    skipped; a rank none of whose keys is visible returns lse = -inf (weight 0)."""
    B, M, H, D = q.shape
    if window is not None and k.shape[1]:
        lo = max(0, int(q_slot.min()) - window + 1)
        k, v, k_doc, q_slot = k[:, lo:], v[:, lo:], k_doc[:, lo:], q_slot - lo
    S = k.shape[1]
    if S == 0:
        return q.new_zeros(B, M, H, D, dtype=torch.float32), q.new_full((B, M, H), float("-inf"), dtype=torch.float32)
    if splitkv_takes(q, k.shape[2], "triton" if _interpreting() else "auto"):  # the interpreter runs it on CPU (tests)
        from ..ops.splitkv import splitkv_attention

        return splitkv_attention(q.contiguous(), k, v, q_slot, q_doc, k_doc, window=window, return_lse=True)
    os_, lses = [], []
    for s in range(0, S, key_chunk):  # the reference op on key blocks, merged like shards
        e = s + key_chunk
        o, lse = naive_attention(q, k[:, s:e], v[:, s:e], q_slot - s, q_doc, k_doc[:, s:e], window=window,
                                 return_lse=True)
        os_.append(o.float())
        lses.append(lse)
    if len(os_) == 1:
        return os_[0], lses[0]
    return lse_merge(torch.stack(os_), torch.stack(lses))


def _check_same_prompt(input_ids, cp: CPGroup):
    """Every rank must hold the same prompt: compare shape and a checksum."""
    if cp.world == 1:
        return
    ids = input_ids.long()
    w = torch.arange(1, ids.numel() + 1, device=ids.device).view_as(ids) % 65521
    meta = torch.stack([torch.tensor(ids.shape[0], device=ids.device), torch.tensor(ids.shape[1], device=ids.device),
                        (ids * w).sum() % 2147483647])
    every = meta.new_empty((cp.world * 3,))  # gloo wants the rank-concatenated form
    all_gather(every, meta, group=cp.group)
    every = every.view(cp.world, 3)
    if not bool((every == every[0]).all()):
        raise ValueError("input_ids must be the same whole prompt on every rank of the context-parallel group; "
                         f"got (batch, length, checksum) {every.tolist()}")


def _check_model(model):
    if model.training:
        raise ValueError("context-parallel prefill is inference only: call model.eval() first")


# ------------------------------------------------------------------ prefill
@torch.no_grad()
def cp_prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               cp: CPGroup | None = None, shard_sizes=None, bounds=None, mlp_chunk: int = MLP_CHUNK):
    """Context-parallel prefill of a prompt; the same call on every rank of `cp`.

    Args:
        input_ids: [B, T] the whole prompt, identical on every rank (each rank
            embeds only its shard, and the last token for the output stream).
        attention_mask: [B, T], 0 marks padding (as in `generate.prefill`).
        cp: the context-parallel group (default: the whole world).
        shard_sizes: tokens per rank (default even); or `bounds` [(start, end)].
    Returns:
        (logits [B, V] of the last prompt token, on every rank; this rank's `ShardedCache`).
    """
    _check_model(model)
    cp = cp or CPGroup()
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, seq] with seq >= 1, got shape {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    if attention_mask is not None and tuple(attention_mask.shape) != (B, T):
        raise ValueError(f"attention_mask must be [{B}, {T}] like input_ids, got {tuple(attention_mask.shape)}")
    _check_same_prompt(input_ids, cp)
    bounds = shard_bounds(T, cp.world, shard_sizes) if bounds is None else shard_bounds(
        T, cp.world, [b - a for a, b in bounds])
    cp = cp.with_shards(bounds)
    a, b = bounds[cp.rank]
    n, dev = b - a, input_ids.device
    inner, cfg = model.model, model.config
    two_streams = cfg.has_output_stream

    out_idx = torch.full((B, 1), T - 1, dtype=torch.long, device=dev)
    lay = build_layout(B, T, dev, out_idx, torch.ones_like(out_idx, dtype=torch.bool), attention_mask)
    dense = attention_mask is None or bool(attention_mask.bool().all())
    base_window = inner.layers[0].self_attn.base_window
    span = None if base_window is None else base_window - 1
    h = a if span is None else min(span, a)  # halo length: slots [a - h, a)

    embed = inner.embed_tokens
    dtype = embed.weight.dtype
    rope_b = inner.rotary(lay.base_pos[:, a:b], dtype)
    rope_o = inner.rotary(lay.out_pos, dtype)
    q_slot_b = (h + torch.arange(n, device=dev))[None]
    doc_b, kdoc_ext, kdoc_loc = lay.base_doc[:, a:b], lay.key_doc[:, a - h:b], lay.key_doc[:, a:b]
    out_slot = lay.out_slot - a  # local slot of the output token (>= n on earlier ranks: sees all their keys)

    cache = ShardedCache(len(inner.layers), a, cp)
    hb = embed(input_ids[:, a:b])
    ho = embed(input_ids[:, T - 1:]) if two_streams else None
    L = len(inner.layers)
    for i, block in enumerate(inner.layers):
        attn, last = block.self_attn, i == L - 1
        xb = block.input_layernorm(hb)
        k, v = _kv(attn, xb, rope_b)
        cache.write(i, k, v)
        if not last:
            qb = attn._queries(attn.q_proj(xb), "base", *rope_b)
            hk, hv = halo_exchange((k, v), cp, span)
            kx, vx = torch.cat([hk, k], dim=1), torch.cat([hv, v], dim=1)
            ob = attention(qb, kx, vx, q_slot_b, doc_b, kdoc_ext, window=base_window, backend=attn.backend,
                           dense_start=h if dense else None)
            hb = _mlp_residual(block, hb + attn.o_proj(ob.flatten(2)), mlp_chunk)
            del qb, hk, hv, kx, vx, ob
        if last and not two_streams:  # baselines: the last layer at the last token, owned by the last rank
            ho = hb[:, -1:].contiguous() if cp.last else hb.new_empty(B, 1, hb.shape[-1])
            if cp.world > 1:
                dist.broadcast(ho, cp.global_rank(cp.world - 1), group=cp.group)
        if ho is not None:
            xo = block.input_layernorm(ho)
            qo = attn._queries(attn.q_proj(xo), "out", *rope_o)
            o, lse = partial_attention(qo, k, v, out_slot, lay.out_doc, kdoc_loc, window=attn.out_window)
            oo = gather_merge(o, lse, cp).to(ho.dtype)
            ho = _mlp_residual(block, ho + attn.o_proj(oo.flatten(2)), mlp_chunk)
    cache.key_doc = kdoc_loc
    cache.total, cache.next_pos, cache.last_doc = T, lay.next_pos, lay.last_doc
    logits = model.lm_head(inner.norm(ho))[:, -1]
    return logits, cache


# ------------------------------------------------------------------ decoding
@torch.no_grad()
def cp_decode_one_token(model, token: torch.Tensor, cache: ShardedCache) -> torch.Tensor:
    """token: [B], the same on every rank -> logits [B, V] of the next token (on every rank).

    The token's K/V are appended to the last rank's shard; its base query
    (window W) and output query (all keys) read every shard, merged by lse."""
    _check_model(model)
    cp, inner, cfg = cache.cp, model.model, model.config
    two_streams = cfg.has_output_stream
    B = token.shape[0]
    if cache.next_pos is None or cache.next_pos.shape[0] != B:
        raise ValueError(f"token must be [batch] matching the cache's batch; got shape {tuple(token.shape)}")
    pos = cache.next_pos[:, None]
    doc = cache.last_doc.clamp_min(0)[:, None]  # same rule as build_layout for a real token after the cache
    slot = cache.total - cache.start  # the new token's local slot
    q_slot = torch.full((1, 1), slot, dtype=torch.long, device=token.device)
    if cp.last:
        cache.key_doc = torch.cat([cache.key_doc, doc], dim=1)
    dtype = inner.embed_tokens.weight.dtype
    rope = inner.rotary(pos, dtype)
    hb = inner.embed_tokens(token[:, None])
    ho = hb if two_streams else None
    L = len(inner.layers)
    for i, block in enumerate(inner.layers):
        attn, last = block.self_attn, i == L - 1
        xb = block.input_layernorm(hb)
        k, v = _kv(attn, xb, rope)
        kv = cache.write(i, k, v) if cp.last else cache.write(i, k[:, :0], v[:, :0])  # the new slot: last rank
        keys, values = kv.k, kv.v
        if last and not two_streams:
            ho = hb  # baselines: the last layer at this token (replicated already)
        parts = []
        if not last:
            qb = attn._queries(attn.q_proj(xb), "base", *rope)
            parts.append(partial_attention(qb, keys, values, q_slot, doc, cache.key_doc, window=attn.base_window))
        if ho is not None:
            qo = attn._queries(attn.q_proj(block.input_layernorm(ho)), "out", *rope)
            parts.append(partial_attention(qo, keys, values, q_slot, doc, cache.key_doc, window=attn.out_window))
        merged = gather_merge(torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1), cp)
        merged = merged.to(hb.dtype).flatten(2)
        if not last:
            hb = _mlp_residual(block, hb + attn.o_proj(merged[:, :1]))
        if ho is not None:
            ho = _mlp_residual(block, ho + attn.o_proj(merged[:, -1:]))
    cache.total += 1
    cache.next_pos, cache.last_doc = cache.next_pos + 1, torch.maximum(cache.last_doc, doc[:, 0])
    return model.lm_head(inner.norm(ho))[:, -1]


@torch.no_grad()
def cp_generate(model, input_ids: torch.Tensor, max_new_tokens: int = 32, cp: CPGroup | None = None,
                attention_mask: torch.Tensor | None = None, shard_sizes=None, temperature: float = 0.0,
                top_k: int | None = None, top_p: float | None = None, stop_tokens: list[int] | int | None = None,
                seed: int | None = None, pad_token_id: int | None = None):
    """Context-parallel prefill, then decoding on the sharded cache; the same call on every rank.

    Like `generate.generate` (left-padded [B, T] prompts with `attention_mask`,
    greedy or sampled, stop tokens). Rank 0 samples and broadcasts each token,
    so every rank continues the same sequence. Returns [B, T + n] on every rank.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    cfg = SamplingConfig(temperature, top_k, top_p)
    cp = cp or CPGroup()
    dev = input_ids.device
    pad = pad_token_id if pad_token_id is not None else (model.config.pad_token_id or 0)
    stops = torch.tensor([stop_tokens] if isinstance(stop_tokens, int) else (stop_tokens or []), device=dev)
    gen = None
    if seed is not None:
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed)
    logits, cache = cp_prefill(model, input_ids, attention_mask, cp=cp, shard_sizes=shard_sizes)
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=dev)
    out = []
    for step in range(max_new_tokens):
        tok = torch.where(done, pad, sample(logits, cfg, gen))
        if cp.world > 1:
            dist.broadcast(tok, cp.global_rank(0), group=cp.group)
        out.append(tok)
        done = done | torch.isin(tok, stops)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        logits = cp_decode_one_token(model, tok, cache)
    return torch.cat([input_ids, torch.stack(out, 1)], 1) if out else input_ids
