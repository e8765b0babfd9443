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

import numpy as np
import torch

from orthros.experiments.cpt_arms import ARMS, PRESETS
from orthros.experiments.jobs import run_jobs


def timing_mask(spec, preset, n_rows: int) -> np.ndarray | None:
    """Targets of a -mix arm's rows for timing: every k-th row opens with a sample of a quarter of
    the row whose last 16 targets are its answers (weighed as `answer_weight` says), then text,
    as `data.retrieval` lays them out; None (every token a target) for an arm without the mix."""
    if not (spec.mix and preset.retrieval_share > 0):
        return None
    T = preset.seq_len
    mask = np.ones((n_rows, T), bool)
    every = max(1, round(1 / preset.retrieval_share))
    L = T // 4
    mask[::every, : L - 17] = False  # the prompt (haystack and question)
    mask[::every, L - 1] = False  # the EOS after the answer
    return mask


def time_arm(arm: str, preset, device: str, steps: int, profile: int = 0) -> dict:
    """Seconds a step of `arm` (a distilled arm gets a random full-attention teacher of the
    same shape); with `profile` > 0, the CUDA kernels and host time of that many warm steps."""
    from orthros.experiments.cpt_train import train_arm
    from orthros.experiments.cpt_arms import arm_preset
    from orthros.models import OrthrosConfig, OrthrosForCausalLM

    spec = ARMS[arm]
    if spec.mode is None:
        return {"arm": arm, "trains": False}
    preset = arm_preset(arm, preset)
    torch.manual_seed(0)
    window = spec.window or preset.window
    model = OrthrosForCausalLM(OrthrosConfig.from_name("smollm2-135m", window_size=window, **spec.changes)).to(device)
    teacher = None
    if spec.teacher is not None:
        teacher = OrthrosForCausalLM(OrthrosConfig.from_name("smollm2-135m", window_size=window, attention="full"))
        teacher = teacher.to(device).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    total = steps + profile
    rows = torch.randint(0, model.config.vocab_size, (total * preset.batch_size, preset.seq_len), generator=g).numpy()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    prof, on_step = None, None
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile, schedule

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        prof = torch_profile(activities=acts, schedule=schedule(wait=steps - 1, warmup=1, active=profile))
        prof.start()
        on_step = lambda step: prof.step()  # noqa: E731
    _, stats = train_arm(model, spec.mode, dataclasses.replace(preset, steps=total), rows, device, arm,
                         mask=timing_mask(spec, preset, len(rows)), teacher=teacher, on_step=on_step)
    out = {"arm": arm, "trains": True, "steps": steps}
    (s0, t0), (s1, t1) = stats["synced"][1], [x for x in stats["synced"] if x[0] <= steps][-1]
    dt = (t1 - t0) / (s1 - s0)  # from the second sync (compiled, warm), before any profiled step
    out.update(s_per_step=dt, tok_per_s=preset.batch_size * preset.seq_len / dt,
               peak_gib=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None)
    if prof is not None:
        prof.stop()
        ka = prof.key_averages()
        cuda = torch.cuda.is_available()
        attr = "device_time_total" if cuda else "cpu_time_total"
        rows_ = sorted(ka, key=lambda e: getattr(e, attr, 0), reverse=True)
        kernels = [e for e in rows_ if not cuda or getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        # the kernels alone: a CPU op's self device time counts its kernels' time a second time
        dev_total = (sum(e.self_device_time_total for e in kernels) / 1e3 / profile) if cuda else None
        out["profile"] = {"steps": profile, "device_ms_per_step": dev_total,
                          "top": [{"name": e.key[:90], "ms_per_step": getattr(e, attr) / 1e3 / profile,
                                   "calls_per_step": e.count / profile} for e in kernels[:25]],
                          "table": ka.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
                                            row_limit=30, max_name_column_width=70)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="smollm2-h200", choices=list(PRESETS))
    ap.add_argument("--arms", nargs="+", default=[a for a, v in ARMS.items() if v.mode is not None])
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=31, help="steps per arm (timed from step 11: sync points every 10)")
    ap.add_argument("--batch-size", type=int, default=None, help="rows of seq_len a step (default: the preset's)")
    ap.add_argument("--no-checkpointing", action="store_true", help="keep activations (default: the preset's choice)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block (CPTPreset.compile)")
    ap.add_argument("--profile", type=int, default=0,
                    help="profile this many steps after the timed ones (kernels and host time, printed and in the JSON)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="benchmarks/results/cpt_steps.json")
    args = ap.parse_args()
    preset = PRESETS[args.preset]
    if args.batch_size is not None:
        preset = dataclasses.replace(preset, batch_size=args.batch_size)
    if args.no_checkpointing:
        preset = dataclasses.replace(preset, gradient_checkpointing=False)
    if args.compile:
        preset = dataclasses.replace(preset, compile=True)
    res = run_jobs(time_arm, [(a, preset, args.device, args.steps, args.profile) for a in args.arms], args.jobs)
    for r in res:
        if "profile" in r:
            p = r["profile"]
            dev = "" if p["device_ms_per_step"] is None else f"; device busy {p['device_ms_per_step']:.1f} ms a step"
            print(f"--- {r['arm']}: {p['steps']} profiled steps{dev}\n{p.pop('table')}")
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
                                          "batch_size": preset.batch_size,
                                          "gradient_checkpointing": preset.gradient_checkpointing,
                                          "compile": preset.compile,
                                          "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                                          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                          "results": res}, indent=2))


if __name__ == "__main__":
    main()
