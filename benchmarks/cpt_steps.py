"""Step time and peak memory of each CPT arm, all arms side by side as in a real run.

    python benchmarks/cpt_steps.py --preset smollm2-h200 --jobs 8

Random weights of the SmolLM2-135M shape (step time does not depend on the
values); every arm in its own process, all at once (`--jobs`), as
`orthros experiment cpt` runs them. Prints a table and writes
benchmarks/results/cpt_steps.json: the step count that fits a time budget
follows from the slowest arm.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from orthros.experiments.cpt import ARMS, PRESETS
from orthros.experiments.jobs import run_jobs

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=1e5, tie_word_embeddings=True,
               max_position_embeddings=8192)


def time_arm(arm: str, preset, device: str, steps: int) -> dict:
    from orthros.experiments.cpt import train_arm
    from orthros.models import OrthrosConfig, OrthrosForCausalLM

    _, changes, mode = ARMS[arm]
    torch.manual_seed(0)
    model = OrthrosForCausalLM(OrthrosConfig(**SMOLLM2, window_size=preset.window, **changes)).to(device)
    if mode is None:
        return {"arm": arm, "trains": False}
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, SMOLLM2["vocab_size"], (steps * preset.batch_size, preset.seq_len), generator=g).numpy()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    _, stats = train_arm(model, mode, dataclasses.replace(preset, steps=steps), rows, device, arm)
    (s0, t0), (s1, t1) = stats["synced"][1], stats["synced"][-1]  # from the second sync: compiled, warm
    dt = (t1 - t0) / (s1 - s0)
    mem = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    return {"arm": arm, "trains": True, "s_per_step": dt, "tok_per_s": preset.batch_size * preset.seq_len / dt,
            "peak_gib": mem, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="smollm2-h200", choices=list(PRESETS))
    ap.add_argument("--arms", nargs="+", default=[a for a, v in ARMS.items() if v[2] is not None])
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=31, help="steps per arm (timed from step 11: sync points every 10)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="benchmarks/results/cpt_steps.json")
    args = ap.parse_args()
    preset = PRESETS[args.preset]
    res = run_jobs(time_arm, [(a, preset, args.device, args.steps) for a in args.arms], args.jobs)
    print(f"{'arm':<16} {'s/step':>8} {'tok/s':>10} {'peak GiB':>9}   ({args.jobs} processes side by side, "
          f"{preset.batch_size}x{preset.seq_len} tokens a step)")
    for r in res:
        if r["trains"]:
            mem = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
            print(f"{r['arm']:<16} {r['s_per_step']:>8.3f} {r['tok_per_s']:>10,.0f} {mem:>9}")
    slowest = max(r["s_per_step"] for r in res if r["trains"])
    print(f"slowest arm: {slowest:.3f} s/step -> {int(360 / slowest)} steps in 6 minutes")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"preset": args.preset, "jobs": args.jobs, "device": args.device,
                                          "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                                          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                          "results": res}, indent=2))


if __name__ == "__main__":
    main()
