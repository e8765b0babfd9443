"""A request's parameters, state and events; the errors `Engine.submit` raises.

A request is a token list (prompt, then generated tokens) and a count of
tokens whose K/V are in the cache (`computed`); what is left to run is
`tokens[computed:]`. Nothing here touches a model or a device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..generate import SamplingConfig
from .kv_blocks import BlockTable


class QueueFull(Exception):
    """The waiting queue is at its bound (`max_queue`)."""


class EngineDead(Exception):
    """The engine thread stopped after an error."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # keep going past the model's end-of-sequence tokens
    min_tokens: int = 0  # no stop before this many tokens
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's and the top k
    # OpenAI's / vLLM's: subtract presence x [token generated before] + frequency x (its count in
    # this request's output) from a token's logit, and add logit_bias[token] (before sampling;
    # logprobs stay those of the model's logits)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    # structured output: a compiled grammar (`structured.Guide`); each request gets its own matcher,
    # the sampler masks what the grammar forbids, and the request stops where the grammar ends
    guide: object | None = None

    def __post_init__(self):
        SamplingConfig(self.temperature, self.top_k, self.top_p)  # validates
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for tok, bias in (self.logit_bias or {}).items():
            if not isinstance(tok, int) or tok < 0:
                raise ValueError(f"logit_bias keys are token ids, got {tok!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {tok}")

    @property
    def host_choice(self) -> bool:
        """Whether the token is the step's argmax as it is (no sampling, penalties or
        log-probabilities): chosen without device work once the argmax is read back."""
        return self.temperature == 0 and not self.shapes_logits and self.logprobs is None

    @property
    def shapes_logits(self) -> bool:
        """Whether penalties or a bias change the logits before the choice."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


@dataclass
class TokenEvent:
    """One generated token (or the end of a request). finish_reason: None while running,
    then "stop" | "length" | "abort" | "error"."""

    token_id: int | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    error: str | None = None


@dataclass(eq=False)  # identity: `req in running` must not compare prompts field by field
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    sink: Callable[[TokenEvent], None]
    tokens: list[int] = field(default_factory=list)
    computed: int = 0
    table: BlockTable = field(default_factory=BlockTable)
    generator: torch.Generator | None = None
    matcher: object | None = None  # llguidance's LLMatcher of a constrained request: the tokens so far taken
    arrival: float = 0.0
    first_token_at: float | None = None
    last_token_at: float | None = None
    cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    finished: bool = False

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt)
