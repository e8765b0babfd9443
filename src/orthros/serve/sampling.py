"""A request's next token from its logits, and whether it ends the request.

The step's rows are chosen together where that is one op for all of them: the greedy argmax,
and the grammar masks of structured-output requests (`GrammarMasks`: one bitmask for the
constrained rows, applied on the logits' device). The rest (penalties, sampling with a
request's own generator, logprobs) is per row.
"""

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
                 generator: torch.Generator | None, output: list[int] = (),
                 masked: torch.Tensor | None = None) -> TokenEvent:
    """The next token from logits [V] (`greedy`: their argmax, computed for the whole step at
    once), with its log-probability and the top ones if asked for (from the model's logits).
    `output`: the request's tokens so far, for its penalties; `masked`: a constrained request's
    logits [V] with the tokens its grammar forbids at -inf (then `greedy` is their argmax), which
    the choice is made from."""
    p = params
    chosen = logits if masked is None else masked
    if p.shapes_logits:
        chosen = shape_logits(chosen, p, output)
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


def finish_reason(params: SamplingParams, token: int, num_output: int, eos: frozenset[int],
                  matcher=None) -> str | None:
    """"stop" (a stop token, or end-of-sequence unless ignored, once `min_tokens` are out; or,
    for a constrained request, its grammar complete: its `matcher`, which has taken `token`, is
    stopped), "length" (`max_tokens` reached), or None: the request goes on."""
    p = params
    if matcher is not None and matcher.is_stopped():
        return "stop"
    if num_output >= p.min_tokens and (token in p.stop_token_ids or (not p.ignore_eos and token in eos)):
        return "stop"
    if num_output >= p.max_tokens:
        return "length"
    return None


# ------------------------------------------------------------ structured output
def apply_token_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logits [R, V] with every token whose bit is clear in mask [R, ceil(V/32)] (int32, bit t % 32
    of word t // 32, llguidance's layout) set to -inf, in place; returned. A few element-wise ops
    on the logits' device, whatever R: no per-row or per-token loop. (llguidance's own torch
    helper does the same through `torch.compile`, which costs seconds on the first call, inside
    the engine loop, and a C++ compiler on CPU.)"""
    V = logits.shape[-1]
    bit = torch.arange(32, device=mask.device, dtype=torch.int32)
    allowed = ((mask.unsqueeze(-1) >> bit) & 1).flatten(1).bool()  # [R, 32 * words]
    if allowed.shape[1] < V:  # tokens past the mask: forbidden
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]), value=False)
    return logits.masked_fill_(~allowed[:, :V], float("-inf"))


class GrammarMasks:
    """The allowed-token masks of a step's constrained rows: one [R, ceil(V/32)] int32 bitmask,
    filled on the host by llguidance (its executor computes the rows in parallel, without the
    GIL; tens of microseconds a row) and applied to those rows' logits on their device.

    The engine calls `constrain` after the step's forward is launched and before anything waits
    for it, so on CUDA the host fills the masks while the device runs the forward."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.words = (vocab_size + 31) // 32
        self.device = device
        self.host: torch.Tensor | None = None
        self.executor = None

    def fill(self, matchers: list) -> torch.Tensor:
        """The masks [R, words] of R matchers, on the device."""
        import llguidance

        R = len(matchers)
        if self.host is None or self.host.shape[0] < R:
            n = max(R, 2 * (0 if self.host is None else self.host.shape[0]), 8)
            # pinned on CUDA, so the copy below does not hold the host; it is done before the
            # next step writes here (the step reads its tokens back in between)
            self.host = torch.empty((n, self.words), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        if self.executor is None:
            self.executor = llguidance.LLExecutor()
        buf = self.host[:R]
        # llguidance.torch.fill_next_token_bitmask_par without importing llguidance.torch (its
        # import sets up torch.compile: seconds)
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], buf.data_ptr(),
                                              self.words * 4, R)
        return buf.to(self.device, non_blocking=True)

    def constrain(self, logits: torch.Tensor, rows: list[int], matchers: list) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [N, V] of the step's output rows; rows [R] of them constrained by `matchers`:
        (those rows' indices [R] on the device, their logits [R, V] masked: a copy, so `logits`
        keep the model's values, for logprobs)."""
        mask = self.fill(matchers)  # first: a pageable copy to the device would wait for the forward
        idx = torch.tensor(rows, device=logits.device)
        return idx, apply_token_bitmask(logits.index_select(0, idx), mask)


def greedy_choices(logits: torch.Tensor, matchers: list, masks: GrammarMasks) -> tuple[list[int], dict[int, torch.Tensor]]:
    """The step's argmax per output row of logits [N, V] (a constrained row's under its grammar's
    mask), read back in one device sync; and the constrained rows' masked logits {row: [V]}.
    matchers [N]: each row's llguidance matcher, or None."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not logits.shape[0]:
        return [], {}
    greedy = logits.argmax(-1)
    if not rows:
        return greedy.tolist(), {}
    idx, masked = masks.constrain(logits, rows, [matchers[i] for i in rows])
    greedy[idx] = masked.argmax(-1)
    return greedy.tolist(), dict(zip(rows, masked))
