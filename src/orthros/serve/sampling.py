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


def sample_event(logits: torch.Tensor, greedy: int, params: SamplingParams,
                 generator: torch.Generator | None) -> TokenEvent:
    """The next token from logits [V] (`greedy`: their argmax, computed for the whole step at
    once), with its log-probability and the top ones if asked for."""
    p = params
    if p.temperature == 0:
        tok = greedy
    else:
        tok = int(sample(logits[None], SamplingConfig(p.temperature, p.top_k, p.top_p), generator)[0])
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
