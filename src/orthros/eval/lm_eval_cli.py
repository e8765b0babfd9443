"""Evaluate a model directory with lm-evaluation-harness (needs `pip install orthros[eval]`).

    orthros eval-harness runs/llama-orthros --tasks arc_easy,hellaswag --batch-size 8
    orthros eval-harness runs/demo --tasks my_task --include-path my_tasks/ --limit 50

Tasks are lm-eval's own (their data sets come from the Hugging Face hub) or
local YAML tasks under --include-path; see docs/training.md for the
paper's suites. Prints lm-eval's results table; --output writes the JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import count_arg


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory (config.json + safetensors + tokenizer files)")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task or group names")
    p.add_argument("--include-path", default=None, help="directory of extra (local) task YAMLs")
    p.add_argument("--batch-size", default="1", help="an integer or 'auto'")
    p.add_argument("--num-fewshot", type=count_arg(0), default=None)
    p.add_argument("--limit", type=float, default=None, help="documents per task (a fraction if < 1)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), bfloat16, float32, ...")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write lm-eval's results as JSON to this file")


def run(args) -> int:
    from ..data.tokenizer import TOKENIZER_FILES, load_tokenizer
    from ..errors import UserError
    from ..loading import check_model_dir

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise UserError("--tasks names no task")
    batch = args.batch_size
    if not (batch == "auto" or batch.startswith("auto:")):
        if not batch.isdigit() or int(batch) < 1:
            raise UserError(f"--batch-size must be an integer >= 1 or 'auto', got {batch!r}")
        batch = int(batch)
    if args.limit is not None and not args.limit > 0:
        raise UserError(f"--limit must be > 0 (documents per task, a fraction if < 1), got {args.limit}")
    if args.include_path is not None and not Path(args.include_path).is_dir():
        raise UserError(f"{args.include_path}: --include-path is not a directory")
    if args.output is not None and Path(args.output).is_dir():
        raise UserError(f"{args.output}: --output names a directory; give a file name")
    model = Path(args.model)
    config = check_model_dir(model)  # before lm-eval loads it: damaged or pickle-only weights are one clear error
    if not any((model / f).exists() for f in TOKENIZER_FILES):
        raise UserError(f"{model}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); lm-eval needs the model's "
                        f"Hugging Face tokenizer")
    load_tokenizer(model, config.vocab_size)  # a damaged tokenizer file is named here, not deep inside lm-eval
    try:
        from lm_eval.utils import make_table

        from .lm_eval_adapter import evaluate
    except ImportError as e:
        raise UserError(f"lm-evaluation-harness is not installed ({e}); pip install 'orthros[eval]'") from None
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    results = evaluate(str(model), tasks, batch_size=batch, device=args.device, limit=limit,
                       num_fewshot=args.num_fewshot, include_path=args.include_path, dtype=args.dtype, seed=args.seed)
    print(make_table(results))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({k: results[k] for k in ("results", "config", "versions")
                                                 if k in results}, indent=2, default=str) + "\n")
    return 0
