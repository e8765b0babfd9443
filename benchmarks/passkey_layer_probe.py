"""Which layers' base windows cost the zero-shot conversion its long-range pass key? A CPU probe.

SmolLM2-135M-Instruct converted to Orthros (W = 128, 4 attention sinks, untrained) answers a pass
key through the chat template when the key sits within ~1K tokens of the question and loses it
beyond (docs/results.md). Its output stream is exact full attention over every layer's base-stream
keys and values; only the base stream's hidden states differ from the source's. This probe gives
the base stream of chosen layers full attention again (`base_window = None` on those layers, the
rest unchanged) and measures, teacher-forced, the key's digits after the answer prefix
"The pass key is ": their mean negative log-likelihood and whether every digit is the argmax.
A layer set that restores the source's figures names where the base stream's window breaks the
lookup. `--wide` gives those layers a wider window instead; `--tails K` gives full base rows to
the prompt's last K tokens in every layer; `--spans` to the rows before, around or after the
needle in the first third of the layers. Found (docs/notes/2026-12-conversion.md): the first
layers' rows after the needle carry the key forward in the source, which no window can.

    PYTHONPATH=src .venv/bin/python benchmarks/passkey_layer_probe.py --samples 3    # 2K, 12 min, 2 cores
    PYTHONPATH=src .venv/bin/python benchmarks/passkey_layer_probe.py --lengths 4096 --depths 0.0 0.5 \
        --samples 2 --sets none "first third" "first two thirds" --wide 0 512 1024 \
        --out benchmarks/results/sink-probe/passkey_layer_probe_wide.json
    PYTHONPATH=src .venv/bin/python benchmarks/passkey_layer_probe.py --lengths 4096 --depths 0.0 0.5 \
        --samples 2 --tails 16 32 64 256 --out benchmarks/results/sink-probe/passkey_tail_probe.json
    PYTHONPATH=src .venv/bin/python benchmarks/passkey_layer_probe.py --lengths 4096 --depths 0.25 0.5 \
        --samples 2 --spans before needle after --out benchmarks/results/sink-probe/passkey_span_probe.json
    PYTHONPATH=src .venv/bin/python benchmarks/passkey_layer_probe.py --lengths 512 --samples 1 --sets none all

Prompts: `eval.longrange.passkey_prompt` (the CPT table's pass key), keys from `eval_key`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import sink_probe  # noqa: E402  (model loading, the sinks switch)

from orthros.eval.longrange import NEEDLE, eval_key, passkey_prompt  # noqa: E402
from orthros.layers.attention import OrthrosAttention  # noqa: E402


def layer_sets(n: int) -> dict[str, list[int]]:
    t = n // 3
    return {"none": [], "all": list(range(n)), "first third": list(range(t)), "middle third": list(range(t, 2 * t)),
            "last third": list(range(2 * t, n)), "first two thirds": list(range(2 * t)),
            "last two thirds": list(range(t, n))}


def set_full_layers(model, layers: list[int], window: int, wide: int | None = None):
    """the base stream of `layers` sees `wide` keys (None: its whole document), the rest `window`"""
    mods = [m for m in model.modules() if isinstance(m, OrthrosAttention)]
    for i, m in enumerate(mods):
        m.base_window = wide if i in layers else window


def needle_span(tok, prompt: list[int], key: str) -> tuple[int, int]:
    """(first, last + 1) token of the needle sentence in the prompt"""
    ids = tok(NEEDLE.format(key=key), add_special_tokens=False)["input_ids"]
    core = ids[1:-1]  # (the first and last tokens may merge with their neighbours)
    for i in range(len(prompt) - len(core) + 1):
        if prompt[i : i + len(core)] == core:
            return i - 1, i + len(core) + 1
    raise ValueError("needle not found in the prompt")


class FullTail:
    """Base rows at positions [start, stop) of every layer attend to their whole document (the
    rest keep their window): a prompt whose last tokens, the question, read everything."""

    span = None
    layers = None  # None: every layer

    @classmethod
    def install(cls):
        orig = OrthrosAttention._attend_group

        def attend_group(self, q, n_base, kv, layout, attend_):
            out = orig(self, q, n_base, kv, layout, attend_)
            if (cls.span is None or n_base == 0 or self.base_window is None
                    or cls.layers is not None and self.layer_idx not in cls.layers):
                return out
            a, b = cls.span
            a, b = min(a, n_base), min(b, n_base)  # base rows are the group's first n_base, at positions 0..
            if a >= b:
                return out
            saved, self.base_window = self.base_window, None
            try:
                full = orig(self, q, n_base, kv, layout, attend_)
            finally:
                self.base_window = saved
            out = out.clone()
            out[:, a:b] = full[:, a:b]
            return out

        OrthrosAttention._attend_group = attend_group


@torch.no_grad()
def key_scores(model, tok, prompt: list[int], key: str) -> tuple[float, bool]:
    """(mean NLL of the key's tokens after the answer prefix, every key token the argmax)"""
    prefix = tok("The pass key is ", add_special_tokens=False)["input_ids"]
    ans = tok(key, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt + prefix + ans])
    # the last len(ans) + 1 positions as output positions (SPEC invariant 1: their logits are those
    # of the every-position forward, without its O(T^2) output stream)
    logits = model(input_ids=ids, logits_to_keep=len(ans) + 1, use_cache=False).logits[0, :-1].float()
    target = torch.tensor(ans)
    nll = F.cross_entropy(logits, target).item()
    return nll, bool((logits.argmax(-1) == target).all())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 1.0])
    ap.add_argument("--samples", type=int, default=2, help="keys per length and depth")
    sink_probe.model_args(ap)
    ap.add_argument("--sets", nargs="+", default=None, help="layer sets to run (default all of layer_sets)")
    ap.add_argument("--wide", type=int, nargs="+", default=[0],
                    help="the chosen layers' base window (0: full attention); one run per value and set")
    ap.add_argument("--tails", type=int, nargs="+", default=[],
                    help="instead of layer sets: the prompt's last K tokens' base rows attend to the whole prompt")
    ap.add_argument("--spans", nargs="+", default=[], choices=["before", "needle", "after"],
                    help="instead of layer sets: in the first third of the layers, full base rows only "
                         "before the needle, around it (+-64 tokens) or after it")
    ap.add_argument("--adapter", default=None, help="a light-CPT adapter directory to apply first (trained "
                    "with --sinks sink tokens at --window), e.g. the CPT run's adapters/orthros-kd-d-lora-sink")
    ap.add_argument("--out", default="benchmarks/results/sink-probe/passkey_layer_probe.json")
    args = ap.parse_args()
    t0 = time.time()
    model, tok = sink_probe.with_sinks(Path(args.work), args.window, args.sinks, args.threads, args.adapter)
    sets = layer_sets(model.config.num_hidden_layers)
    names = args.sets or list(sets)
    rng = random.Random(7)
    cases = [(L, d, eval_key(rng)) for L in args.lengths for d in args.depths for _ in range(args.samples)]
    prompts = [passkey_prompt(tok, L, d, k) for L, d, k in cases]
    results = {}
    runs = [(n, w, 0) for n in names for w in (args.wide if n not in ("none", "all") else [0])]
    if args.tails:
        FullTail.install()
        runs = [("none", 0, 0)] + [("none", 0, k) for k in args.tails]
    if args.spans:
        FullTail.install()
        FullTail.layers = set(sets["first third"])
        runs = [("none", 0, 0)] + [("none", 0, sp) for sp in args.spans]
    for name, wide, tail in runs:
        set_full_layers(model, sets[name], args.window, wide or None)
        name = name if not wide else f"{name} W={wide}"
        if isinstance(tail, str):
            name = f"first third, full base rows {dict(needle='around').get(tail, tail)} the needle"
        elif tail:
            name = f"last {tail} prompt tokens full"
        t1 = time.time()
        rows = []
        for (L, d, k), p in zip(cases, prompts):
            FullTail.span = (len(p) - tail, len(p)) if tail and not isinstance(tail, str) else None
            if isinstance(tail, str):
                n0, n1 = needle_span(tok, p, k)
                FullTail.span = {"before": (0, n0 - 64), "needle": (n0 - 64, n1 + 64), "after": (n1 + 64, len(p))}[tail]
            nll, hit = key_scores(model, tok, p, k)
            rows.append({"length": L, "depth": d, "key": k, "nll": nll, "hit": hit})
        cells = {}
        for r in rows:
            c = cells.setdefault(f"{r['length']}@{r['depth']}", {"nll": 0.0, "hit": 0.0, "n": 0})
            c["nll"] += r["nll"]
            c["hit"] += r["hit"]
            c["n"] += 1
        cells = {c: {"nll": v["nll"] / v["n"], "hit": v["hit"] / v["n"]} for c, v in cells.items()}
        results[name] = {"layers": sets[name.split(" W=")[0]] if not tail else [], "wide": wide or None,
                         "tail": tail, "span_layers": sorted(FullTail.layers or []), "cells": cells, "rows": rows}
        print(f"{name:>17}: " + "  ".join(f"{c} {v['nll']:.2f}/{v['hit']:.0%}" for c, v in cells.items())
              + f"  ({time.time() - t1:.0f}s)", flush=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results,
                                              "seconds": time.time() - t0}, indent=1))


if __name__ == "__main__":
    main()
