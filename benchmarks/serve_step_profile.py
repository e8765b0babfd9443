"""The serving engine's steps in one process, Orthros against `attention="full"`: the
decode-only step (captured graph) timed and broken down by kernel, and the mixed step (the
running decodes beside a long prompt's chunk) run as one eager forward and split into the
decodes' graph + the chunk's forward, alternating step by step over the same prompt.

    python benchmarks/serve_step_profile.py [--layers 32] [--budgets 1024 2048] \
        [--out benchmarks/results/serve/step-profile.json]

Llama-3.1-8B shape, random bf16 weights, window 128, `--streams` requests of `--context`
tokens decoding; the long prompt is `--long` tokens. ms = wall time of `Engine.step()`
(scheduling, the forward, sampling), the device synchronized after each.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from orthros.bench.common import kernel_groups, kernel_profile, sync
from orthros.bench.serve_client import percentile
from orthros.serve.engine import Engine, EngineConfig, SamplingParams
from orthros.serve.launch import load_model


def _timed_step(eng) -> float:
    sync(eng.device)
    t0 = time.perf_counter()
    eng.step()
    sync(eng.device)
    return (time.perf_counter() - t0) * 1e3


def _q(xs, f):
    """The f-quantile of xs in ms (`bench serve`'s percentile), None for no samples."""
    return round(percentile(sorted(xs), 100 * f), 2) if xs else None


def host_profile(eng, top: int = 25) -> dict:
    """One engine step under the profiler: its wall time, the device time of its kernels, and
    the host (self CPU) time of its `top` operators: where a host-bound step goes."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if eng.device.type == "cuda" else [])
    sync(eng.device)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        eng.step()
        sync(eng.device)
        wall = (time.perf_counter() - t0) * 1e3
    ev = prof.key_averages()
    cuda = torch.autograd.DeviceType.CUDA
    device = sum(getattr(e, "self_device_time_total", 0) for e in ev if e.device_type == cuda) / 1e3
    host = sorted(((e.key[:80], e.self_cpu_time_total / 1e3, e.count) for e in ev if e.device_type != cuda),
                  key=lambda x: -x[1])[:top]
    kern = kernel_groups(ev, top=12)
    return dict(wall_ms=round(wall, 2), device_ms=round(device, 2),
                host_self_ms_total=round(sum(e.self_cpu_time_total for e in ev if e.device_type != cuda) / 1e3, 2),
                top_host_ops=[dict(op=k, self_ms=round(t, 3), calls=c) for k, t, c in host],
                device_groups_ms={k: round(v, 3) for k, v in kern["groups_ms"].items()},
                top_kernels_ms={k: round(v, 3) for k, v in kern["top_kernels_ms"].items()})


def measure(attention: str, args) -> dict:
    model, _, _ = load_model(None, "llama-3.1-8b", args.device, "bf16", attention, 128, args.layers,
                             args.long + 4096, seed=0)
    eng = Engine(model, EngineConfig(block_size=16, kv_cache_gib=args.kv_gib, max_num_seqs=args.streams + 1,
                                     max_num_batched_tokens=max(args.budgets), max_model_len=args.long + 4096))
    rng = random.Random(0)
    vocab = model.config.vocab_size
    for _ in range(args.streams):
        eng.submit([rng.randrange(vocab) for _ in range(args.context)], SamplingParams(max_tokens=2048, ignore_eos=True),
                   lambda ev: None)
    while not all(len(r.tokens) - r.computed == 1 for r in eng.running) or len(eng.running) < args.streams:
        eng.step()
    for _ in range(5):  # the bucket captured
        eng.step()
    decode = [_timed_step(eng) for _ in range(args.steps)]
    res = dict(attention=attention, decode_ms_p50=_q(decode, 0.5), decode_ms_p90=_q(decode, 0.9), mixed={})
    g = eng.graphs
    if g is not None and g.graphs:  # what the graph runs, by kernel: its forward run eagerly (same kernels)
        b = min(g.graphs)
        step = lambda: [g._forward(g._cache(b)) for _ in range(10)]  # noqa: E731 - rewrites the same K/V
    else:
        step = lambda: [eng.step() for _ in range(10)]  # noqa: E731
    prof = kernel_profile(step, eng.device, top=30)
    res.update(kernels_per_step=prof["kernel_count"] / 10,
               groups_ms_per_step={k: round(v / 10, 4) for k, v in prof["groups_ms"].items()},
               top_kernels_ms_per_step={k: round(v / 10, 4) for k, v in prof["top_kernels_ms"].items()})
    for budget in args.budgets:
        eng.cfg.max_num_batched_tokens = budget
        eng.warm_up()  # this budget's chunk lengths compiled
        eng.runner.capture_graphs()  # every decode bucket, as Engine.start does (the last token's step paid
        # bucket 2's capture: 156 ms on an H100)
        long = eng.submit([rng.randrange(vocab) for _ in range(args.long)], SamplingParams(max_tokens=1),
                          lambda ev: None)
        times = {True: [], False: []}
        split, host, steps = False, None, []
        while not long.finished:
            eng.cfg.split_mixed_steps = split
            before = long.computed
            rest, full = args.long - long.computed, max((s["tokens"] for s in steps), default=0)
            if split and host is None and len(times[True]) == 1:
                host = res.setdefault("mixed_host", {})[budget] = host_profile(eng)  # one split step, by op
            elif 1 < rest < full and budget not in res.setdefault("tail_host", {}):
                # the prompt's last, shorter chunk: by op and by kernel, against a whole chunk's step above
                res["tail_host"][budget] = dict(tokens=rest, split=split, **host_profile(eng))
            else:
                times[split].append(_timed_step(eng))
                # each step's prompt tokens: the prompt's last chunk (a shorter rest) shows apart
                steps.append(dict(tokens=long.computed - before, ms=round(times[split][-1], 2), split=split))
            split = not split
        res.setdefault("mixed_steps", {})[budget] = steps
        eng.cfg.split_mixed_steps = True
        res["mixed"][budget] = {("split" if k else "one forward"): dict(steps=len(v) - 1, p50=_q(v[1:], 0.5),
                                                                      p90=_q(v[1:], 0.9), max=_q(v[1:], 1.0))
                                for k, v in times.items()}
        for _ in range(3):
            eng.step()
    del eng, model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return res


def table(results) -> str:
    out = ["| attention | decode step p50 | p90 | kernels / step | mixed: budget | one forward p50 | p90 | split p50 | p90 |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        for b, m in r["mixed"].items():
            one, sp = m["one forward"], m["split"]
            out.append(f"| {r['attention']} | {r['decode_ms_p50']} ms | {r['decode_ms_p90']} ms | "
                       f"{r['kernels_per_step']:.0f} | {b} | {one['p50']} ms | {one['p90']} ms | {sp['p50']} ms | "
                       f"{sp['p90']} ms |")
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=None, help="default: the model's 32")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--long", type=int, default=32768)
    p.add_argument("--budgets", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--kv-gib", type=float, default=12.0)
    p.add_argument("--variants", nargs="+", default=["orthros", "full"])
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (no graphs, so no split steps)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("serve_step_profile.py: no CUDA device (--device cpu for a smoke run)")
    results = []
    for v in args.variants:
        results.append(measure(v, args))
        print(json.dumps(results[-1], indent=1), flush=True)
    print(table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(command="python " + " ".join(sys.argv), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", torch=torch.__version__, results=results), f, indent=1)


if __name__ == "__main__":
    main()
