"""Run a named experiment: train the paper's architectures alike, evaluate, tabulate.

    orthros experiment recall --preset cpu            # full / swa / orthros / orthros w/o SO, <= 10 min CPU
    orthros experiment recall --preset gpu --device cuda --jobs 4

Writes results.json, table.md (the paper's layout) and recall.png to --out.
"""

from __future__ import annotations

import argparse

import torch

EXPERIMENTS = ("recall",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .presets import ARCHS, PRESETS

    p.add_argument("name", choices=EXPERIMENTS, help="which experiment")
    p.add_argument("--preset", default="cpu", help=f"sizes and steps: {', '.join(PRESETS)} (default cpu)")
    p.add_argument("--archs", nargs="+", default=list(ARCHS), help=f"subset of {', '.join(ARCHS)}")
    p.add_argument("--steps", type=int, default=None, help="override the preset's training steps")
    p.add_argument("--seconds", type=float, default=None,
                   help="time budget instead: Orthros trains this long, the others the same number of steps")
    p.add_argument("--jobs", type=int, default=1,
                   help="architectures trained side by side, one process each (GPU runs of small models)")
    p.add_argument("--seed", "--seeds", type=int, nargs="+", default=[0],
                   help="one or more seeds (several: mean and range over seeds in the table)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="output directory (default runs/experiment-NAME-PRESET)")


def run(args) -> int:
    from ..errors import check_output_dir
    from ..loading import resolve_device
    from .recall import run_experiment

    resolve_device(args.device)
    out = args.out or f"runs/experiment-{args.name}-{args.preset}"
    check_output_dir(out, "--out")
    seed = args.seed[0] if len(args.seed) == 1 else args.seed
    res = run_experiment(args.preset, args.archs, seed, args.device, out, args.steps, args.seconds, args.jobs)
    print()
    print(res["table"])
    print(f"\nsaved {out}/results.json, table.md, recall.png")
    return 0
