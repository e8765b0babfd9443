"""Which layers' base-stream K/V lose the demo's answer? The source's K/V put into the conversion, layer by layer.

    python benchmarks/kv_oracle_probe.py --out benchmarks/results/kv-oracle

Orthros's output rows attend with full attention to the base stream's keys and values, so a conversion
whose every layer made the source's K/V would give the source's logits exactly. This probe measures how
far from that the demo's answer is, and where: for each set of layers it gives those layers of the
conversion (4 sinks; an --adapter at the window it was trained at, or none at 128) the source's K/V
(the source's normed input to that layer's attention through the conversion's own K/V projections: for
the conversion with no adapter these are the source's K/V themselves) and scores the demo's question as
`demo_answer_margin.py` does: log p(right) - log p(wrong) after "The PEP ". The sets: none, all, the first n and the last n layers
for each --n. Writes <tag>.json and <tag>.md under --out.
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from pathlib import Path

import torch


def source_attention_inputs(hf_model, ids: list[int]) -> list[torch.Tensor]:
    """Each layer's normed input to its attention [1, T, C], from one forward of the source."""
    got = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: got.__setitem__(i, (args[0] if args else kwargs["hidden_states"]).detach()),
        with_kwargs=True) for i, layer in enumerate(hf_model.model.layers)]
    try:
        hf_model(torch.tensor([ids], device=hf_model.device))
    finally:
        for h in hooks:
            h.remove()
    return [got[i] for i in range(len(got))]


@contextmanager
def oracle(model, inputs: list[torch.Tensor], layers: set[int]):
    """Within: the named layers of an Orthros model make K/V from the source's attention inputs."""
    patched = []
    for i in layers:
        attn = model.model.layers[i].self_attn
        orig = attn.keys_values

        def kv(x, cos, sin, orig=orig, src=inputs[i]):
            assert src.shape[1] == x.shape[1], "the oracle needs one call over the whole prompt"
            return orig(src.to(x.dtype), cos, sin)

        attn.keys_values = kv
        patched.append(attn)
    try:
        yield
    finally:
        for attn in patched:
            del attn.keys_values


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default="runs/smollm2", help="the source model (orthros download)")
    p.add_argument("--adapter", default="none", help="an adapter directory, or none")
    p.add_argument("--sink-tokens", type=int, default=4)
    p.add_argument("--question", default=None, help="default: the demo's")
    p.add_argument("--prefix", default="The PEP ")
    p.add_argument("--candidates", nargs=2, default=["343", "634"], help="the right one, then the wrong one")
    p.add_argument("--n", nargs="+", type=int, default=[4, 8, 15, 22, 26], help="first / last n layers")
    p.add_argument("--out", default="benchmarks/results/kv-oracle")
    p.add_argument("--tag", default="oracle", help="output files <tag>.json / <tag>.md")
    a = p.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orthros.demo import real
    from orthros.loading import load_model
    from orthros.models.adapter import apply_adapter

    torch.set_grad_enabled(False)
    hf, _ = real.source_and_conversion(a.model_dir, 128, a.sink_tokens)
    conv = real.conversion_for(a.model_dir, a.adapter, a.sink_tokens)
    tok = AutoTokenizer.from_pretrained(str(hf))
    question = a.question or real.QUESTION
    ids = real.prompt_ids(tok, real.document(), question) + tok.encode(a.prefix, add_special_tokens=False)
    conts = {c: tok.encode(c, add_special_tokens=False) for c in a.candidates}
    src = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    L = len(src.model.layers)

    def logp(model, c):
        return real.answer_logprob(model, ids, conts[c])

    right, wrong = a.candidates
    rows = {"source": logp(src, right) - logp(src, wrong)}
    print("source", rows["source"], flush=True)
    inputs = {c: source_attention_inputs(src, ids + conts[c]) for c in a.candidates}
    del src
    model = load_model(conv).eval()
    if a.adapter != "none":
        apply_adapter(model, a.adapter)
    sets = {"none": set(), f"all {L}": set(range(L))}
    for n in sorted(set(a.n)):
        if 0 < n < L:
            sets[f"first {n}"] = set(range(n))
            sets[f"last {n}"] = set(range(L - n, L))
    for name, layers in sets.items():
        m = {}
        for c in a.candidates:
            with oracle(model, inputs[c], layers):
                m[c] = logp(model, c)
        rows[f"conversion, source K/V in {name}"] = m[right] - m[wrong]
        print(name, rows[f"conversion, source K/V in {name}"], flush=True)
    lines = [f"The demo's question \"{question}\" ({len(ids):,} tokens with \"{a.prefix}\"); the conversion "
             f"({conv.name}, adapter: {a.adapter}) with the source's K/V in some layers. "
             f"Margin: log p({right}) − log p({wrong}), nats.", "", "| model | margin |", "|---|---:|"]
    lines += [f"| {k} | {v:+.2f} |" for k, v in rows.items()]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.tag}.json").write_text(json.dumps({"question": question, "adapter": a.adapter, "layers": L,
                                                   "candidates": a.candidates, "margins": rows}, indent=1))
    (out / f"{a.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
