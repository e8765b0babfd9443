"""Teach the output stream the direct lookup, on this CPU: train the output stream's SO alone.

The zero-shot conversion (W = 128, 4 sinks) keeps every layer's K/V of the source's shape, and its
output stream is exact full attention over them; the source's lookup heads (layers 18-23 of
SmolLM2-135M) are there but spread the answer's attention over the text after the needle
(`passkey_attention_probe.py`). This trains only `so_alpha_out` / `so_beta_out` (2 x 576 a
layer, 34,560 numbers: `make_trainable(model, "so-out")`) on retrieval samples (`data.retrieval`:
pass keys and key-value lookups in real text from the CPT corpus, training keys only), with the
loss on the answers, plus KL(source || model) at --general-positions random positions of a
--general-len row of corpus text: trained on answers alone, the output stream forgets the rest
(held-out perplexity +66-89% after 160 steps). The base stream, and so the KV cache, stays the
conversion's bit for bit. Each step is one sample and one text row; the base stream runs without
autograd (nothing it computes trains). `--chat-kl W` adds a KL to the source on its own greedy
chat answer to a question about a corpus excerpt: the retrieval answers are all numbers, and an
adapter trained on them alone starts every chat answer with one. `--init` continues an adapter.

    PYTHONPATH=src .venv/bin/python benchmarks/so_out_calibration.py --steps 160 \
        --out adapters/smollm2-135m-w128-s4-so-out

Writes the adapter (adapter.safetensors + adapter.json, with this command and the curve) and
prints the pass key's teacher-forced NLL on the evaluation prompts (`eval.longrange`: other keys,
another haystack) before and after.
"""

from __future__ import annotations

import argparse
import math
import random
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import sink_probe  # noqa: E402
from passkey_layer_probe import key_scores  # noqa: E402

from orthros.data.retrieval import sample, teacher_answerer  # noqa: E402
from orthros.eval.longrange import eval_key, passkey_prompt  # noqa: E402
from orthros.experiments.cpt import load_arm  # noqa: E402
from orthros.experiments.cpt_data import train_stream  # noqa: E402
from orthros.models.adapter import make_trainable, save_adapter  # noqa: E402


CHAT_QUESTIONS = ("What is this text about?", "Summarize the text above in one sentence.",
                  "Which function, class or module does the text above describe?", "What does the text above explain?")


def chat_kl(model, source, tok, stream, g, n_tokens: int, n_answer: int) -> torch.Tensor:
    """KL(source || model) over the first n_answer tokens of the source's greedy chat answer to a
    question about a corpus excerpt (and the position before them)."""
    from orthros.generate import generate

    a = int(g.integers(0, len(stream) - n_tokens))
    text = tok.decode(stream[a : a + n_tokens].tolist(), skip_special_tokens=True)
    q = CHAT_QUESTIONS[int(g.integers(0, len(CHAT_QUESTIONS)))]
    ids = tok.apply_chat_template([{"role": "user", "content": f"{text}\n\n{q}"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    with torch.no_grad():
        ans = generate(source, torch.tensor([ids]), max_new_tokens=n_answer, temperature=0.0)[0, len(ids):]
        full = torch.tensor([list(ids) + ans.tolist()])
        pos = torch.arange(len(ids) - 1, full.shape[1] - 1)
        want = F.log_softmax(source(input_ids=full, logits_to_keep=pos, use_cache=False).logits[0].float(), -1)
    got = F.log_softmax(model(input_ids=full, logits_to_keep=pos, use_cache=False).logits[0].float(), -1)
    return (want.exp() * (want - got)).sum(-1).mean()


def perplexity(model, rows: dict) -> dict:
    model.eval()
    return {d: math.exp(torch.stack([sink_probe.row_losses(model, r) for r in rs]).mean().item())
            for d, rs in rows.items()}


def probe(model, tok, cases, prompts) -> list[dict]:
    model.eval()
    out = []
    for (L, d, k), p in zip(cases, prompts):
        nll, hit = key_scores(model, tok, p, k)
        out.append({"length": L, "depth": d, "nll": nll, "hit": hit})
    return out


def fmt(ppl: dict) -> str:
    return " ".join(f"{d} {v:.3f}" for d, v in ppl.items())


def show(rows: list[dict]) -> str:
    return "  ".join(f"{r['length']}@{r['depth']} {r['nll']:.2f}{'*' if r['hit'] else ''}" for r in rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--lengths", type=int, nargs=2, default=[1024, 4096], help="samples' token range")
    ap.add_argument("--kinds", nargs="+", default=["passkey", "lookup"])
    ap.add_argument("--questions", type=int, default=4, help="facts a lookup asks in turn")
    ap.add_argument("--general-len", type=int, default=1024, help="tokens of the corpus row a step also reads")
    ap.add_argument("--general-positions", type=int, default=128, help="its positions the KL is taken at")
    ap.add_argument("--kl", type=float, default=1.0, help="weight of the KL to the source (0: answers only)")
    ap.add_argument("--chat-kl", type=float, default=0.0,
                    help="weight of a KL to the source on a chat answer about a corpus excerpt (its first "
                         "--chat-answer tokens, the source's greedy answer teacher-forced): answers that are "
                         "not numbers")
    ap.add_argument("--chat-answer", type=int, default=8)
    ap.add_argument("--init", default=None, help="an so-out adapter to start from")
    ap.add_argument("--phrase", action="store_true",
                    help="answers in a sentence, as the source answers ('The pass key is 56993.'), not bare keys")
    ap.add_argument("--heldout-rows", type=int, default=2, help="held-out code and prose rows (2K) scored")
    sink_probe.model_args(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-lengths", type=int, nargs="*", default=[2048, 4096])
    ap.add_argument("--out", default="runs/so-out-calibration")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    model, tok = sink_probe.zero_shot(Path(args.work), args.window, args.threads)
    sink_probe.set_sinks(model, args.sinks)
    if args.init:
        from orthros.models.adapter import apply_adapter

        apply_adapter(model, args.init)
    make_trainable(model, "so-out")
    params = [p for p in model.parameters() if p.requires_grad]
    stream = train_stream(tok, 2_000_000, Path(args.work) / "cache")
    rng = random.Random(11)
    cases = [(L, d, eval_key(rng)) for L in args.eval_lengths for d in (0.25, 0.5) for _ in range(2)]
    prompts = [passkey_prompt(tok, L, d, k) for L, d, k in cases]
    held = sink_probe.heldout_rows(tok, Path(args.work), args.heldout_rows, 2048, 8192)
    source = (load_arm(Path(args.work) / "orthros", "source", args.window, "cpu").eval()
              if args.kl or args.chat_kl or "docqa" in args.kinds else None)
    answer = teacher_answerer(source, tok) if "docqa" in args.kinds else None
    before = probe(model, tok, cases, prompts)
    ppl_before = perplexity(model, held)
    print("pass key NLL before:", show(before), "| perplexity", fmt(ppl_before), flush=True)
    opt = torch.optim.Adam(params, lr=args.lr)
    g = np.random.default_rng(args.seed)
    losses, kls, chats, tokens, t0 = [], [], [], 0, time.time()
    model.train()
    for s in range(args.steps):
        ids, mask = sample(tok, stream, int(g.integers(args.lengths[0], args.lengths[1] + 1)),
                           args.kinds[s % len(args.kinds)], g, questions=args.questions, answer=answer,
                           phrase=args.phrase)
        x = torch.tensor([ids])
        labels = torch.where(torch.tensor([mask]), x, torch.full_like(x, -100))
        loss = model(input_ids=x, labels=labels, use_cache=False).loss
        kl = torch.zeros(())
        if args.kl:
            a = int(g.integers(0, len(stream) - args.general_len))
            row = torch.from_numpy(stream[a : a + args.general_len].astype(np.int64))[None]
            pos = torch.from_numpy(np.sort(g.choice(args.general_len, args.general_positions, replace=False)))
            with torch.no_grad():
                want = F.log_softmax(source(input_ids=row, logits_to_keep=pos, use_cache=False).logits[0].float(), -1)
            got = F.log_softmax(model(input_ids=row, logits_to_keep=pos, use_cache=False).logits[0].float(), -1)
            kl = (want.exp() * (want - got)).sum(-1).mean()
        chat = torch.zeros(())
        if args.chat_kl:
            chat = chat_kl(model, source, tok, stream, g, args.general_len, args.chat_answer)
        (loss + args.kl * kl + args.chat_kl * chat).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        kls.append(kl.item())
        chats.append(chat.item())
        tokens += len(ids) + (args.general_len if args.kl else 0) + (args.general_len if args.chat_kl else 0)
        if (s + 1) % 20 == 0 or s + 1 == args.steps:
            print(f"step {s + 1}/{args.steps}  answer loss {np.mean(losses[-20:]):.3f}  KL {np.mean(kls[-20:]):.3f}  "
                  f"chat KL {np.mean(chats[-20:]):.3f}  ({time.time() - t0:.0f} s)", flush=True)
    seconds = time.time() - t0
    after = probe(model, tok, cases, prompts)
    ppl_after = perplexity(model, held)
    print("pass key NLL after: ", show(after), "| perplexity", fmt(ppl_after), flush=True)
    meta = {"mode": "so-out", "window": args.window, "sink_tokens": args.sinks, "tokens": tokens,
            "command": "python benchmarks/so_out_calibration.py " + shlex.join(sys.argv[1:]),
            "train": {"steps": args.steps, "lr": args.lr, "lengths": args.lengths, "kinds": args.kinds,
                      "questions": args.questions, "seed": args.seed, "seconds": seconds, "loss_curve": losses,
                      "kl_curve": kls, "chat_kl_curve": chats, "kl": args.kl, "chat_kl": args.chat_kl,
                      "general_len": args.general_len,
                      "general_positions": args.general_positions},
            "passkey_nll": {"before": before, "after": after},
            "heldout_ppl_2k": {"rows": args.heldout_rows, "before": ppl_before, "after": ppl_after}}
    print("adapter:", save_adapter(model, args.out, meta))


if __name__ == "__main__":
    main()
