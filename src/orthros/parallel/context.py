"""Context-parallel prefill and decoding of an Orthros model over processes.

The prompt [B, T] is cut into contiguous shards, one per rank. Every rank runs
the model's own forward (`OrthrosModel.forward`: the same blocks, attention,
residuals and MLP as one process) over its shard, with a `ShardedCache` that
holds its shard of every layer's K/V and supplies the communication. The
layers write to it as to any cache; `ops.attend` reads what it returns
(`ops.kv.ShardedKV`):

    base stream   (prefill) the rows are this rank's shard. SWA needs only the
                  W - 1 keys before the shard: a halo from the previous
                  rank(s) (`halo_exchange`), then the ordinary attention op on
                  [halo, shard]. No ring: communication O(W) per rank and layer.
    output stream one row (the last prompt token), replicated on every rank:
                  each rank attends its query to its own keys
                  (`ops.lse.partial_attention`) and one all-gather of (o, lse)
                  merges the partials (`gather_merge`). Its residual and MLP
                  run on every rank, so the query never has to be broadcast.

What this module adds to the model is only where rows live and how ranks
talk; no block math:

    _shard_layout  the whole prompt's `Layout` (every rank holds the token
                   ids) with its base rows cut to the shard; slots stay global.
    _last_token    the model's `take_outputs`: rows at the output position
                   (the output stream's embedding; for the baselines, the last
                   layer's input; for a MoE layer routing output rows by their
                   base row, that row's experts and weights) are the last prompt
                   token's, held by the last rank and broadcast from it (one
                   [B, 1, C] or [B, 1, k] message).
    ShardedCache   storage, halo and merge (`parallel/comm.py`), read by
                   `ops.attend`.

The halo and the merge are collectives, so every rank must read the same
groups of rows in the same order, and the replicated output rows must come
out bitwise alike on every rank. The shard's layout says so (`Layout.shard`)
and the model keeps it: the same layers and groups run on every rank, a
shard's two streams never join into one group (a one-token shard would
otherwise compute its last layer's base row, the only rank to ask for that
layer's halo), and never share a GEMM (the output row's rounding would then
depend on the shard's length). A long shard's MLP runs in row chunks
(`models.block.MLP_CHUNK`), as in any long forward without autograd.

Decoding continues on the sharded cache with the model's decode step: the new
token's (base, output) pair is replicated on every rank and runs as one group;
its K/V are stored on the last rank, and both of its queries (the base query
with its window, the output query over all keys) fan out to every shard and
merge in one all-gather per layer. So the window may span any number of
shards, and the last shard may be shorter than W - 1.

The baselines run in the same code: `attention="swa"` exactly as above, and
`"full"` with a halo that is the whole prefix (all-gather context
parallelism; its causal cost grows along the sequence, see
`balanced_bounds`).

Exact: logits equal the single-process `prefill` / `decode_one_token` up to
floating-point rounding. Inference only (no autograd through the exchange).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.distributed as dist

from ..generate import SamplingConfig, sample
from ..models.layout import Layout, build_layout
from ..ops.kv import DenseKV, ShardedKV
from .comm import CPGroup, all_gather, gather_merge, halo_exchange, shard_bounds


class ShardedCache:
    """This rank's part of an Orthros KV cache: global slots [start, start + n). Implements
    `models.kv.KVCache`; a layer's write returns `ops.kv.ShardedKV`.

    keys / values: per layer [B, n, Hkv, D]. key_doc [B, S]: the document of every slot of every
    rank (the layout's key axis; 8 bytes a slot); next_pos / last_doc [B] as in `OrthrosCache`;
    all three the same on every rank. `prefilling`: the forward's rows are this rank's shard of
    the prompt (stored here; their base stream reads a halo); after the prefill, rows are
    replicated on every rank and their slots are stored on the last rank.
    """

    reference_reads = False

    def __init__(self, num_layers: int, cp: CPGroup, window: int | None, sinks: int = 0):
        """cp: with the prompt's shards (`CPGroup.with_shards`); window: the base stream's (None: full);
        sinks: its attention sinks, the first slots of the first shard (rows that start at slot 0)."""
        self.num_layers, self.cp = num_layers, cp
        self.sinks = sinks
        self.start = cp.bounds[cp.rank][0]
        self.span = None if window is None else window - 1  # halo slots
        self.keys: list[torch.Tensor | None] = [None] * self.num_layers
        self.values: list[torch.Tensor | None] = [None] * self.num_layers
        self.key_doc = self.next_pos = self.last_doc = None
        self.prefilling = True

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Slots of all ranks."""
        return 0 if self.key_doc is None else self.key_doc.shape[1]

    @property
    def batch_size(self) -> int | None:
        return None if self.key_doc is None else self.key_doc.shape[0]

    @property
    def local_length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[1]

    def append_tokens(self, doc: torch.Tensor, next_pos: torch.Tensor, last_doc: torch.Tensor) -> None:
        """Record the new slots' documents [B, T] (all ranks' slots) and the rows' running state."""
        self.key_doc = doc if self.key_doc is None else torch.cat([self.key_doc, doc], dim=1)
        self.next_pos, self.last_doc = next_pos, last_doc

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> ShardedKV:
        """`models.kv.KVCache.write`: store the new rows' k, v [B, T, Hkv, D] where they belong (prefill:
        every rank its shard; decoding: the last rank) and describe this rank's keys, its halo while
        prefilling, and the merge across ranks."""
        if self.prefilling or self.cp.last:
            if self.keys[layer] is None:
                self.keys[layer], self.values[layer] = k, v
            else:
                self.keys[layer] = torch.cat([self.keys[layer], k], dim=1)
                self.values[layer] = torch.cat([self.values[layer], v], dim=1)
        shard = DenseKV(self.keys[layer], self.values[layer], start=self.start)
        halo = functools.partial(self._halo, k, v) if self.prefilling else None
        return ShardedKV(shard, functools.partial(gather_merge, cp=self.cp), halo,
                         sinks=self.sinks if self.start == 0 else 0)

    def _halo(self, k: torch.Tensor, v: torch.Tensor) -> DenseKV:
        """The shard's k, v after the `span` slots before it (from earlier ranks), after the attention sinks
        below those (from the first rank)."""
        hk, hv = halo_exchange((k, v), self.cp, self.span)
        sinks = self._sink_kv(k, v) if self.sinks else ()
        if hk.shape[1]:
            k, v = torch.cat([hk, k], dim=1), torch.cat([hv, v], dim=1)
        return DenseKV.window(k, v, self.start - hk.shape[1], *sinks)

    def _sink_kv(self, k: torch.Tensor, v: torch.Tensor):
        """The first rank's first `sinks` slots of k, v, on every rank (a broadcast)."""
        S = self.sinks
        kv = torch.cat([k[:, :S], v[:, :S]], -1).contiguous() if self.cp.rank == 0 else \
            k.new_empty(k.shape[0], S, *k.shape[2:-1], k.shape[-1] + v.shape[-1])
        if self.cp.world > 1:
            dist.broadcast(kv, self.cp.global_rank(0), group=self.cp.group)
        return kv[..., :k.shape[-1]], kv[..., k.shape[-1]:]

    def __repr__(self) -> str:
        return (f"ShardedCache(rank={self.cp.rank}/{self.cp.world}, slots=[{self.start}, "
                f"{self.start + self.local_length}) of {self.get_seq_length()})")


def _shard_layout(lay: Layout, a: int, b: int) -> Layout:
    """The whole prompt's layout with its base rows cut to the shard [a, b) (global slots)."""
    return replace(lay, base_slot=lay.base_slot[:, a:b], base_pos=lay.base_pos[:, a:b],
                   base_doc=lay.base_doc[:, a:b], base_dense=None if lay.base_dense is None else lay.base_dense + a,
                   shard=True)


def _last_token(cp: CPGroup, h: torch.Tensor) -> torch.Tensor:
    """The last prompt token's row of a base-stream tensor [B, n, C], on every rank: [B, 1, C],
    broadcast from the last rank (whose shard ends with it)."""
    row = h[:, -1:].contiguous() if cp.last else h.new_empty(h.shape[0], 1, h.shape[-1])
    if cp.world > 1:
        dist.broadcast(row, cp.global_rank(cp.world - 1), group=cp.group)
    return row


# ------------------------------------------------------------------ checks
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
               cp: CPGroup | None = None, shard_sizes=None, bounds=None):
    """Context-parallel prefill of a prompt; the same call on every rank of `cp`.

    Args:
        input_ids: [B, T] the whole prompt, identical on every rank (each rank
            embeds only its shard).
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
    inner = model.model
    attn = inner.layers[0].self_attn
    sinks = attn.sinks if attn.base_window is not None else 0
    if sinks:  # the first shard holds the sinks; every row starts at slot 0
        if bounds[0][1] - bounds[0][0] < min(sinks, T):
            raise ValueError(f"the first shard must hold the model's {sinks} attention sinks, it has "
                             f"{bounds[0][1] - bounds[0][0]} tokens (give it more: shard_sizes)")
        if attention_mask is not None and not bool(attention_mask[:, 0].all()):
            raise ValueError(f"context parallelism keeps the attention sinks (sink_tokens={sinks}) of rows that "
                             "start at the first token: this batch is left-padded (prefill its rows one at a time)")
    cache = ShardedCache(len(inner.layers), cp, attn.base_window, sinks)
    out_idx = torch.full((B, 1), T - 1, dtype=torch.long, device=input_ids.device)
    lay = build_layout(B, T, input_ids.device, out_idx, torch.ones_like(out_idx, dtype=torch.bool), attention_mask)
    cache.append_tokens(lay.base_doc, lay.next_pos, lay.last_doc)
    h = inner.forward_streams(inner.embed_tokens(input_ids[:, a:b]), _shard_layout(lay, a, b), cache,
                              take_outputs=functools.partial(_last_token, cp))
    cache.prefilling = False
    return model.lm_head(h)[:, -1], cache


# ------------------------------------------------------------------ decoding
@torch.no_grad()
def cp_decode_one_token(model, token: torch.Tensor, cache: ShardedCache) -> torch.Tensor:
    """token: [B], the same on every rank -> logits [B, V] of the next token (on every rank).

    The model's decode step on the sharded cache: the token's K/V are appended to the last
    rank's shard; its base query (window W) and output query (all keys) read every shard,
    merged by lse."""
    _check_model(model)
    if token.dim() != 1 or cache.next_pos is None or cache.batch_size != token.shape[0]:
        raise ValueError(f"token must be [batch] matching the cache's batch; got shape {tuple(token.shape)}")
    B = token.shape[0]
    one = torch.zeros(B, 1, dtype=torch.long, device=token.device)
    lay = build_layout(B, 1, token.device, one, torch.ones_like(one, dtype=torch.bool), cache=cache)
    cache.append_tokens(lay.base_doc, lay.next_pos, lay.last_doc)
    h = model.model.forward_streams(model.model.embed_tokens(token[:, None]), lay, cache)
    return model.lm_head(h)[:, -1]


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
