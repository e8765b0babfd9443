"""Does a converted model find a fact only in the words it was trained to look up? The demo's archive
code and the training's pass key, each written into the demo's document and asked, in four phrasings.

    python benchmarks/fact_phrasing_probe.py --adapters adapters/smollm2-135m-w512-s4-lora-mix /tmp/a52 \
        --out benchmarks/results/fact-phrasing

The document is `orthros demo`'s ("Compound statements", 24,000 characters); a 5-digit code (never
a training key: `data.retrieval.eval_key`) is written as one line at each --depths, and the question
asked through the chat template as the demo asks it. Each phrasing's fact, question and the answer's
first words:

    demo             "The archive code of this chapter is K."  (the demo's own fact and question)
    demo-noun        the demo's noun in the training's needle and question form
    trained-noun     the training's noun ("pass key") in the demo's sentence and question form
    trained          the training's pass-key needle and question, word for word
    held-out         the demo's noun in a sentence and a question of forms no training wording has
                     (data.retrieval's fixed needles nor its `varied` ones)

Per model and phrasing: the greedy answers that hold the code, and log p(code | the answer's first
words), teacher-forced, the mean over depths (nats). The source model is transformers' Llama; each
adapter is applied to the conversion it was trained on. Writes <tag>.json and <tag>.md under --out.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

PHRASINGS = {  # fact line, question, the answer's first words (scored before the code)
    "demo": ("The archive code of this chapter is {k}.", "What is the archive code of this chapter?",
             "The archive code of this chapter is "),
    "demo-noun": ("The archive code is {k}. Remember it. {k} is the archive code.",
                  "What is the archive code? Answer with the number only.", "The archive code is "),
    "trained-noun": ("The pass key of this chapter is {k}.", "What is the pass key of this chapter?",
                     "The pass key of this chapter is "),
    "trained": ("The pass key is {k}. Remember it. {k} is the pass key.",
                "What is the pass key? Answer with the number only.", "The pass key is "),
    "held-out": ("For the record, {k} is this chapter's archive code.", "Tell me this chapter's archive code.",
                 "This chapter's archive code is "),
}


@torch.no_grad()
def read_facts(model, tok, phrasings, depths=(0.1, 0.5, 0.9), seed: int = 0) -> dict:
    """{phrasing: {right, logprob: [nats a depth], answers}}: the demo's document with an evaluation key
    written at each depth in each phrasing and asked; greedy answers (16 tokens) and log p(key | the
    answer's first words). The keys are drawn from `seed`, phrasing by phrasing, depth by depth."""
    from tqdm.auto import tqdm

    from orthros.data.retrieval import eval_key
    from orthros.demo import real

    doc, rng = real.document(), random.Random(seed)
    cases = [(ph, d, eval_key(rng)) for ph in phrasings for d in depths]
    out = {ph: {"right": 0, "logprob": [], "answers": []} for ph in phrasings}
    for ph, depth, k in tqdm(cases, leave=False, desc="prompts"):
        fact, question, pre = PHRASINGS[ph]
        ids = real.prompt_ids(tok, real.with_fact(doc, fact.format(k=k), depth), question)
        said = real.greedy_answer(model, tok, ids)
        lp = real.answer_logprob(model, ids + tok.encode(pre, add_special_tokens=False),
                                 tok.encode(k, add_special_tokens=False))
        r = out[ph]
        r["right"] += k in said
        r["logprob"].append(lp)
        r["answers"].append({"depth": depth, "code": k, "text": said, "logprob": lp})
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default="runs/smollm2", help="the source model (orthros download)")
    p.add_argument("--adapters", nargs="+", default=["none"], help="adapter directories, or none (W=512)")
    p.add_argument("--sink-tokens", type=int, default=4)
    p.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.5, 0.9])
    p.add_argument("--phrasings", nargs="+", default=list(PHRASINGS)[:4], choices=list(PHRASINGS),
                   help="default: the first four (held-out: for models trained on varied wordings)")
    p.add_argument("--no-source", action="store_true", help="skip the source model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/fact-phrasing")
    p.add_argument("--tag", default="phrasing")
    a = p.parse_args(argv)

    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orthros.demo import real
    from orthros.loading import load_model
    from orthros.models.adapter import apply_adapter

    torch.set_grad_enabled(False)
    hf, _ = real.source_and_conversion(a.model_dir, 512, a.sink_tokens)
    tok = AutoTokenizer.from_pretrained(str(hf))
    models = [] if a.no_source else [("source", None, None)]
    for ad in a.adapters:
        models.append((ad if ad != "none" else "conversion W=512, no adapter",
                       real.source_and_conversion(a.model_dir, 512, a.sink_tokens)[1] if ad == "none"
                       else real.conversion_for(a.model_dir, ad, a.sink_tokens), None if ad == "none" else ad))
    rows = {}
    for name, cdir, ad in tqdm(models, desc="models"):
        if cdir is None:
            m = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
        else:
            m = load_model(cdir).eval()
            if ad is not None:
                apply_adapter(m, ad)
        rows[name] = read_facts(m, tok, a.phrasings, a.depths, a.seed)
        print(name, {ph: (r["right"], round(sum(r["logprob"]) / len(r["logprob"]), 2)) for ph, r in rows[name].items()},
              flush=True)
    n = len(a.depths)
    lines = [f"`orthros demo`'s document with a 5-digit code written at depths {', '.join(map(str, a.depths))}, "
             "asked through the chat template. Cells: greedy answers holding the code / "
             f"{n}; mean log p(code | the answer's first words), nats.", "",
             "| model | " + " | ".join(a.phrasings) + " |", "|---|" + "---|" * len(a.phrasings)]
    for name, r in rows.items():
        lines.append(f"| {name} | " + " | ".join(
            f"{r[ph]['right']} / {n}; {sum(r[ph]['logprob']) / n:.2f}" for ph in a.phrasings) + " |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.tag}.json").write_text(json.dumps({"phrasings": {ph: PHRASINGS[ph] for ph in a.phrasings},
                                                   "depths": a.depths, "rows": rows}, indent=1))
    (out / f"{a.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
