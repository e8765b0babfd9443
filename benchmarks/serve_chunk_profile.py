"""A long prompt's chunks in the serving engine against the same tokens in the model's own
prefill, in one process on one device: where a served chunk's time goes beyond the forward.

    python benchmarks/serve_chunk_profile.py [--long 128K] [--budget 8192] [--variants orthros full] \
        [--out benchmarks/results/serve/chunk-profile.json]

Three paths per variant, over the same prompt of `--long` random tokens (Llama-3.1-8B shape,
random bf16 weights, window 128):

- `engine`: `Engine.step()` with a token budget of `--budget` and nothing else running (a
  prompt's chunks as `orthros serve` runs them: paged KV, its scheduler, its warm-up);
- `chunked`: `generate.prefill` over the model's own cache in chunks of `--budget`;
- `one forward`: `generate.prefill` of the whole prompt (what `orthros bench prefill` times).

Each path runs the whole prompt with the device synchronized at its ends only (the engine's
steps as a server runs them: a step that reads no token back does not wait for the device), and
`engine` and `chunked` also step by step, each step synchronized; a chunk in the middle of the
prompt (`--at`, a fraction) runs under the profiler (device time by kernel group). The table
gives each path's time per 8,192 tokens and its ratio to `one forward`:
the serving paper setting's time to first token is almost all chunks (docs/serving.md), so
the engine's excess here is what it pays over the prefill benchmark.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch

from orthros.bench.common import kernel_profile, sync
from orthros.bench.prefill import parse_len
from orthros.generate import prefill
from orthros.serve.engine import Engine, EngineConfig, SamplingParams
from orthros.serve.launch import load_model

PER = 8192  # tokens a reported time is normalised to


def _timed(fn, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3


def engine_path(model, ids: list[int], args) -> dict:
    """The prompt through the engine, step by step: each step's ms and tokens; one mid step profiled."""
    size = dict(kv_cache_gib=args.kv_gib) if args.kv_gib else dict(num_blocks=-(-(len(ids) + 64) // 16) + 1)
    eng = Engine(model, EngineConfig(block_size=16, max_num_seqs=4, prefix_caching=False,
                                     max_num_batched_tokens=args.budget, max_model_len=len(ids) + 64, **size))
    with torch.inference_mode():  # as `Engine.start` does: the chunk lengths compiled, the decode graphs
        eng.warm_up()  # captured (the prompt's last token runs as a decode; its step paid them: 619 ms, H100)
        eng.runner.capture_graphs()
    req = eng.submit(ids, SamplingParams(max_tokens=1, ignore_eos=True), lambda ev: None)
    steps, profiled, at = [], None, int(args.at * len(ids))
    while not req.finished:
        before = req.computed
        if profiled is None and before >= at and len(ids) - before > args.budget:
            profiled = dict(start=before, **kernel_profile(eng.step, eng.device, top=args.top))
            profiled["tokens"] = req.computed - before
            continue
        ms = _timed(eng.step, eng.device)
        steps.append(dict(tokens=req.computed - before, ms=round(ms, 3)))

    def whole():  # as a server runs it: no step waits for the device unless it reads a token back
        r = eng.submit(ids, SamplingParams(max_tokens=1, ignore_eos=True), lambda ev: None)
        while not r.finished:
            eng.step()

    wall = _timed(whole, eng.device)
    return dict(steps=steps, profile=profiled, whole_ms=round(wall, 3))


def chunked_path(model, ids: torch.Tensor, args) -> dict:
    """`generate.prefill`'s chunks over the model's own cache, each timed; one mid chunk profiled."""
    T, chunk = ids.shape[1], args.budget
    cache, steps, profiled, at = model.new_cache(), [], None, int(args.at * T)
    empty = torch.empty(0, dtype=torch.long, device=ids.device)
    with torch.inference_mode():
        for start in range(0, T, chunk):
            end = min(start + chunk, T)
            keep = 1 if end == T else empty

            def run(s=start, e=end, k=keep):
                model(ids[:, s:e], past_key_values=cache, use_cache=True, logits_to_keep=k)

            if profiled is None and start >= at and end < T:
                profiled = dict(start=start, tokens=end - start, **kernel_profile(run, ids.device, top=args.top))
            else:
                steps.append(dict(tokens=end - start, ms=round(_timed(run, ids.device), 3)))
    with torch.inference_mode():
        wall = _timed(lambda: prefill(model, ids, None, chunk_size=chunk), ids.device)
    return dict(steps=steps, profile=profiled, whole_ms=round(wall, 3))


def one_forward(model, ids: torch.Tensor, args) -> dict:
    with torch.inference_mode():
        prefill(model, ids, None, chunk_size=ids.shape[1])  # compiled / autotuned
        times = [_timed(lambda: prefill(model, ids, None, chunk_size=ids.shape[1]), ids.device)
                 for _ in range(args.repeats)]
    ms = round(statistics.median(times), 3)
    return dict(steps=[dict(tokens=ids.shape[1], ms=ms)], whole_ms=ms)


def per_tokens(steps: list[dict], least: int, skip_first: bool = True) -> float | None:
    """ms per PER tokens over the steps of at least `least` tokens (the first, a compile's, left out
    where there are others)."""
    full = [s for s in steps if s["tokens"] >= least]
    full = full[1:] if skip_first and len(full) > 2 else full
    if not full:
        return None
    return sum(s["ms"] for s in full) / sum(s["tokens"] for s in full) * PER


def measure(attention: str, args) -> dict:
    dev = torch.device(args.device)
    model, _, _ = load_model(None, args.preset, args.device, args.dtype, attention, args.window, args.layers,
                             args.long + 4096, seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, args.long), generator=g)
    res = dict(attention=attention, long=args.long, budget=args.budget)
    # the engine first, its pool given back before the model's own caches are made
    res["engine"] = engine_path(model, ids[0].tolist(), args)
    release(dev)
    res["one forward"] = one_forward(model, ids.to(dev), args)
    release(dev)
    res["chunked"] = chunked_path(model, ids.to(dev), args)
    for k in ("one forward", "chunked", "engine"):
        res[k]["ms_per_8k"] = per_tokens(res[k]["steps"], args.budget // 2, skip_first=k != "one forward")
        res[k]["whole_ms_per_8k"] = res[k]["whole_ms"] / args.long * PER
    del model
    release(dev)
    return res


def release(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def table(results: list[dict]) -> str:
    out = ["| attention | path | steps | whole prompt, ms / 8,192 tokens | against one forward | "
           "each step synchronized, ms / 8,192 tokens |", "|---|---|---:|---:|---:|---:|"]
    for r in results:
        base = r["one forward"]["whole_ms_per_8k"]
        for k in ("one forward", "chunked", "engine"):
            v, each = r[k]["whole_ms_per_8k"], r[k]["ms_per_8k"]
            out.append(f"| {r['attention']} | {k} | {len(r[k]['steps'])} | {v:.1f} | {v / base:.3f} | "
                       + (f"{each:.1f} |" if each is not None else "- |"))
    groups = ["", "| attention | kernel group | chunked (ms) | engine (ms) | engine - chunked |",
              "|---|---|---:|---:|---:|"]
    for r in results:
        a, b = (r[k]["profile"] or {} for k in ("chunked", "engine"))
        ga, gb = a.get("groups_ms", {}), b.get("groups_ms", {})
        for name in sorted(set(ga) | set(gb), key=lambda n: -max(ga.get(n, 0), gb.get(n, 0))):
            x, y = ga.get(name, 0.0), gb.get(name, 0.0)
            groups.append(f"| {r['attention']} | {name} | {x:.2f} | {y:.2f} | {y - x:+.2f} |")
    return "\n".join(out + groups)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--layers", type=int, default=None, help="default: the preset's")
    p.add_argument("--long", type=parse_len, default=parse_len("128K"), help="prompt tokens")
    p.add_argument("--budget", type=int, default=8192, help="the engine's token budget = the chunk length")
    p.add_argument("--at", type=float, default=0.5, help="where in the prompt the profiled chunk starts (fraction)")
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--kv-gib", type=float, default=None,
                   help="the engine's KV pool (default: the blocks the prompt needs, so that an 80 GB card holds it)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of the one forward (median)")
    p.add_argument("--top", type=int, default=12, help="kernels listed per profile")
    p.add_argument("--variants", nargs="+", default=["orthros", "full"], choices=("orthros", "full", "swa"))
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (with --preset tiny)")
    p.add_argument("--out", default=None, help="JSON of every step and both profiles")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("serve_chunk_profile.py: no CUDA device (--device cpu --preset tiny for a smoke run)")
    if args.long <= 2 * args.budget:
        sys.exit(f"serve_chunk_profile.py: --long ({args.long}) must be over two budgets ({2 * args.budget})")
    results = [measure(v, args) for v in args.variants]
    print(table(results))
    if args.out:
        env = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), torch=torch.__version__,
                   device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu")
        with open(args.out, "w") as f:
            json.dump(dict(command="python benchmarks/serve_chunk_profile.py " + " ".join(sys.argv[1:]), env=env,
                           results=results), f, indent=1)
    return results


if __name__ == "__main__":
    main()
