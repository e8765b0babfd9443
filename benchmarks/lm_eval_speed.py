"""lm-eval on a long-context task, with the continuations as the only output positions (the adapter's
way) against every position an output position (lm-eval's stock call): time, and the same answers.

    python benchmarks/lm_eval_speed.py --tasks python_docs_recall --limit 4

The model is `orthros demo`'s conversion of SmolLM2-135M-Instruct (window 128, 4 sinks; `orthros
download` once), or --model-dir. Each way runs the tasks once after one untimed request (kernels
built, weights read). Writes speed.json under --out and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=None, help="an Orthros checkpoint (default: the demo's conversion)")
    p.add_argument("--tasks", nargs="+", default=["python_docs_recall"])
    p.add_argument("--include-path", default="configs/lm_eval")
    p.add_argument("--limit", type=int, default=4, help="documents per task (each has 4 choices)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--device", default=None)
    p.add_argument("--out", default="benchmarks/results/lm-eval-speed")
    a = p.parse_args(argv)

    import lm_eval

    from orthros.eval.lm_eval_adapter import OrthrosLM, _task_manager

    model_dir = a.model_dir
    if model_dir is None:
        from orthros.demo import real

        model_dir = str(real.source_and_conversion("runs/smollm2", 128, 4)[1])
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tm = _task_manager(a.tasks, a.include_path)
    lm = OrthrosLM(pretrained=model_dir, device=device, batch_size=a.batch_size, dtype="float32")
    stock = lm._continuation_mask
    rows = {}
    for way in ("continuations", "every position"):
        lm._continuation_mask = stock if way == "continuations" else (lambda inps: None)
        lm_eval.simple_evaluate(model=lm, tasks=a.tasks, limit=1, task_manager=tm)  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        res = lm_eval.simple_evaluate(model=lm, tasks=a.tasks, limit=a.limit, task_manager=tm, log_samples=True)
        if device == "cuda":
            torch.cuda.synchronize()
        sec = time.perf_counter() - t
        lls = [r[0] for task in a.tasks for s in res["samples"][task] for r in s["filtered_resps"]]
        rows[way] = {"seconds": sec, "loglikelihoods": lls,
                     "acc": {task: res["results"][task].get("acc,none") for task in a.tasks}}
        print(f"{way}: {sec:.1f} s", flush=True)
    fast, slow = rows["continuations"], rows["every position"]
    diff = max(abs(x - y) for x, y in zip(fast["loglikelihoods"], slow["loglikelihoods"]))
    env = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
           "threads": torch.get_num_threads()}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speed.json").write_text(json.dumps({"model": model_dir, "tasks": a.tasks, "limit": a.limit,
                                                "batch_size": a.batch_size, "env": env, "rows": rows,
                                                "max_abs_loglikelihood_diff": diff}, indent=1))
    print(f"| way | seconds | acc |\n|---|---:|---|\n"
          f"| continuations only | {fast['seconds']:.1f} | {fast['acc']} |\n"
          f"| every position | {slow['seconds']:.1f} | {slow['acc']} |\n"
          f"every position / continuations: {slow['seconds'] / fast['seconds']:.2f}x; "
          f"largest log-likelihood difference {diff:.2e} ({env['device']})")


if __name__ == "__main__":
    main()
