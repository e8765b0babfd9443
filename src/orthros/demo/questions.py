"""`orthros demo --questions`: both models answer a set of questions about documents in their context.

Each question is about one chapter of Python's reference manual (`pydoc_data.topics`, on every
Python), placed at a set depth among other chapters, so the answer must be found in a context of
`--document-chars` characters (about 5K tokens by default) that mostly does not hold it. Each
answer is printed and written in full; "right" says whether it contains the expected fact (a
pattern over the answer: a PEP number, a word), a convenience for reading the table, not a grader.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import real


@dataclass(frozen=True)
class Question:
    topic: str  # the chapter (a key of pydoc_data.topics) that holds the answer
    question: str
    expected: str  # a regular expression an answer holding the fact matches (case-insensitive)
    fact: str  # the sentence of the chapter that answers it (checked to be there)


QUESTIONS = (
    Question("class", "Which PEP added class decorators?", r"\b3129\b",
             "PEP 3129** - Class Decorators The proposal that added class decorators"),
    Question("class", "In which PEP were function and method decorators introduced?", r"\b318\b",
             "Function and method decorators were introduced in **PEP 318**"),
    Question("nonlocal", 'Which PEP is titled "Access to Names in Outer Scopes"?', r"\b3104\b",
             "PEP 3104** - Access to Names in Outer Scopes"),
    Question("strings", "Which PEP reintroduced the u'value' unicode literal?", r"\b414\b",
             "See **PEP 414** for more information"),
    Question("import", 'Which PEP is called "Back to the __future__"?', r"\b236\b",
             "PEP 236** - Back to the __future__"),
    Question("function", 'Which PEP specified the "/" syntax for positional-only parameters?', r"\b570\b",
             "See **PEP 570** for details"),
    Question("function", "Which PEP proposed the postponed evaluation of annotations?", r"\b563\b",
             "PEP 563** - Postponed Evaluation of Annotations"),
    Question("assignment", 'Which PEP specified extended iterable unpacking (the "*target" feature)?', r"\b3132\b",
             "PEP 3132** - Extended Iterable Unpacking"),
    Question("integers", "What character can be used to group the digits of an integer literal?",
             r"underscore|\"_\"|'_'|`_`", "Underscores are ignored for determining the numeric value"),
    Question("while", 'What happens when a "break" statement is executed in the first suite of a while loop?',
             r"without (executing|running) the .?else|(not|never|skip\w*)\W+(\w+\W+){0,3}.?else",
             "statement executed in the first suite terminates the loop without executing"),
)
# the chapters around each question's own (the haystack), in this order
FILLER = ("if", "for", "try", "with", "raise", "global", "del", "return", "yield", "lambda", "comparisons",
          "booleans", "atom-literals", "operator-summary", "exceptions")
DEPTHS = (0.1, 0.5, 0.9)  # where the question's chapter starts, as a share of the context (in turn)


def context(q: Question, chars: int, depth: float) -> str:
    """`chars` characters: other chapters, with q's chapter whole starting at about `depth` of them."""
    from pydoc_data.topics import topics

    own = topics[q.topic]
    if " ".join(q.fact.split()) not in " ".join(own.split()):
        raise AssertionError(f"{q.topic}: the fact of {q.question!r} is not in the chapter")
    rest = "\n\n".join(topics[t] for t in FILLER if t != q.topic)
    room = max(0, chars - len(own))
    before = int(room * depth)
    return rest[:before] + "\n\n" + own + "\n\n" + rest[before: room]


def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok, src, model, what = real.prepare_models(args)
    eos = tok.eos_token_id
    rows = []
    print(f"[2/4] {len(QUESTIONS)} questions, each about one chapter of Python's reference manual inside "
          f"{args.document_chars:,} characters of other chapters", flush=True)
    t0 = time.perf_counter()
    for i, q in enumerate(QUESTIONS):
        depth = DEPTHS[i % len(DEPTHS)]
        text = context(q, args.document_chars, depth)
        ids = real.prompt_ids(tok, text, q.question)
        row = {**asdict(q), "depth": depth, "prompt_tokens": len(ids)}
        for key, m, hf in (("source", src, True), ("orthros", model, False)):
            toks, ttft = real.answer(m, ids, args.max_new_tokens, eos, hf)
            ans = tok.decode(toks, skip_special_tokens=True).strip()
            row[key] = {"answer": ans, "right": bool(re.search(q.expected, ans, re.I)), "ttft_s": ttft}
        rows.append(row)
        said = {k: f"{'right' if row[k]['right'] else 'wrong'}: {_short(row[k]['answer'])}"
                for k in ("source", "orthros")}
        print(f"      {i + 1:>2}. {q.question}  [{len(ids):,} tokens, chapter at {depth:.0%}; "
              f"{time.perf_counter() - t0:.0f} s]\n          source  {said['source']}\n"
              f"          Orthros {said['orthros']}", flush=True)
    score = {k: sum(r[k]["right"] for r in rows) for k in ("source", "orthros")}
    print(f"[3/4] right: source {score['source']} / {len(rows)}, {what} {score['orthros']} / {len(rows)}")
    res = {"orthros_model": what, "document_chars": args.document_chars, "max_new_tokens": args.max_new_tokens,
           "right": score, "questions": rows, "threads": torch.get_num_threads()}
    (out / "questions.json").write_text(json.dumps(res, indent=2))
    (out / "questions.md").write_text(table(res))
    print(f"[4/4] saved {out / 'questions.json'} and {out / 'questions.md'}")
    return 0


def _short(s: str, n: int = 110) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 1] + "…"


def table(res: dict) -> str:
    """The answers as a Markdown table."""
    cell = lambda a: f"{'✓' if a['right'] else '✗'} {_short(a['answer'], 200)}".replace("|", "\\|")  # noqa: E731
    lines = [f"Orthros model: {res['orthros_model']}; contexts of {res['document_chars']:,} characters; "
             f"right: source {res['right']['source']}, Orthros {res['right']['orthros']} of "
             f"{len(res['questions'])}.", "",
             "| # | question (chapter, where) | tokens | source | Orthros |", "| --- | --- | ---: | --- | --- |"]
    for i, r in enumerate(res["questions"]):
        lines.append(f"| {i + 1} | {r['question']} ({r['topic']}, {r['depth']:.0%}) | {r['prompt_tokens']:,} | "
                     f"{cell(r['source'])} | {cell(r['orthros'])} |")
    return "\n".join(lines) + "\n"
