"""A request's next token from its logits, and whether it ends the request."""

from __future__ import annotations

import os

import torch

from ..generate import SamplingConfig, sample
from .request import SamplingParams, TokenEvent


def new_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The request's own random stream (its seed, or a fresh one): a seeded request samples
    the same tokens alone or batched with others. None for greedy requests."""
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    if params.temperature <= 0:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def shape_logits(logits: torch.Tensor, params: SamplingParams, output) -> torch.Tensor:
    """logits [V] (fp32) less presence x [t was generated] + frequency x (t's count in `output`),
    plus logit_bias[t]: vLLM's order and definitions (penalties over this request's output only)."""
    p = params
    out = logits.float().clone()
    if output and (p.presence_penalty or p.frequency_penalty):
        counts = torch.bincount(torch.tensor(list(output), device=out.device), minlength=out.shape[0])[: out.shape[0]]
        out -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=out.device)
        out[ids] += torch.tensor(list(p.logit_bias.values()), device=out.device, dtype=out.dtype)
    return out


def sample_event(logits: torch.Tensor, greedy: int, params: SamplingParams,
                 generator: torch.Generator | None, output: list[int] = ()) -> TokenEvent:
    """The next token from logits [V] (`greedy`: their argmax, computed for the whole step at
    once), with its log-probability and the top ones if asked for (from the model's logits).
    `output`: the request's tokens so far, for its penalties."""
    p = params
    chosen = logits
    if p.shapes_logits:
        chosen = shape_logits(logits, p, output)
        greedy = int(chosen.argmax())
    if p.temperature == 0:
        tok = greedy
    else:
        tok = int(sample(chosen[None], SamplingConfig(p.temperature, p.top_k, p.top_p), generator)[0])
    ev = TokenEvent(tok)
    if p.logprobs is not None:
        lp = torch.log_softmax(logits, -1)
        ev.logprob = float(lp[tok])
        if p.logprobs:
            top = torch.topk(lp, p.logprobs)
            ev.top_logprobs = list(zip(top.indices.tolist(), top.values.tolist()))
    return ev


def finish_reason(params: SamplingParams, token: int, num_output: int, eos: frozenset[int]) -> str | None:
    """"stop" (a stop token, or end-of-sequence unless ignored, once `min_tokens` are out),
    "length" (`max_tokens` reached), or None: the request goes on."""
    p = params
    if num_output >= p.min_tokens and (token in p.stop_token_ids or (not p.ignore_eos and token in eos)):
        return "stop"
    if num_output >= p.max_tokens:
        return "length"
    return None
