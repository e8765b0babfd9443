"""Generation: chunked prefill, pair decoding, sampling.

    prefill          — the prompt in chunks; only the last chunk has an output
                       position (its last token), so earlier chunks run the
                       base stream alone and just fill the KV cache.
    decode_one_token — one (base, output) pair per sequence: the base token
                       appends its K/V, the output token reads the whole cache.
    generate         — batched prompts of different lengths (left-padded),
                       greedy or sampled, stop tokens, max_new_tokens.

The fast path (gpt-fast style; `generate(fast=...)`, on by default on CUDA):
a preallocated `StaticOrthrosCache` (bf16 or fp8; `LowBitStaticCache` for int4 /
int2 beyond the window), prefill eager in chunks
sized to bound activation memory, and a decode step with static shapes and
no host sync (`fast_decode_step`: the layout is built from the cache's own
tensors, the model's input checks are skipped — its inputs are trusted),
compiled with mode="reduce-overhead" so each step replays one CUDA graph.
Each step runs a sequence's base/output pair through one batched forward
(the layers concatenate both streams' rows for q_proj, o_proj and the MLP).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .models.cache import OrthrosCache
from .models.layout import Layout
from .models.lowbit_cache import LowBitStaticCache
from .models.static_cache import LOWBIT_KV_DTYPES, StaticOrthrosCache


@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sample(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits: [B, V] -> next tokens [B]."""
    if cfg.temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / cfg.temperature
    if cfg.top_k is not None:
        kth = torch.topk(logits, min(cfg.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p is not None and cfg.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > cfg.top_p  # keep the smallest prefix reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def prefill(model, input_ids, attention_mask=None, cache: OrthrosCache | None = None, chunk_size: int | None = None):
    """Run a prompt [B, T] into `cache`; return the last position's logits [B, V] and the cache."""
    cache = model.new_cache() if cache is None else cache
    T = input_ids.shape[1]
    chunk_size = T if not chunk_size else chunk_size
    past = cache.get_seq_length()
    logits = None
    for start in range(0, T, chunk_size):
        end = min(start + chunk_size, T)
        last = end == T
        keep = 1 if last else torch.empty(0, dtype=torch.long, device=input_ids.device)
        mask = None if attention_mask is None else attention_mask[:, : past + end]
        out = model(input_ids[:, start:end], attention_mask=mask, past_key_values=cache, use_cache=True,
                    logits_to_keep=keep)
        if last:
            logits = out.logits[:, -1]
    return logits, cache


@torch.no_grad()
def decode_one_token(model, token, attention_mask, cache: OrthrosCache):
    """token: [B] -> logits [B, V] for the next token, after appending `token` to the cache."""
    out = model(token[:, None], attention_mask=attention_mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


# ------------------------------------------------------------------ fast path
ACTIVATION_BUDGET = 4 << 30  # bytes of activations one prefill chunk may take (default chunk size)


def auto_chunk_size(config, batch_size: int, dtype: torch.dtype = torch.bfloat16,
                    budget: int = ACTIVATION_BUDGET) -> int:
    """Prefill chunk length whose MLP activations (the largest: gate, up, product
    [B, C, I] plus a few [B, C, hidden] rows) stay within `budget` bytes."""
    per_token = (3 * config.intermediate_size + 6 * config.hidden_size) * torch.finfo(dtype).bits // 8
    return max(1024, budget // (batch_size * per_token) // 1024 * 1024)


def new_static_cache(model, batch_size: int, capacity: int, kv_dtype: str = "auto") -> StaticOrthrosCache:
    """A preallocated cache on the model's device for `capacity` slots per row
    (int4 / int2 / k4v2: a `LowBitStaticCache`)."""
    p = next(model.parameters())
    if kv_dtype in LOWBIT_KV_DTYPES:
        return LowBitStaticCache(model.config, batch_size, capacity, p.device, p.dtype, kv_dtype)
    return StaticOrthrosCache(model.config, batch_size, capacity, p.device, p.dtype, kv_dtype)


def decode_layout(cache: StaticOrthrosCache) -> Layout:
    """The `Layout` of one new token per row at `cache.slot`, from the cache's tensors
    alone (no host sync); also records the token's document in the cache. Equals what
    `build_layout` computes for a decode step (all-ones mask, no position ids)."""
    B = cache.batch_size
    slot = cache.slot.view(1, 1)
    doc = cache.last_doc.clamp_min(0)[:, None]
    pos = cache.next_pos[:, None]
    cache.doc.index_copy_(1, cache.slot, doc)
    return Layout(base_slot=slot, base_pos=pos, base_doc=doc, key_doc=cache.doc, out_idx=torch.zeros_like(pos),
                  out_valid=torch.ones_like(pos, dtype=torch.bool), out_slot=slot.expand(B, 1), out_pos=pos,
                  out_doc=doc, next_pos=cache.next_pos + 1, last_doc=doc[:, 0])


def fast_decode_step(model, token: torch.Tensor, cache: StaticOrthrosCache) -> torch.Tensor:
    """token [B] -> logits [B, V]. Static shapes, no host sync: the function that gets
    captured. Writes the token's K/V at `cache.slot`; `cache.advance()` follows it."""
    layout = decode_layout(cache)
    h = model.model.forward_streams(model.model.embed_tokens(token[:, None]), layout, cache)
    return model.lm_head(h)[:, -1]


@functools.cache
def compiled_decode_step(backend: str = "inductor", mode: str | None = "reduce-overhead"):
    """`fast_decode_step` under torch.compile (one per backend/mode, shared by all models)."""
    from .ops.splitkv.common import triton_available

    triton_available()  # settled before tracing: a global first set inside the graph would recompile it
    return torch.compile(fast_decode_step, backend=backend, mode=mode, fullgraph=True)


@torch.no_grad()
def decode_one_token_fast(model, token: torch.Tensor, cache: StaticOrthrosCache, step=fast_decode_step):
    """One decode step on a `StaticOrthrosCache` with `step` (eager or compiled): logits [B, V]."""
    if cache.length >= cache.capacity:
        raise ValueError(f"the cache is full ({cache.capacity} slots); allocate a larger capacity")
    if step is not fast_decode_step:
        for t in cache.buffers():  # CUDA graphs keep their addresses instead of copying them in
            torch._dynamo.mark_static_address(t)
        torch.compiler.cudagraph_mark_step_begin()
    cache.decoding = True
    try:
        logits = step(model, token, cache)
    finally:
        cache.decoding = False
    cache.advance()
    return logits.clone()  # a captured graph's output is overwritten by its next replay


def left_pad(prompts, pad_id: int, device=None):
    """A list of 1-D token sequences -> (input_ids [B, T], attention_mask [B, T]), left-padded."""
    seqs = [torch.as_tensor(p, dtype=torch.long).flatten() for p in prompts]
    if not seqs or any(s.numel() == 0 for s in seqs):
        raise ValueError("every prompt must hold at least one token")
    T = max(s.numel() for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, T - s.numel():] = s
        mask[i, T - s.numel():] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor | list,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: list[int] | int | None = None,
    seed: int | None = None,
    prefill_chunk_size: int | None = None,
    pad_token_id: int | None = None,
    fast: bool | None = None,
    kv_dtype: str = "auto",
    compile: bool | None = None,
) -> torch.Tensor:
    """Generate continuations.

    Args:
        input_ids: [B, T] (with `attention_mask` marking left padding) or a
            list of 1-D prompts of any lengths (left-padded here).
        stop_tokens: a row stops after emitting one of these; later slots get
            `pad_token_id`.
        seed: makes sampling reproducible (a private generator; global RNG untouched).
        fast: use the static cache + captured decode step (default: on CUDA).
            Its prefill chunk defaults to `auto_chunk_size` (bounded activations).
        kv_dtype: the fast path's cache storage: "auto" (the model's dtype),
            "bf16", "fp16", "fp32", "fp8" (e4m3, per-head scales), or "int4" / "int2" /
            "k4v2" (Orthros models: bf16 for the window and 4 sink tokens, group-wise
            int4 / int2 beyond after a Hadamard rotation, k4v2 = int4 keys and int2
            values; `LowBitStaticCache`, docs/long_context.md).
        compile: compile the fast decode step (default: on CUDA).
    Returns:
        [B, T + n] prompt (left-padded) followed by n <= max_new_tokens new tokens.
    """
    cfg = SamplingConfig(temperature, top_k, top_p)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    device = next(model.parameters()).device
    fast = device.type == "cuda" if fast is None else fast
    compile = fast and device.type == "cuda" if compile is None else compile
    if kv_dtype != "auto" and not fast:
        raise ValueError(f"kv_dtype={kv_dtype!r} needs the fast path (fast=True)")
    pad = pad_token_id if pad_token_id is not None else (model.config.pad_token_id or 0)
    if isinstance(input_ids, (list, tuple)):
        input_ids, attention_mask = left_pad(input_ids, pad, device)
    input_ids = input_ids.to(device)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = attention_mask.to(device)
    stops = torch.tensor([stop_tokens] if isinstance(stop_tokens, int) else (stop_tokens or []), device=device)
    gen = None
    if seed is not None:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        B, T = input_ids.shape
        cache = step = None
        if fast:
            cache = new_static_cache(model, B, T + max(max_new_tokens - 1, 0), kv_dtype)
            prefill_chunk_size = prefill_chunk_size or auto_chunk_size(model.config, B, next(model.parameters()).dtype)
            step = compiled_decode_step() if compile else fast_decode_step
        logits, cache = prefill(model, input_ids, attention_mask, cache=cache, chunk_size=prefill_chunk_size)
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=device)
        out = []
        for i in range(max_new_tokens):
            tok = torch.where(done, pad, sample(logits, cfg, gen))
            out.append(tok)
            done = done | torch.isin(tok, stops)
            if i == max_new_tokens - 1 or (stops.numel() and bool(done.all())):
                break
            if fast:
                logits = decode_one_token_fast(model, tok, cache, step)
                continue
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], dim=1)
            logits = decode_one_token(model, tok, attention_mask, cache)
    finally:
        model.train(was_training)
    if not out:
        return input_ids
    return torch.cat([input_ids, torch.stack(out, dim=1)], dim=1)
