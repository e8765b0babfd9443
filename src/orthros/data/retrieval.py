"""Retrieval-shaped training samples inside real haystacks, with the loss on the answers.

    rows, mask = retrieval_rows(tok, stream, n_rows=64, seq_len=8192, rng=np.random.default_rng(0))

Three kinds, each a haystack of real text (spans of a token `stream`, e.g. the
training corpus) of 1K–8K tokens:

    passkey   a key sentence hidden at a random depth, asked for through the chat
              template; the loss on the assistant's answer (the key, then <end>)
    lookup    several "the value of NAME is NUMBER" facts spread through the text,
              one of them (or, with `questions`, several in turn) asked for through
              the chat template
    copy      raw text whose last segment (32–128 tokens) repeats a segment seen
              earlier; the loss on the repeat

Evaluation samples stay disjoint by construction: training keys and values are
multiples of `KEY_MOD` and evaluation keys never are (`eval_key`), and the
haystacks come from the training corpus, never from the held-out texts the
probes read (`eval.longrange`).

Each row starts with one sample (positions from 0, as a fresh prompt), then
an end-of-text token and training text up to `seq_len`, which keeps its
next-token loss: `mask` marks the positions whose token is a target.
"""

from __future__ import annotations

import numpy as np

KEY_MOD = 7  # training keys are multiples of 7; evaluation keys never are
NEEDLES = ("The pass key is {key}. Remember it. {key} is the pass key. ",
           "Remember this secret code: {key}. The secret code is {key}. ",
           "Important: the access number is {key}. Keep the access number {key} in mind. ")
QUESTIONS = ("What is the pass key? Answer with the number only.",
             "What is the secret code? Answer with the number only.",
             "What is the access number? Answer with the number only.")
NAMES = ("alpha", "bravo", "cedar", "delta", "ember", "falcon", "garnet", "harbor", "indigo", "juniper", "kestrel",
         "lantern", "maple", "nectar", "onyx", "pepper", "quartz", "raven", "saffron", "tundra", "umber", "violet",
         "willow", "xenon", "yarrow", "zephyr")
KINDS = ("passkey", "lookup", "copy")


def train_key(rng: np.random.Generator, lo: int = 10_000, hi: int = 100_000) -> str:
    return str(int(rng.integers(lo // KEY_MOD + 1, hi // KEY_MOD)) * KEY_MOD)


def eval_key(rng) -> str:
    """A 5-digit key a training sample never holds (`random.Random` or numpy generator)."""
    while True:
        k = int(rng.randrange(10_000, 100_000)) if hasattr(rng, "randrange") else int(rng.integers(10_000, 100_000))
        if k % KEY_MOD:
            return str(k)


def _chat(tok, turns: list[tuple[str, str]]) -> tuple[list[int], list[bool]]:
    """Chat-template ids of a conversation of (user, answer) turns and the mask of every answer's
    tokens (and its end-of-turn token)."""
    msgs, mask, full = [], [], []
    for user, answer in turns:
        msgs.append({"role": "user", "content": user})
        prompt = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
        msgs.append({"role": "assistant", "content": answer})
        nxt = list(tok.apply_chat_template(msgs, tokenize=True, return_dict=False))
        if prompt[: len(full)] != full or nxt[: len(prompt)] != prompt:
            raise ValueError("the chat template does not extend the conversation turn by turn")
        n_ans = len(tok(answer, add_special_tokens=False)["input_ids"]) + 1  # the answer and the end-of-turn token
        mask += [False] * (len(prompt) - len(full))
        mask += [i < n_ans for i in range(len(nxt) - len(prompt))]
        full = nxt
    return full, mask


def _haystack(tok, stream: np.ndarray, n_tokens: int, rng: np.random.Generator) -> str:
    n_tokens = max(32, n_tokens)
    a = int(rng.integers(0, len(stream) - n_tokens))
    return tok.decode(stream[a : a + n_tokens].tolist(), skip_special_tokens=True)


def _insert(text: str, pieces: list[str], rng: np.random.Generator) -> str:
    """`pieces` put at random line breaks (or anywhere, if the text has none) of `text`, in order."""
    cuts = [i + 1 for i, c in enumerate(text) if c == "\n"] or list(range(len(text) + 1))
    at = sorted(int(cuts[int(rng.integers(0, len(cuts)))]) for _ in pieces)
    out, last = [], 0
    for pos, piece in zip(at, pieces):
        out += [text[last:pos], piece]
        last = pos
    return "".join(out + [text[last:]])


def sample(tok, stream: np.ndarray, length: int, kind: str, rng: np.random.Generator, questions: int = 1):
    """One sample of about `length` tokens: (ids, mask) as lists. `questions`: a lookup asks up to
    that many of its facts, one chat turn each, every answer a target (denser supervision of the
    lookup for the same tokens)."""
    if kind == "copy":
        seg = int(rng.integers(32, 129)) if length >= 512 else max(4, length // 8)
        a = int(rng.integers(0, len(stream) - length))
        hay = stream[a : a + length - seg].tolist()
        b = int(rng.integers(0, len(hay) - 2 * seg))
        ids = hay + hay[b : b + seg]
        return ids, [False] * len(hay) + [True] * seg
    overhead = 48
    if kind == "passkey":
        i = int(rng.integers(0, len(NEEDLES)))
        key = train_key(rng)
        text = _insert(_haystack(tok, stream, length - overhead, rng), [NEEDLES[i].format(key=key)], rng)
        return _chat(tok, [(text + "\n" + QUESTIONS[i], key)])
    if kind == "lookup":
        names = rng.choice(len(NAMES), size=int(rng.integers(4, 9)), replace=False)
        facts = [(NAMES[j], train_key(rng, 100, 10_000)) for j in names]
        pieces = [f"The value of {n} is {v}. " for n, v in facts]
        ask = "What is the value of {}? Answer with the number only."
        more = 0  # each question after the first is a turn of its own: the haystack leaves room for them
        if questions > 1:
            turn = len(tok(ask.format(NAMES[0]) + " 1234", add_special_tokens=False)["input_ids"]) + 8
            more = (min(questions, len(facts)) - 1) * turn
        text = _insert(_haystack(tok, stream, length - overhead - 12 * len(facts) - more, rng), pieces, rng)
        if questions <= 1:  # (the draw of earlier runs' rows)
            asked = [facts[int(rng.integers(0, len(facts)))]]
        else:
            asked = [facts[j] for j in rng.permutation(len(facts))[: min(questions, len(facts))]]
        turns = [(ask.format(n), v) for n, v in asked]
        turns[0] = (f"{text}\n{turns[0][0]}", turns[0][1])
        return _chat(tok, turns)
    raise ValueError(f"retrieval sample kind must be one of {', '.join(KINDS)}, got {kind!r}")


def retrieval_rows(tok, stream: np.ndarray, n_rows: int, seq_len: int, rng: np.random.Generator,
                   lengths: tuple[int, int] = (1024, 8192), fill: np.ndarray | None = None, questions: int = 1):
    """`n_rows` rows [n_rows, seq_len] int32 and their target masks (bool): one sample of a
    length drawn from `lengths` (capped below seq_len) each, then EOS and text from `fill`
    (default: `stream`) up to seq_len. The kinds take turns; a lookup asks up to `questions`
    of its facts."""
    fill = stream if fill is None else fill
    eos = tok.eos_token_id
    rows = np.zeros((n_rows, seq_len), np.int32)
    mask = np.zeros((n_rows, seq_len), bool)
    lo, hi = lengths[0], min(lengths[1], seq_len - 64)
    at = 0
    for r in range(n_rows):
        L = int(rng.integers(lo, hi + 1))
        ids, m = sample(tok, stream, L, KINDS[r % len(KINDS)], rng, questions)
        ids, m = ids[: seq_len - 1], m[: seq_len - 1]
        rest = seq_len - len(ids) - 1
        if at + rest > len(fill):
            at = 0
        body = np.concatenate([np.asarray(ids, np.int32), np.asarray([eos], np.int32), fill[at : at + rest]])
        at += rest
        rows[r] = body
        mask[r, : len(m)] = m
        mask[r, len(m) + 1 :] = True  # the text after the sample keeps its next-token loss
    return rows, mask
