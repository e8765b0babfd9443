"""Questions about the demo's document, and a small pass-key probe, asked of the source and of
converted models with light adapters, on this CPU.

    python benchmarks/demo_questions.py --adapters adapters/smollm2-135m-w128-lora /path/to/other \
        --passkey-samples 2 --out benchmarks/results/demo
    python benchmarks/demo_questions.py --adapters none --sink-tokens 4 --passkey-samples 0 \
        --out benchmarks/results/demo-sinks      # the zero-shot conversion (the demo with --adapter none)

Every model answers the same prompts (the document of `orthros demo`, the same pass keys and
haystacks): greedy, through the chat template. An answer is right when it contains the expected
string as a word of its own (case-insensitive: "match" is not found in "matching"). Writes
questions.json and questions.md under --out.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import torch

# (question, the string a right answer contains) — each stated in the first 24,000 characters of
# the reference manual's "compound statements" chapter, the demo's document
QUESTIONS = [
    ('Which PEP specified the "with" statement?', "343"),
    ("Which function of the sys module gives the exception being handled in an except clause?",
     "sys.exception"),
    ('Which method of the context manager does the "with" statement load first?', "__enter__"),
    ("In which Python version were starred elements allowed in the for statement's expression list?",
     "3.11"),
    ('In which Python version could grouping parentheses split a "with" statement over several lines?',
     "3.10"),
    ('An "except*" clause\'s type cannot be a subclass of which class?', "BaseExceptionGroup"),
    ('What does iterating "range(3)" successively yield?', "2"),
    ('Which method of the context manager does the "with" statement call when the suite is left?',
     "__exit__"),
    ('Which keyword introduces the clause of a "try" statement that always runs on the way out?',
     "finally"),
    ("Which statement is used for pattern matching?", "match"),
    ('Which clause of a "for" loop runs when the loop ends without "break"?', "else"),
]


def right(text: str, want: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(want)}(?!\w)", text, re.IGNORECASE) is not None


def load(args):
    from orthros.demo.real import prepare_models
    from orthros.train.distill import load_teacher

    models = {}
    tok = None
    for a in args.adapters:
        ns = SimpleNamespace(model_dir=args.model_dir, window=args.window, adapter=a,
                             sink_tokens=args.sink_tokens if a == "none" else None)
        tok, src, model, what = prepare_models(ns)
        zs = f"orthros zero-shot{f' + {args.sink_tokens} sinks' if args.sink_tokens else ''}"
        models[f"orthros + {Path(a).name}" if a != "none" else zs] = model
    conv = Path(args.model_dir).parent / f"{Path(args.model_dir).name}-orthros-w{args.window}"
    models = {"source": load_teacher(conv, "cpu", torch.float32, attention="full").eval(), **models}
    return tok, models


@torch.no_grad()
def ask(model, tok, prompt: str, max_new_tokens: int) -> str:
    from orthros.generate import generate

    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    out = generate(model, torch.tensor([ids]), max_new_tokens=max_new_tokens, temperature=0.0,
                   stop_tokens=tok.eos_token_id)[0, len(ids):]
    return tok.decode([i for i in out.tolist() if i != tok.eos_token_id], skip_special_tokens=True).strip()


def main(argv=None) -> int:
    from orthros.demo.real import document
    from orthros.eval.longrange import chat_passkey

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--adapters", nargs="+", required=True, help="adapter directories, or 'none'")
    p.add_argument("--model-dir", default="runs/smollm2")
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--sink-tokens", type=int, default=0, help="attention sinks of the zero-shot ('none') conversion")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--passkey-lengths", type=int, nargs="*", default=[1024, 2048, 4096])
    p.add_argument("--passkey-samples", type=int, default=2, help="per depth (5 depths)")
    p.add_argument("--out", default="benchmarks/results/demo")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    tok, models = load(args)
    doc = document()
    res = {"command": "python benchmarks/demo_questions.py " + " ".join(argv or __import__("sys").argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": torch.get_num_threads(),
           "questions": [], "passkey": {}}
    for q, want in QUESTIONS:
        row = {"question": q, "expected": want, "answers": {}}
        for name, m in models.items():
            text = ask(m, tok, f"{doc}\n\nQuestion: {q}", args.max_new_tokens)
            row["answers"][name] = {"text": text, "right": right(text, want)}
            print(f"{name:>40}: {'RIGHT' if row['answers'][name]['right'] else 'wrong'}  {text[:90]!r}", flush=True)
        res["questions"].append(row)
    if args.passkey_samples:
        for name, m in models.items():
            t = time.time()
            r = chat_passkey(m, tok, args.passkey_lengths, [0.1, 0.3, 0.5, 0.7, 0.9], args.passkey_samples,
                             batch_size=1)
            res["passkey"][name] = {"by_length": r["by_length"], "samples_per_length": 5 * args.passkey_samples,
                                    "seconds": time.time() - t}
            print(f"{name:>40}: pass key {r['by_length']} ({time.time() - t:.0f} s)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "questions.json").write_text(json.dumps(res, indent=2))
    md = markdown(res)
    (out / "questions.md").write_text(md)
    print(md)
    return 0


def markdown(res: dict) -> str:
    """questions.md from questions.json's content."""
    names = list(res["questions"][0]["answers"])
    lines = ["| question | expected | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for row in res["questions"]:
        cells = [("✔ " if a["right"] else "✘ ") + a["text"][:60].replace("|", "\\|").replace("\n", " ")
                 for a in row["answers"].values()]
        lines.append(f"| {row['question']} | {row['expected']} | " + " | ".join(cells) + " |")
    lines.append("| **right** | | " + " | ".join(
        f"**{sum(r['answers'][n]['right'] for r in res['questions'])}/{len(res['questions'])}**" for n in names) + " |")
    if res["passkey"]:
        lengths = list(next(iter(res["passkey"].values()))["by_length"])
        n = next(iter(res["passkey"].values()))["samples_per_length"]
        lines += ["", f"| pass key ({n} per length) | " + " | ".join(lengths) + " |", "|---|" + "---|" * len(lengths)]
        for name, r in res["passkey"].items():
            lines.append(f"| {name} | " + " | ".join(f"{100 * r['by_length'][L]:.0f}%" for L in lengths) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
