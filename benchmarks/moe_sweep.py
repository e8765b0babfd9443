"""The fused MoE decode step (`ops.moe`) alone, at the rows a decode step gives it: launch settings
against the expert bytes they read a second.

    python benchmarks/moe_sweep.py                                   # qwen3-30b-a3b's experts, one GPU
    python benchmarks/moe_sweep.py --batches 1 8 --rounds 1 --out benchmarks/results/moe/moe-sweep.json
    TRITON_INTERPRET=1 python benchmarks/moe_sweep.py --model tiny-moe --batches 1 --fields up_i \
        --out /tmp/sweep.json                                       # the logic on a CPU (times say nothing)

Rows, for each batch B: `full` (B rows, each its own top-k), `bound` (B decode pairs: 2B rows, a
pair's two rows on its base row's experts) and `independent` (2B rows, each its own top-k). The
routing is drawn at random (one expert set per scenario, seeded). Each setting's whole step (the
device-side sort and both kernels) is captured in one CUDA graph, as a decode step is, and timed
by its replays. GB/s = the distinct experts' gate / up / down bytes / time: what the step must
read. The search is coordinate descent from the default launch (`ops.moe.launch_for`): each
setting in turn over its values, the best kept, `--rounds` times; every setting tried is checked
against the default launch's output.

Prints a table (default / best, with the best setting) and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

SETTINGS = {  # the values tried for each MoELaunch field
    "up_i": (16, 32, 64, 128),
    "up_c": (32, 64, 128, 256),
    "down_c": (32, 64, 128, 256),
    "down_i": (32, 64, 128),
    "warps": (2, 4, 8),
    "stages": (2, 3, 4),
}


def routing(scenario: str, batch: int, experts: int, k: int, gen: torch.Generator):
    """(rows, experts [R, k] int64, weights [R, k] fp32) of a scenario."""
    rows = batch if scenario == "full" else 2 * batch
    logits = torch.randn(rows, experts, generator=gen)
    w, idx = logits.softmax(-1).topk(k, dim=-1)
    if scenario == "bound":  # the output row (odd) on its base row's (even) experts, its own weights
        idx[1::2] = idx[0::2]
        w[1::2] = logits[1::2].gather(-1, idx[1::2]).softmax(-1)
    return rows, idx, w / w.sum(-1, keepdim=True)


def graphed(fn):
    """fn captured in a CUDA graph (after a warm-up run): a replay function (on a CPU: fn, run once)."""
    if not torch.cuda.is_available():
        fn()
        return fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b", help="config name: the experts' shape")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--scenarios", nargs="+", choices=("full", "bound", "independent"),
                   default=["full", "bound", "independent"])
    p.add_argument("--rounds", type=int, default=2, help="coordinate-descent rounds over the settings")
    p.add_argument("--fields", nargs="+", choices=tuple(SETTINGS), default=list(SETTINGS),
                   help="the launch settings searched (the others stay the default's)")
    p.add_argument("--out", default="benchmarks/results/moe/moe-sweep.json")
    a = p.parse_args(argv)
    import os

    cuda = torch.cuda.is_available()
    if not cuda and not os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("moe_sweep.py times CUDA graphs: it needs a GPU (on a CPU, TRITON_INTERPRET=1 runs "
                         "its logic, with times that say nothing)")

    def bench(fn) -> float:
        if cuda:
            from triton.testing import do_bench

            return do_bench(fn, warmup=10, rep=50) * 1e-3
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    from orthros import OrthrosConfig
    from orthros.bench.common import environment
    from orthros.layers.moe import SparseMoE
    from orthros.ops.moe import MAX_ROWS, expert_tables, fused_moe_with, launch_for

    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32  # (the interpreter's bf16 dots are wrong)
    cfg = OrthrosConfig.from_name(a.model)
    if not cfg.num_experts:
        raise SystemExit(f"--model {a.model}: not a mixture-of-experts shape")
    E, k, C, I = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    if 2 * max(a.batches) > MAX_ROWS:
        raise SystemExit(f"--batches: at most {MAX_ROWS // 2} (a step takes {MAX_ROWS} rows)")
    torch.manual_seed(0)
    moe = SparseMoE(cfg).to(dev, dtype)
    tables = expert_tables(moe.experts, dev)
    one_expert = 3 * C * I * moe.gate.weight.element_size()  # bytes of an expert's gate, up and down
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    print(f"{a.model}: {E} experts, top {k}, C={C}, I={I}, {str(dtype)[6:]}; each setting's step in one CUDA graph")
    for B in a.batches:
        for sc in a.scenarios:
            R, idx, w = routing(sc, B, E, k, gen)
            x = torch.randn(R, C, device=dev, dtype=dtype)
            idx, w = idx.to(dev), w.to(dev)
            nbytes = idx.unique().numel() * one_expert
            ref = fused_moe_with(x, w, idx, tables, I, launch_for(R)).float()

            def time_of(launch):
                out = {}

                def step():
                    out["y"] = fused_moe_with(x, w, idx, tables, I, launch)

                try:
                    replay = graphed(step)
                except Exception as e:  # noqa: BLE001 - a setting that does not build is skipped, said
                    return None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
                replay()  # a captured graph's output is written by its replays, not by the capture
                err = ((out["y"].float() - ref).norm() / ref.norm()).item()
                if not err < 1e-2:
                    return None, f"output differs from the default launch's (rel. err {err:.1e})"
                return bench(replay), None

            default = launch_for(R)
            t0, why = time_of(default)
            if t0 is None:
                raise SystemExit(f"B={B} {sc}: the default launch {dict(default._asdict())} fails: {why}")
            best, tb, seen, skipped = default, t0, {default}, []
            for _ in range(a.rounds):
                for field in a.fields:
                    for v in SETTINGS[field]:
                        cand = best._replace(**{field: v})
                        if cand in seen:
                            continue
                        seen.add(cand)
                        t, why = time_of(cand)
                        if t is None:
                            skipped.append(f"{dict(cand._asdict())}: {why}")
                        elif t < tb:
                            best, tb = cand, t
            row = dict(batch=B, scenario=sc, rows=R, experts_read=idx.unique().numel(), bytes=nbytes,
                       default=dict(default._asdict()), default_s=t0, default_gb_s=nbytes / t0 / 1e9,
                       best=dict(best._asdict()), best_s=tb, best_gb_s=nbytes / tb / 1e9, tried=len(seen),
                       skipped=skipped)
            rows_out.append(row)
            print(f"B={B:>3} {sc:>11} R={R:>3} experts={row['experts_read']:>3}  default {t0 * 1e6:7.1f} us "
                  f"{row['default_gb_s']:6.0f} GB/s  best {tb * 1e6:7.1f} us {row['best_gb_s']:6.0f} GB/s  "
                  f"({tb / t0:.2f}x the time) {dict(best._asdict())}", flush=True)
    command = "python benchmarks/moe_sweep.py " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv))
    res = dict(env=environment(dev), command=command,
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), model=a.model,
               shape=dict(experts=E, k=k, hidden=C, intermediate=I),
               settings={f: SETTINGS[f] for f in a.fields}, rows=rows_out)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    lines = ["| batch | rows | experts read | default µs | GB/s | best µs | GB/s | best launch |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows_out:
        d = ", ".join(f"{f}={v}" for f, v in r["best"].items() if v is not None and r["default"].get(f) != v)
        lines.append(f"| {r['batch']} | {r['scenario']} ({r['rows']}) | {r['experts_read']} | "
                     f"{r['default_s'] * 1e6:.1f} | {r['default_gb_s']:.0f} | {r['best_s'] * 1e6:.1f} | "
                     f"{r['best_gb_s']:.0f} | {d or 'the default'} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"saved {out}, {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
