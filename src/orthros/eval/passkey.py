"""Passkey retrieval (needle in a haystack).

A needle — "The pass key is 48213. Remember it. 48213 is the pass key." —
sits at depth d (0 = start, 1 = end) of a haystack of Python sources; the
sequence ends with a question and the answer's tokens:

    [haystack … needle … haystack] What is the pass key? The pass key is 48213

Scored teacher-forced: the output positions are the ones predicting the
answer's tokens (labels -100 elsewhere, Orthros' SFT phase); a sample counts
only if every answer token is the model's top choice, which is exactly
"greedy decoding writes the pass key".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models.model import IGNORE_INDEX

NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = " What is the pass key? The pass key is"
ANSWER = " {key}"


@dataclass
class PasskeyConfig:
    lengths: list[int] = field(default_factory=lambda: [256, 512, 1024])
    """total tokens per sample (haystack + needle + question + answer)"""
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    """needle depths, as fractions of the haystack"""
    samples: int = 10
    """samples per (length, depth) cell"""
    digits: int = 5
    """digits of the pass key"""

    def validate(self) -> None:
        if not self.lengths or any(L < 1 for L in self.lengths):
            raise ValueError(f"passkey lengths must be positive, got {self.lengths}")
        if not self.depths or any(not 0 <= d <= 1 for d in self.depths):
            raise ValueError(f"passkey depths must lie in [0, 1], got {self.depths}")
        if self.samples < 1 or self.digits < 1:
            raise ValueError(f"passkey samples and digits must be >= 1, got {self.samples}, {self.digits}")


def passkey_sample(haystack: list[int], encode, length: int, depth: float, key: str, offset: int = 0,
                   copy_labels: bool = False):
    """One sample -> (input_ids [length], labels [length]).

    haystack: token ids (list or 1-D tensor) to cut the filler from (starting at `offset`, wrapping);
    encode: str -> list[int] (the model's tokenizer, no special tokens);
    copy_labels: also label the key's second copy inside the needle ("Remember it. 48213 …"),
    a copy a few tokens from the first: training data only (evaluation scores the answer alone).
    """
    needle, question, answer = encode(NEEDLE.format(key=key)), encode(QUESTION), encode(ANSWER.format(key=key))
    n_fill = length - len(needle) - len(question) - len(answer)
    if n_fill < 0:
        raise ValueError(f"passkey length {length} is shorter than the needle, question and answer "
                         f"({length - n_fill} tokens)")
    if len(haystack) < 1:
        raise ValueError("passkey haystack is empty")
    idx = (offset + torch.arange(n_fill)) % len(haystack)
    fill = torch.as_tensor(haystack, dtype=torch.long)[idx].tolist()  # a tensor haystack is not copied
    at = round(depth * n_fill)
    ids = fill[:at] + needle + fill[at:] + question + answer
    labels = [IGNORE_INDEX] * (length - len(answer)) + answer
    if copy_labels:
        at += _last_match(needle, answer)
        labels[at : at + len(answer)] = answer
    return torch.tensor(ids), torch.tensor(labels)


def _last_match(seq: list[int], sub: list[int]) -> int:
    """Start of the last occurrence of `sub` in `seq`."""
    for i in range(len(seq) - len(sub), -1, -1):
        if seq[i : i + len(sub)] == sub:
            return i
    raise ValueError("the tokenizer splits the pass key differently inside the needle; copy_labels needs it whole")


def passkey_batch(haystack: list[int], encode, n: int, length: int, depth: float | None = None,
                  digits: int = 5, seed: int = 0, copy_labels: bool = False):
    """`n` samples of one length -> (input_ids [n, L], labels [n, L], keys).

    depth None draws a depth per sample (training data); keys are random
    `digits`-digit numbers, haystack offsets random: deterministic in `seed`.
    copy_labels: see `passkey_sample` (training data).
    """
    g = torch.Generator().manual_seed(seed)
    rows, labs, keys = [], [], []
    for _ in range(n):
        key = str(int(torch.randint(10 ** (digits - 1), 10 ** digits, (1,), generator=g)))
        d = float(torch.rand(1, generator=g)) if depth is None else depth
        off = int(torch.randint(0, max(1, len(haystack)), (1,), generator=g))
        x, y = passkey_sample(haystack, encode, length, d, key, off, copy_labels)
        rows.append(x)
        labs.append(y)
        keys.append(key)
    return torch.stack(rows), torch.stack(labs), keys
