"""Where does the answer's attention go? A CPU probe of the pass key through the chat template.

`passkey_layer_probe.py` found that the source carries the key forward through the rows after the
needle, which a base window cannot do; so a conversion keeps the key only if its output stream
learns to read it directly. This probe measures whether it does: teacher-forced on the prompt and
"The pass key is <key>", it takes, in every layer, the attention of the row that predicts the key's
first token and sums its probability mass over regions of the prompt:

    digits   the key's own tokens in the needle
    needle   the rest of the needle sentence
    near     the 128 rows after the needle (whose base windows still see it)
    after    the rows from there to the question (the source's carriers)
    before   the rows before the needle but the first 4
    question the prompt's last 32 tokens (the question and the chat template's tail)
    sinks    the prompt's first 4 tokens

per head. The table prints each layer's largest head mass on the digits and on the text after the
needle; the file keeps every head. Models: the source (full attention), the zero-shot conversion
(W = 128, 4 sinks) and, with --adapters, light-CPT adapters on it. Mass on the digits in the
output stream is the direct lookup; the key's NLL is printed beside it.

    PYTHONPATH=src .venv/bin/python benchmarks/passkey_attention_probe.py --lengths 2048 4096 \
        --adapters <adapter dir> ... --out benchmarks/results/sink-probe/passkey_attention_probe.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import sink_probe  # noqa: E402
from passkey_layer_probe import needle_span  # noqa: E402

from orthros.eval.longrange import eval_key, passkey_prompt  # noqa: E402
from orthros.experiments.cpt import load_arm  # noqa: E402
from orthros.layers.attention import OrthrosAttention  # noqa: E402

REGIONS = ("digits", "needle", "near", "after", "before", "question", "sinks")


class Recorder:
    """Wraps `OrthrosAttention._attend_group`: for the last `rows` query rows of the sequence (output
    rows in Orthros, the causal rows of a full-attention model) it records the attention probabilities
    over the dense keys of the call, per layer: [rows, H, S]."""

    rows = 0
    probs: dict[int, torch.Tensor] = {}

    @classmethod
    def install(cls):
        orig = OrthrosAttention._attend_group

        def attend_group(self, q, n_base, kv, layout, attend_):
            out = orig(self, q, n_base, kv, layout, attend_)
            full = self.base_window is None
            if cls.rows and (n_base < q.shape[1] or full):
                m = cls.rows
                qm = q[0, -m:].float()  # [m, H, D]
                k = kv.k[0].float()  # [S, Hkv, D]
                S, rep = k.shape[0], q.shape[2] // k.shape[1]
                k = k.repeat_interleave(rep, dim=1)  # [S, H, D]
                s = torch.einsum("mhd,shd->mhs", qm, k) / math.sqrt(q.shape[-1])
                pos = torch.arange(S - m, S)[:, None, None]
                s = s.masked_fill(torch.arange(S)[None, None, :] > pos, float("-inf"))
                cls.probs[self.layer_idx] = s.softmax(-1)
            return out

        OrthrosAttention._attend_group = attend_group


def regions(tok, prompt: list[int], key: str) -> dict[str, list[int]]:
    n0, n1 = needle_span(tok, prompt, key)
    kid = tok(key, add_special_tokens=False)["input_ids"]
    d0 = next(i for i in range(n0, n1) if prompt[i : i + len(kid)] == kid)
    digits = list(range(d0, d0 + len(kid)))
    T = len(prompt)
    near = min(n1 + 128, T - 32)
    return {"digits": digits, "needle": [i for i in range(n0, n1) if i not in digits], "near": list(range(n1, near)),
            "after": list(range(near, T - 32)), "before": list(range(4, n0)), "question": list(range(T - 32, T)),
            "sinks": list(range(4))}


@torch.no_grad()
def probe(model, tok, prompt: list[int], key: str, prefix: str = "The pass key is ") -> dict:
    prefix = tok(prefix, add_special_tokens=False)["input_ids"] if prefix else []
    ans = tok(key, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt + prefix + ans])
    m = len(ans) + 1  # the rows that predict the key's tokens (and the one after)
    Recorder.rows, Recorder.probs = m, {}
    logits = model(input_ids=ids, logits_to_keep=m, use_cache=False).logits[0, :-1].float()
    Recorder.rows = 0
    nll = F.cross_entropy(logits, torch.tensor(ans)).item()
    reg = regions(tok, prompt, key)
    layers = {}
    for li, p in sorted(Recorder.probs.items()):
        p = p[0]  # [H, S]: the row that predicts the key's first token
        layers[li] = {r: [round(x, 4) for x in p[:, idx].sum(-1).tolist()] for r, idx in reg.items()}  # [H]
    return {"nll": nll, "hit": bool((logits.argmax(-1) == torch.tensor(ans)).all()), "layers": layers}


def summary(results: dict) -> dict:
    """{model: {length: key NLL and, per layer, the mean over prompts of the largest head mass on the
    digits and on the text after the needle (near + after)}}"""
    out = {}
    for name, rows in results.items():
        for L in sorted({r["length"] for r in rows}):
            rs = [r for r in rows if r["length"] == L]
            n = len(rs)
            layers = sorted(rs[0]["layers"], key=int)
            out.setdefault(name, {})[str(L)] = {
                "nll": sum(r["nll"] for r in rs) / n, "hits": sum(r["hit"] for r in rs) / n,
                "digits": [round(sum(max(r["layers"][li]["digits"]) for r in rs) / n, 3) for li in layers],
                "after": [round(sum(max(a + b for a, b in zip(r["layers"][li]["near"], r["layers"][li]["after"]))
                                    for r in rs) / n, 3) for li in layers]}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.5])
    ap.add_argument("--samples", type=int, default=2)
    sink_probe.model_args(ap)
    ap.add_argument("--adapters", nargs="*", default=[], help="light-CPT adapter directories, each applied to "
                    "the zero-shot conversion (trained with --sinks sinks at --window)")
    ap.add_argument("--models", nargs="+", default=["source", "zero-shot"], help="besides the adapters")
    ap.add_argument("--prefix", default="The pass key is ",
                    help="the answer's words before the key ('' : the key right after the chat template's "
                         "assistant header, as a model trained on bare-key answers answers)")
    ap.add_argument("--out", default="benchmarks/results/sink-probe/passkey_attention_probe.json")
    args = ap.parse_args()
    t0 = time.time()
    Recorder.install()
    orth, tok = sink_probe.zero_shot(Path(args.work), args.window, args.threads)
    models = {}
    if "source" in args.models:
        models["source"] = load_arm(Path(args.work) / "orthros", "source", args.window, "cpu").eval()
    if "zero-shot" in args.models:
        sink_probe.set_sinks(orth, args.sinks)
        models["zero-shot"] = orth
    for path in args.adapters:
        from orthros.models.adapter import apply_adapter

        ad, _ = sink_probe.zero_shot(Path(args.work), args.window, args.threads)
        sink_probe.set_sinks(ad, args.sinks)
        apply_adapter(ad, path)
        models[Path(path).name] = ad
    rng = random.Random(11)
    cases = [(L, d, eval_key(rng)) for L in args.lengths for d in args.depths for _ in range(args.samples)]
    prompts = [passkey_prompt(tok, L, d, k) for L, d, k in cases]
    results = {}
    for name, model in models.items():
        rows = []
        for (L, d, k), p in zip(cases, prompts):
            t1 = time.time()
            r = probe(model, tok, p, k, args.prefix)
            rows.append({"length": L, "depth": d, "key": k, **r})
            # the row predicting the key's first token: each layer's largest head mass on the digits
            top = [max(v["digits"]) for _, v in sorted(r["layers"].items())]
            aft = [max(a + b for a, b in zip(v["near"], v["after"])) for _, v in sorted(r["layers"].items())]
            print(f"{name[:12]:>12} {L}@{d} nll {r['nll']:.2f} {'hit' if r['hit'] else '   '} digits/layer: "
                  + " ".join(f"{x:.2f}" for x in top) + f"\n{'':>30}after/layer:  " + " ".join(f"{x:.2f}" for x in aft)
                  + f"  ({time.time() - t1:.0f}s)", flush=True)
        results[name] = rows
        Path(args.out).write_text(json.dumps({"args": vars(args), "summary": summary(results), "results": results,
                                              "seconds": time.time() - t0}))


if __name__ == "__main__":
    main()
