"""Generation: chunked prefill, pair decoding, sampling.

    prefill          — the prompt in chunks; only the last chunk has an output
                       position (its last token), so earlier chunks run the
                       base stream alone and just fill the KV cache.
    decode_one_token — one (base, output) pair per sequence: the base token
                       appends its K/V, the output token reads the whole cache.
    generate         — batched prompts of different lengths (left-padded),
                       greedy or sampled, stop tokens, max_new_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .models.cache import OrthrosCache


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
) -> torch.Tensor:
    """Generate continuations.

    Args:
        input_ids: [B, T] (with `attention_mask` marking left padding) or a
            list of 1-D prompts of any lengths (left-padded here).
        stop_tokens: a row stops after emitting one of these; later slots get
            `pad_token_id`.
        seed: makes sampling reproducible (a private generator; global RNG untouched).
    Returns:
        [B, T + n] prompt (left-padded) followed by n <= max_new_tokens new tokens.
    """
    cfg = SamplingConfig(temperature, top_k, top_p)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    device = next(model.parameters()).device
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
        logits, cache = prefill(model, input_ids, attention_mask, chunk_size=prefill_chunk_size)
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=device)
        out = []
        for step in range(max_new_tokens):
            tok = torch.where(done, pad, sample(logits, cfg, gen))
            out.append(tok)
            done = done | torch.isin(tok, stops)
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], dim=1)
            logits = decode_one_token(model, tok, attention_mask, cache)
    finally:
        model.train(was_training)
    if not out:
        return input_ids
    return torch.cat([input_ids, torch.stack(out, dim=1)], dim=1)
