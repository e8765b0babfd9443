"""Training steps per second of `orthros experiment recall`, per architecture and
row-wise kernel mode (ORTHROS_FUSED), to pick the settings of the GPU preset.

    python benchmarks/recall_steps.py --preset gpu --device cuda --modes auto 0 triton
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from orthros.experiments.presets import ARCHS, PRESETS
from orthros.experiments.recall import TrainData, train_model


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpu", choices=sorted(PRESETS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--archs", nargs="+", default=["orthros", "full"], choices=sorted(ARCHS))
    p.add_argument("--modes", nargs="+", default=["auto", "0"], help="ORTHROS_FUSED values ('auto': unset)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=8)
    args = p.parse_args()
    preset = PRESETS[args.preset]
    data = TrainData(preset, seed=0)
    print(f"{'arch':>14} {'ORTHROS_FUSED':>14} {'steps/s':>8}")
    for arch in args.archs:
        for mode in args.modes:
            os.environ.pop("ORTHROS_FUSED", None)
            if mode != "auto":
                os.environ["ORTHROS_FUSED"] = mode
            train_model(arch, preset, data, device=args.device, steps=args.warmup)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t = time.time()
            train_model(arch, preset, data, device=args.device, steps=args.steps)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            print(f"{arch:>14} {mode:>14} {args.steps / (time.time() - t):8.2f}", flush=True)


if __name__ == "__main__":
    main()
