"""Evaluate a model directory with lm-evaluation-harness (needs `pip install orthros[eval]`).

    orthros eval-harness runs/llama-orthros --tasks arc_easy,hellaswag --batch-size 8
    orthros eval-harness runs/demo --tasks my_task --include-path my_tasks/ --limit 50

Tasks are lm-eval's own (their data sets come from the Hugging Face hub) or
local YAML tasks under --include-path; see docs/evaluation.md for the
paper's suites. Prints lm-eval's results table; --output writes the JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory (config.json + safetensors + tokenizer files)")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task or group names")
    p.add_argument("--include-path", default=None, help="directory of extra (local) task YAMLs")
    p.add_argument("--batch-size", default="1", help="an integer or 'auto'")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--limit", type=float, default=None, help="documents per task (a fraction if < 1)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), bfloat16, float32, ...")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write lm-eval's results as JSON to this file")


def run(args) -> int:
    try:
        from lm_eval.utils import make_table

        from .lm_eval_adapter import evaluate
    except ImportError as e:
        raise ValueError(f"lm-evaluation-harness is not installed ({e}); pip install 'orthros[eval]'") from None
    model = Path(args.model)
    if not (model / "config.json").exists():
        raise FileNotFoundError(f"{model} is not a model directory (no config.json)")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--tasks names no task")
    batch = args.batch_size if args.batch_size == "auto" or args.batch_size.startswith("auto:") else int(args.batch_size)
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    results = evaluate(str(model), tasks, batch_size=batch, device=args.device, limit=limit,
                       num_fewshot=args.num_fewshot, include_path=args.include_path, dtype=args.dtype, seed=args.seed)
    print(make_table(results))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({k: results[k] for k in ("results", "config", "versions")
                                                 if k in results}, indent=2, default=str) + "\n")
    return 0
