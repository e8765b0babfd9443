"""Retrieval-shaped training samples inside real haystacks, with the loss on the answers.

    rows, mask = retrieval_rows(tok, stream, n_rows=64, seq_len=8192, rng=np.random.default_rng(0))

Five kinds, each a haystack of real text (spans of a token `stream`, e.g. the
training corpus) of 1K–8K tokens:

    passkey   a key sentence hidden at a random depth, asked for through the chat
              template; the loss on the assistant's answer (the key, then <end>); with
              `varied`, the fact and the question in one of many wordings
    lookup    several "the value of NAME is NUMBER" facts spread through the text,
              one of them (or, with `questions`, several in turn) asked for through
              the chat template
    copy      raw text whose last segment (32–128 tokens) repeats a segment seen
              earlier; the loss on the repeat
    compound  several "the ADJ NOUN is described in report NUMBER" facts on a grid of 2-3
              adjectives by 2-3 nouns: each word names more than one fact, so a fact is found by
              what the question says of it as a whole, not by one word (as the demo's "which PEP
              specified the with statement" among other PEPs); asked as a lookup is, one
              chat turn a question
    docqa     a question about something in the first three quarters of the text (what a
              function or class does, what a quoted line is about), answered by a teacher
              (`answer`: e.g. the source model, greedy, `teacher_answerer`), one chat turn
              each with `questions`; the loss on the teacher's answers. Only with a teacher:
              `retrieval_rows(..., kinds=KINDS + ("docqa",), answer=...)`

Evaluation samples stay disjoint by construction: training keys and values are
multiples of `KEY_MOD` and evaluation keys never are (`eval_key`), and the
haystacks come from the training corpus, never from the held-out texts the
probes read (`eval.longrange`).

Each row starts with one sample (positions from 0, as a fresh prompt), then
an end-of-text token and training text up to `seq_len`, which keeps its
next-token loss: `mask` marks the positions whose token is a target.
"""

from __future__ import annotations

import re
from typing import Callable

import numpy as np

KEY_MOD = 7  # training keys are multiples of 7; evaluation keys never are
NEEDLES = ("The pass key is {key}. Remember it. {key} is the pass key. ",
           "Remember this secret code: {key}. The secret code is {key}. ",
           "Important: the access number is {key}. Keep the access number {key} in mind. ")
NOUNS = ("pass key", "secret code", "access number")  # what each needle and its question name
QUESTIONS = ("What is the pass key? Answer with the number only.",
             "What is the secret code? Answer with the number only.",
             "What is the access number? Answer with the number only.")
NAMES = ("alpha", "bravo", "cedar", "delta", "ember", "falcon", "garnet", "harbor", "indigo", "juniper", "kestrel",
         "lantern", "maple", "nectar", "onyx", "pepper", "quartz", "raven", "saffron", "tundra", "umber", "violet",
         "willow", "xenon", "yarrow", "zephyr")
KINDS = ("passkey", "lookup", "copy")
"""the kinds a run takes in turn by default (those that need no teacher)"""
ALL_KINDS = KINDS + ("compound", "docqa")
ADJECTIVES = ("northern", "silent", "early", "hidden", "upper", "copper", "narrow", "golden", "quiet", "outer")
PLACES = ("bridge", "tower", "garden", "market", "station", "harbor", "archive", "chapel", "mill", "gate")
COMPOUND_FACTS = ("The {thing} is described in report {value}. ", "Report {value} is about the {thing}. ",
                  "For the {thing}, see report {value}. ")
DOC_QUESTIONS = ("What does `{name}` in the text above do? Answer in one or two sentences.",
                 "In the text above, what is `{name}` for? Answer briefly.")
BOILERPLATE = re.compile(r"licen[cs]e|copyright|https?:|www\\.", re.I)
LINE_QUESTIONS = ('The text above contains the line "{line}". What does the text say there? Answer in one or two '
                  "sentences.",
                  'What is the part of the text above around "{line}" about? Answer briefly.')


# `varied` pass keys (sample's `varied`): the fact and its question in many words, so that a model learns to
# find a number by what the question says of it, not one needle's wording. Never the words of the demo's
# probe ("archive code", "chapter": demo.real.FACT), which stays a test of wording no row holds.
VARIED_NOUNS = ("pass key", "secret code", "access number", "order number", "room number", "serial number",
                "ticket number", "reference number", "locker code", "project code", "batch number", "account number",
                "voucher code", "badge number", "tracking number", "booking code")
VARIED_UNITS = ("document", "section", "file", "page", "text", "report", "manual", "module")
VARIED_FACTS = ("The {noun} of this {unit} is {key}.", "The {noun} is {key}.", "{Noun}: {key}.",
                "Note that the {noun} for this {unit} is {key}.", "This {unit} has the {noun} {key}.",
                "The {noun} is {key}. Remember it. {key} is the {noun}.")
VARIED_QUESTIONS = ("What is the {noun} of this {unit}?", "What is the {noun}?", "Which {noun} does the {unit} give?",
                    "What {noun} is mentioned in the text above?", "What is the {noun}? Answer with the number only.")


def varied_passkey(key: str, rng: np.random.Generator) -> tuple[str, str, str]:
    """(fact, question, the answer in a sentence) of a `varied` pass key: a noun, a unit, a fact's form and
    a question's form drawn; the answer names the unit where the question does."""
    noun = VARIED_NOUNS[int(rng.integers(0, len(VARIED_NOUNS)))]
    unit = VARIED_UNITS[int(rng.integers(0, len(VARIED_UNITS)))]
    fact = VARIED_FACTS[int(rng.integers(0, len(VARIED_FACTS)))]
    q = VARIED_QUESTIONS[int(rng.integers(0, len(VARIED_QUESTIONS)))]
    answer = f"The {noun} of this {unit} is {key}." if "{unit}" in q else f"The {noun} is {key}."
    words = dict(noun=noun, Noun=noun[0].upper() + noun[1:], unit=unit, key=key)
    return fact.format(**words) + " ", q.format(**words), answer


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
    tokens (and its end-of-turn token).

    The template is rendered once per turn as text; each turn's new text (its prompt, then its
    answer) is tokenized alone and the pieces joined, which must give the whole conversation's ids:
    a template whose turns do not meet at token boundaries is refused. (Tokenizing every prompt
    whole, as the template's own `tokenize=True` does, costs a lookup of 8 questions over a long
    haystack 16 tokenizations of it.)"""
    msgs, texts = [], [""]
    for user, answer in turns:
        msgs.append({"role": "user", "content": user})
        texts.append(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
        msgs.append({"role": "assistant", "content": answer})
        texts.append(tok.apply_chat_template(msgs, tokenize=False))
    if any(not b.startswith(a) for a, b in zip(texts, texts[1:])):
        raise ValueError("the chat template does not extend the conversation turn by turn")
    pieces = [tok(b[len(a):], add_special_tokens=False)["input_ids"] for a, b in zip(texts, texts[1:])]
    full = [t for p in pieces for t in p]
    if full != list(tok(texts[-1], add_special_tokens=False)["input_ids"]):
        raise ValueError("the chat template's turns do not meet at token boundaries")
    mask = []
    for (_, answer), prompt, reply in zip(turns, pieces[0::2], pieces[1::2]):
        n_ans = len(tok(answer, add_special_tokens=False)["input_ids"]) + 1  # the answer and the end-of-turn token
        mask += [False] * len(prompt) + [i < n_ans for i in range(len(reply))]
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


def _doc_questions(text: str, n: int, rng: np.random.Generator) -> list[str]:
    """Up to `n` questions about distinct things in the first three quarters of `text`, functions and
    classes defined there first, then lines of 30-120 characters quoted (no licence or link lines);
    one general question if the text has neither."""
    head = text[: int(len(text) * 0.75)]
    names = list(dict.fromkeys(re.findall(r"^\s*(?:async\s+)?(?:def|class)\s+([A-Za-z_]\w{2,})", head, re.M)))
    lines = list(dict.fromkeys(ln.strip() for ln in head.splitlines()
                               if 30 <= len(ln.strip()) <= 120 and sum(c.isalpha() for c in ln) >= 15
                               and '"' not in ln and not BOILERPLATE.search(ln)))
    subjects = [("name", x) for x in names] + [("line", x) for x in lines]
    if not subjects:
        return ["What is the text above about? Answer in one or two sentences."]
    pick = rng.permutation(len(subjects))[:n]
    out = []
    for j in sorted(pick, key=lambda j: subjects[j][0] != "name"):  # names first: the sharper questions
        what, x = subjects[j]
        forms = DOC_QUESTIONS if what == "name" else LINE_QUESTIONS
        out.append(forms[int(rng.integers(0, len(forms)))].format(**{what: x}))
    return out


def teacher_answerer(model, tok, max_new_tokens: int = 48) -> Callable[[list[int]], str | None]:
    """`answer(prompt_ids) -> text | None`: `model`'s greedy answer to a chat prompt (up to its end of
    turn; an answer cut by `max_new_tokens` ends at its last full sentence or line; one that loops
    ends before its first repeated line; None where under 20 characters are left)."""
    import torch

    from ..generate import generate

    stop = tok.eos_token_id
    device = next(model.parameters()).device

    @torch.no_grad()
    def answer(prompt_ids: list[int]) -> str | None:
        out = generate(model, torch.tensor([prompt_ids], device=device), max_new_tokens=max_new_tokens,
                       temperature=0.0, stop_tokens=stop)[0, len(prompt_ids):].tolist()
        done = stop in out
        text = tok.decode(out[: out.index(stop)] if done else out, skip_special_tokens=True).strip()
        if not done:  # cut by max_new_tokens: its full sentences or lines, or nothing
            cut = max(text.rfind(". "), text.rfind(".\n"), text.rfind("\n"))
            text = text[: cut + 1].strip() if cut > 0 else ""
        return _no_loop(text)

    return answer


def _no_loop(text: str) -> str | None:
    """`text` up to the first line that repeats an earlier one (a small teacher's greedy answers
    loop); None if under 20 characters are left (no answer worth learning)."""
    seen, keep = set(), []
    for ln in text.split("\n"):
        if ln.strip() and ln.strip() in seen:
            break
        seen.add(ln.strip())
        keep.append(ln)
    text = "\n".join(keep).strip()
    return text if len(text) >= 20 else None


def compound_facts(rng: np.random.Generator, key: Callable[[], str]) -> tuple[list[tuple[str, str]], list[str]]:
    """A compound sample's facts, ([(name, number)], [their sentences]) in the order they are written:
    2-3 adjectives by 2-3 places, each name with its own number from `key()` (a training or an
    evaluation key)."""
    adj = rng.choice(len(ADJECTIVES), size=int(rng.integers(2, 4)), replace=False)
    place = rng.choice(len(PLACES), size=int(rng.integers(2, 4)), replace=False)
    names = [f"{ADJECTIVES[a]} {PLACES[p]}" for a in adj for p in place]
    values: list[str] = []
    while len(values) < len(names):
        v = key()
        if v not in values:
            values.append(v)
    facts = [(names[j], values[j]) for j in rng.permutation(len(names))]
    return facts, [COMPOUND_FACTS[int(rng.integers(0, len(COMPOUND_FACTS)))].format(thing=t, value=v) for t, v in facts]


def sample(tok, stream: np.ndarray, length: int, kind: str, rng: np.random.Generator, questions: int = 1,
           answer: Callable[[list[int]], str | None] | None = None, phrase: bool = False, varied: bool = False):
    """One sample of about `length` tokens: (ids, mask) as lists. `questions`: a lookup (a docqa
    sample) asks up to that many of its facts (things in its text), one chat turn each, every
    answer a target (denser supervision of the lookup for the same tokens). `answer`: the teacher
    of docqa samples (`teacher_answerer`). `phrase`: a pass key or a lookup is answered in a
    sentence, as the source model answers ("The pass key is 56993."), not with the bare number:
    the answer starts with words the needle holds, so the key follows a match a copy can make
    (induction), where a bare key must be found from the question alone; and the model keeps
    answering in sentences. The draws are the same either way (a lookup of several questions
    leaves room for the longer answers: its text is a little shorter). `varied`: a pass key's fact and
    question in one of many wordings (`varied_passkey`), answered in a sentence."""
    if kind == "copy":
        seg = int(rng.integers(32, 129)) if length >= 512 else max(4, length // 8)
        a = int(rng.integers(0, len(stream) - length))
        hay = stream[a : a + length - seg].tolist()
        b = int(rng.integers(0, len(hay) - 2 * seg))
        ids = hay + hay[b : b + seg]
        return ids, [False] * len(hay) + [True] * seg
    overhead = 48
    if kind == "passkey" and varied:
        fact, q, ans = varied_passkey(train_key(rng), rng)
        text = _insert(_haystack(tok, stream, length - overhead, rng), [fact], rng)
        return _chat(tok, [(text + "\n" + q, ans)])
    if kind == "passkey":
        i = int(rng.integers(0, len(NEEDLES)))
        key = train_key(rng)
        text = _insert(_haystack(tok, stream, length - overhead, rng), [NEEDLES[i].format(key=key)], rng)
        return _chat(tok, [(text + "\n" + QUESTIONS[i], f"The {NOUNS[i]} is {key}." if phrase else key)])
    if kind == "lookup":
        names = rng.choice(len(NAMES), size=int(rng.integers(4, 9)), replace=False)
        facts = [(NAMES[j], train_key(rng, 100, 10_000)) for j in names]
        pieces = [f"The value of {n} is {v}. " for n, v in facts]
        ask = "What is the value of {}? Answer with the number only."
        more = 0  # each question after the first is a turn of its own: the haystack leaves room for them
        if questions > 1:
            reply = f" The value of {NAMES[0]} is 1234." if phrase else " 1234"
            turn = len(tok(ask.format(NAMES[0]) + reply, add_special_tokens=False)["input_ids"]) + 8
            more = (min(questions, len(facts)) - 1) * turn
        text = _insert(_haystack(tok, stream, length - overhead - 12 * len(facts) - more, rng), pieces, rng)
        if questions <= 1:  # (the draw of earlier runs' rows)
            asked = [facts[int(rng.integers(0, len(facts)))]]
        else:
            asked = [facts[j] for j in rng.permutation(len(facts))[: min(questions, len(facts))]]
        turns = [(ask.format(n), f"The value of {n} is {v}." if phrase else v) for n, v in asked]
        turns[0] = (f"{text}\n{turns[0][0]}", turns[0][1])
        return _chat(tok, turns)
    if kind == "compound":
        facts, pieces = compound_facts(rng, lambda: train_key(rng, 100, 10_000))
        ask = "Which report is about the {}?" + ("" if phrase else " Answer with the number only.")
        n_q = min(max(1, questions), len(facts))
        more = (n_q - 1) * 24
        text = _insert(_haystack(tok, stream, length - overhead - 14 * len(facts) - more, rng), pieces, rng)
        asked = [facts[j] for j in rng.permutation(len(facts))[:n_q]]
        turns = [(ask.format(t), f"The {t} is described in report {v}." if phrase else v) for t, v in asked]
        turns[0] = (f"{text}\n{turns[0][0]}", turns[0][1])
        return _chat(tok, turns)
    if kind == "docqa":
        if answer is None:
            raise ValueError("docqa samples are answered by a teacher: pass answer= (data.retrieval.teacher_answerer)")
        n_q = max(1, min(questions, 4))
        text = _haystack(tok, stream, length - overhead - 72 * n_q, rng)
        turns = []
        for q in _doc_questions(text, 3 * n_q, rng):  # a question the teacher has no answer to is dropped
            user = q if turns else f"{text}\n{q}"
            msgs = [{"role": r, "content": c} for u, a in turns for r, c in (("user", u), ("assistant", a))]
            prompt = tok.apply_chat_template(msgs + [{"role": "user", "content": user}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
            reply = answer(list(prompt))
            if reply is None:
                continue
            turns.append((user, reply))
            if len(turns) == n_q:
                break
        if not turns:  # the teacher answered nothing: the text is kept, with no target
            ids = list(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True, return_dict=False))
            return ids, [False] * len(ids)
        return _chat(tok, turns)
    raise ValueError(f"retrieval sample kind must be one of {', '.join(ALL_KINDS)}, got {kind!r}")


def retrieval_rows(tok, stream: np.ndarray, n_rows: int, seq_len: int, rng: np.random.Generator,
                   lengths: tuple[int, int] = (1024, 8192), fill: np.ndarray | None = None, questions: int = 1,
                   kinds: tuple[str, ...] = KINDS, answer: Callable[[list[int]], str | None] | None = None,
                   progress: bool = False, phrase: bool = False, varied: bool = False):
    """`n_rows` rows [n_rows, seq_len] int32 and their target masks (bool): one sample of a
    length drawn from `lengths` (capped below seq_len) each, then EOS and text from `fill`
    (default: `stream`) up to seq_len. The `kinds` take turns; a lookup (a docqa sample) asks
    up to `questions` of its facts; `answer` answers docqa samples (`teacher_answerer`); `phrase`:
    answers in a sentence; `varied`: pass keys in many wordings (`sample`)."""
    if not kinds or set(kinds) - set(ALL_KINDS):  # (a docqa sample without `answer` stops in `sample`)
        raise ValueError(f"retrieval kinds must be among {', '.join(ALL_KINDS)}, got {', '.join(kinds) or 'none'}")
    fill = stream if fill is None else fill
    eos = tok.eos_token_id
    rows = np.zeros((n_rows, seq_len), np.int32)
    mask = np.zeros((n_rows, seq_len), bool)
    lo, hi = lengths[0], min(lengths[1], seq_len - 64)
    at = 0
    rows_iter = range(n_rows)
    if progress:
        from tqdm.auto import tqdm

        rows_iter = tqdm(rows_iter, desc="retrieval rows", unit="row", leave=False)
    for r in rows_iter:
        L = int(rng.integers(lo, hi + 1))
        ids, m = sample(tok, stream, L, kinds[r % len(kinds)], rng, questions, answer, phrase, varied)
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


def answer_mask(mask: np.ndarray) -> np.ndarray:
    """The answers among a mask's targets [rows, T] (bool): in a `retrieval_rows` row the sample's
    targets are its answers, the EOS after it is never a target, and every position after that is
    (the text that fills the row). So a row's answers are its targets before its last non-target;
    a row that is all targets (corpus text) has none."""
    mask = np.asarray(mask, bool)
    T = mask.shape[-1]
    last_off = T - 1 - np.argmax(~mask[..., ::-1], axis=-1)  # the last False; T - 1 - 0 if the last is False
    has_off = (~mask).any(-1)
    before = np.arange(T) < np.where(has_off, last_off, 0)[..., None]
    return mask & before
