"""lm-evaluation-harness adapter (needs the `eval` extra: `pip install orthros[eval]`).

An Orthros checkpoint is a plain transformers directory, so lm-eval's own
`hf` model evaluates it once `import orthros` has registered the Auto
classes. This module registers that as lm-eval model `orthros` too:

    import orthros.eval.lm_eval_adapter  # noqa: F401  (registers "orthros")
    lm_eval.simple_evaluate(model="orthros", model_args="pretrained=runs/demo", tasks=["arc_easy"])

What lm-eval asks of the model, and what it gets:
  * loglikelihood / multiple choice: `model(input_ids, logits_to_keep=mask)`,
    right-padded, no attention mask; the mask makes each row's continuation
    positions its only output positions, so the rest of a long prompt is read
    by the base stream alone (linear in its length) and a position's logits are
    those of a call where every position is an output position (the output
    stream never feeds the base stream). The logits come back as [B, T, V]
    (zeros elsewhere) and lm-eval reads the continuation's slice. A call whose
    rows are not the requests lm-eval is running gets every position. The batch is
    padded further on the right to a multiple of `PAD_TO` tokens (causal: no
    earlier position changes) and the logits cut back, so a task's requests
    come in a few lengths and compiled kernels (FlexAttention on CUDA, one per
    shape) are built a few times instead of once per request length.
  * generate_until: `model.generate(..., attention_mask)` on left-padded
    prompts -> transformers' generate with an OrthrosCache: one output token
    in the prefill (linear time), then one (base, output) pair per step.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

import orthros  # noqa: F401  (registers OrthrosConfig / OrthrosForCausalLM with the Auto classes)
from orthros.models.layout import pad_rows


PAD_TO = 128
"""loglikelihood batches are right-padded to a multiple of this many tokens"""


@register_model("orthros")
class OrthrosLM(HFLM):
    """lm-eval's HF causal-LM wrapper, with the Orthros classes registered."""

    def __init__(self, pretrained, **kwargs):
        kwargs.setdefault("backend", "causal")  # "orthros" is not in transformers' own causal-LM table
        super().__init__(pretrained=pretrained, **kwargs)

    _continuations = None
    """While lm-eval runs loglikelihood requests: {(length, digest) of a model input: its continuation's
    length}."""

    def _loglikelihood_tokens(self, requests, *args, **kwargs):
        """lm-eval's, told which positions of each input are its continuation's (the input is
        lm-eval's own: context + continuation, cut to max_length + 1 tokens, without the last)."""
        if self.backend != "causal":
            return super()._loglikelihood_tokens(requests, *args, **kwargs)
        conts = {}
        for _, ctx, cont in requests:
            k = _key(np.asarray((ctx + cont)[-(self.max_length + 1):][:-1], dtype=np.int64))
            conts[k] = max(conts.get(k, 0), len(cont))
        self._continuations = conts
        try:
            return super()._loglikelihood_tokens(requests, *args, **kwargs)
        finally:
            self._continuations = None

    def _continuation_mask(self, inps: torch.Tensor) -> torch.Tensor | None:
        """[B, T] bool: each row's continuation positions; None (every position) where a row is not
        exactly one request's input. lm-eval pads rows on the right with zeros and a row's own last
        tokens may be zeros too, so a row that two inputs could explain is not guessed at."""
        if not self._continuations:
            return None
        lengths = sorted({L for L, _ in self._continuations})
        rows = inps.cpu().numpy().astype(np.int64)
        keep = torch.zeros(inps.shape, dtype=torch.bool)
        for b, r in enumerate(rows):
            nz = np.flatnonzero(r)
            first = int(nz[-1]) + 1 if len(nz) else 1
            found = [(L, n) for L in lengths if first <= L <= r.shape[0]
                     for n in [self._continuations.get(_key(r[:L]))] if n]
            if len(found) != 1:
                return None
            L, n = found[0]
            keep[b, max(0, L - n):L] = True
        return keep.to(inps.device)

    def _model_call(self, inps, attn_mask=None, labels=None):
        if attn_mask is not None or labels is not None:
            return super()._model_call(inps, attn_mask, labels)
        B, T = inps.shape
        pad = -T % PAD_TO
        filler = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        padded = torch.nn.functional.pad(inps, (0, pad), value=filler) if pad else inps
        keep = self._continuation_mask(inps)
        if keep is None:
            return super()._model_call(padded)[:, :T]
        with torch.no_grad():
            logits = self.model(padded, logits_to_keep=torch.nn.functional.pad(keep, (0, pad))).logits
        idx, valid = pad_rows(keep)
        full = logits.new_zeros(B, T, logits.shape[-1])
        full[torch.arange(B, device=idx.device)[:, None].expand_as(idx)[valid], idx[valid]] = logits[valid]
        return full


def _key(tokens: np.ndarray) -> tuple[int, bytes]:
    return len(tokens), hashlib.blake2b(tokens.tobytes(), digest_size=16).digest()


def _task_manager(tasks: list[str], include_path: str | None):
    from lm_eval.tasks import TaskManager

    task_manager = None
    if include_path:  # indexing lm-eval's ~15k built-in tasks takes seconds: skip it when the local ones suffice
        task_manager = TaskManager(include_path=include_path, include_defaults=False)
        if not set(tasks) <= set(task_manager.all_tasks):
            task_manager = None
    task_manager = task_manager or TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in task_manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s): {', '.join(unknown)}"
                         + ("" if include_path else " (local task YAMLs need --include-path)"))
    return task_manager


def evaluate_model(model, tokenizer, tasks: list[str], *, batch_size: int = 1, include_path: str | None = None,
                   limit: int | float | None = None, seed: int = 0) -> dict:
    """lm-eval `tasks` on a model object already in memory (e.g. one arm of an experiment)."""
    import lm_eval

    task_manager = _task_manager(tasks, include_path)
    lm = OrthrosLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit, task_manager=task_manager, random_seed=seed,
                                   numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)


def evaluate(model_dir: str, tasks: list[str], *, batch_size: int | str = 1, device: str | None = None,
             limit: int | float | None = None, num_fewshot: int | None = None, include_path: str | None = None,
             dtype: str = "auto", seed: int = 0, log_samples: bool = False) -> dict:
    """Run lm-eval `tasks` on the Orthros checkpoint `model_dir`; return lm-eval's results dict."""
    import lm_eval
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    task_manager = _task_manager(tasks, include_path)
    lm = OrthrosLM(pretrained=str(model_dir), device=device, batch_size=batch_size, dtype=dtype)
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                   task_manager=task_manager, log_samples=log_samples, random_seed=seed,
                                   numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
