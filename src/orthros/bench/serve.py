"""`orthros bench serve`: the server under load — TTFT, TPOT, ITL, end-to-end latency, throughput.

Scenarios (`--scenario`), each for Orthros and the same server with
`attention="full"`, one server per (attention, token budget), random weights:

    paper         2 concurrent requests of 128K in / 128 out, then of 127K / 1K
                  (the paper's SGLang setting)
    traffic       prompts 8K-128K (log-uniform), outputs 64-256 (uniform), Poisson
                  arrivals at several rates
    interference  the inter-token latency of running streams while a 128K prompt
                  is prefilled, against the per-step token budget
    documents     multi-turn chats about 4 shared documents of 32K-128K tokens (a
                  few hot: Zipf popularity), 3 questions a chat, each turn resending
                  the history and the server's answer: prefix-cache hits, request
                  throughput and TTFT at several chat arrival rates
    long          the longest requests a server of each KV dtype holds (fp8 1M, int4 1M
                  and 2M, int2 4M), then as many concurrent 128K requests as its pool
                  holds, per dtype (bf16, fp8, int4, int2): `bench/serve_long.py`
    faults        a burst of 64 long prompts at a server with 4 seats and a queue of 16 (503s for
                  the overflow, no accepted request lost), a client gone mid-prefill (its
                  blocks freed), a prompt over --max-model-len (a 400): `bench/serve_faults.py`
    custom        --input-len / --output-len / --rates / --concurrency

`--scale gpu` is the full setting (llama-3.1-8b shape, bf16); `--scale tiny`
runs the same scenarios with the `tiny` shape on CPU in seconds, prompts
divided by 512, outputs by 16, token budgets by 128 (a smoke run: its
numbers mean nothing). `--url` aims
the load at a running server instead (one attention, whatever it serves).

    orthros bench serve --scenario paper
    orthros bench serve --scenario traffic --rates 0.05 0.1 0.2
    orthros bench serve --scenario interference --budgets 2048 8192 16384
    orthros bench serve --scenario documents --rates 0.05 0.1 0.2
    orthros bench serve --scenario long --variants orthros --long-cases int4:2M --capacity-dtypes bf16 int4
    orthros bench serve --scenario faults
    orthros bench serve --scenario custom --url http://127.0.0.1:8000/v1 --model-name NAME \\
        --input-len 4096 --output-len 128 --rates inf --concurrency 8 --num-prompts 64

Results: `OUT_DIR/<tag>.json` (tag: serve-<scenario>), a Markdown table
(printed, saved beside the JSON and spliced into --docs between
`<!-- <tag>-table -->` marks) and a plot `PLOT_DIR/<tag>.png`. Runs too long
for one sitting can be split (`--variants orthros --tag serve-traffic-orthros`,
then `--variants full ...`) and joined: `--from-json A.json B.json --tag serve-traffic`.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import shlex
import sys

from ..models.static_cache import KV_DTYPES
from .serve_client import (fmt_ms, lengths, random_prompts, result_dict, run_interference, run_load,
                           run_sessions, summarize)
from .serve_faults import faults_rows
from .serve_long import CAPACITY_DTYPES, LONG_CASES, long_rows
from .serve_report import plot, table
from .serve_server import K, SCALES, Server, bench_device, keep_steps, scale_len

VARIANTS = ("orthros", "full")
# Lengths are written at the GPU scale; a scale divides prompts, outputs and budgets (min 1).
SCENARIOS = {
    "paper": dict(runs=[dict(name="128K/128", input=128 * K, output=128, num=2, concurrency=2),
                        dict(name="127K/1K", input=127 * K, output=K, num=2, concurrency=2)]),
    "traffic": dict(input=("loguniform", 8 * K, 128 * K), output=("uniform", 64, 256), num=16,
                    rates=[0.1, 0.2, 0.4, 0.8]),
    "interference": dict(background=4, background_input=K, long_input=128 * K, budgets=[1024, 2048, 4096, 8192, 16384]),
    "documents": dict(docs=4, doc=("uniform", 32 * K, 128 * K), sessions=16, turns=3, question=("uniform", 64, 256),
                      output=("uniform", 64, 128), zipf=1.0, rates=[0.02, 0.05, 0.1, 0.2]),
    "long": dict(cases=LONG_CASES, capacity=CAPACITY_DTYPES),  # bench/serve_long.py
    "faults": dict(),  # bench/serve_faults.py
}


def parse_rate(s: str) -> float:
    return math.inf if s.lower() in ("inf", "infinity") else float(s)


def add_arguments(p):
    """Counts are refused below 1 (--warmup: 0) by the parser: 0 would be taken as "the scenario's default",
    a negative one start a server that refuses it."""
    from ..errors import count_arg
    from .common import add_docs_argument
    from .prefill import parse_len

    p.add_argument("--scenario", choices=(*SCENARIOS, "custom"), default="paper")
    p.add_argument("--scale", choices=sorted(SCALES), default="gpu")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--url", default=None, help="an already running server's /v1 URL (else servers are started)")
    p.add_argument("--model-name", default=None, help="the model name the --url server serves")
    p.add_argument("--server", choices=("subprocess", "inprocess"), default="subprocess",
                   help="how started servers run (inprocess shares this process and its GIL)")
    p.add_argument("--window", type=count_arg(1), default=None,
                   help="Orthros window size (default: 128; tiny scale 16)")
    p.add_argument("--layers", type=count_arg(1), default=None, help="override the layer count (smoke runs)")
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES,
                   help="the started servers' KV storage (int4 / int2 / k4v2: Orthros only; long sets its own)")
    p.add_argument("--long-cases", nargs="*", default=None, metavar="KV:LEN",
                   help=f"long: one request per case (default {' '.join(LONG_CASES)}; none: skip)")
    p.add_argument("--capacity-dtypes", nargs="*", default=None, metavar="KV",
                   help=f"long: KV dtypes whose pools are filled with 128K requests (default "
                        f"{' '.join(CAPACITY_DTYPES)}; none: skip)")
    p.add_argument("--budget", type=count_arg(1), default=None,
                   help="max_num_batched_tokens, not interference (default: 8192; tiny scale 64)")
    p.add_argument("--budgets", nargs="+", type=count_arg(1), default=None, help="interference: token budgets")
    p.add_argument("--rates", nargs="+", type=parse_rate, default=None,
                   help="Poisson arrival rates (req/s, documents: chats/s; inf)")
    p.add_argument("--concurrency", type=count_arg(1), default=None, help="at most this many requests in flight")
    p.add_argument("--num-prompts", type=count_arg(1), default=None, help="requests a run (documents: chats)")
    p.add_argument("--input-len", type=parse_len, default=None, help="custom: prompt length (fixed)")
    p.add_argument("--input-range", type=parse_len, nargs=2, default=None, help="custom: log-uniform prompt lengths")
    p.add_argument("--output-len", type=count_arg(1), default=None, help="custom: output length (fixed)")
    p.add_argument("--output-range", type=count_arg(1), nargs=2, default=None, help="custom: uniform output lengths")
    p.add_argument("--warmup", type=count_arg(0), default=1, help="untimed warm-up rounds per server (compilation)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-log-dir", default=None,
                   help="each started server logs its engine steps to DIR/<tag>-<attention>-budget<N>.jsonl "
                        "(--step-log)")
    p.add_argument("--device", default=None, help="started servers' device (default: cuda if available)")
    p.add_argument("--server-args", default="", metavar="FLAGS",
                   help="more `orthros serve` flags for every started server, one string "
                        "(e.g. --server-args=\"--no-prefix-caching\"); a scenario's own settings win")
    p.add_argument("--out-dir", default="benchmarks/results/serve", help="where serve-<scenario>.json / .md go")
    p.add_argument("--plot-dir", default=None, help="where serve-<scenario>.png goes (default: --out-dir)")
    add_docs_argument(p, "docs/serving.md")
    p.add_argument("--tag", default=None, help="output files <tag>.json / .md / .png and the table's marks "
                   "(default: serve-<scenario>)")
    p.add_argument("--from-json", nargs="+", default=None,
                   help="only re-render the table and plot from saved JSON (several, e.g. one per variant: one table)")


# ------------------------------------------------------------------ measure
def _vocab(args) -> int:
    from ..models import OrthrosConfig

    return OrthrosConfig.from_name(SCALES[args.scale]["model"]).vocab_size


def _warmup(args, srv, rng, budget: int) -> None:
    """Untimed requests that compile what the timed ones will run: a prompt of 3 budgets beside
    a short request (its chunks are the budget less a decode, then the whole budget), and a
    decode (kernels, captured graphs)."""
    for _ in range(args.warmup):
        long = min(3 * budget + 100, SCALES[args.scale]["max_model_len"] - 8)
        prompts = random_prompts([8, long], _vocab(args), rng)
        asyncio.run(run_load(srv.url, srv.model, prompts, [2, 4], concurrency=2))


def _load_runs(args) -> list[dict]:
    """The load runs of a scenario: [{name, input spec, output spec, num, rate, concurrency}]."""
    sc = SCALES[args.scale]
    div_in, div_out = sc["div_in"], sc["div_out"]
    s = args.scenario
    if s == "paper":
        runs = [dict(r, rate=math.inf) for r in SCENARIOS["paper"]["runs"]]
    elif s == "documents":
        t = SCENARIOS["documents"]
        runs = [dict(name=f"{r:g} chats/s", input=t["doc"], output=t["output"], question=t["question"],
                     num=args.num_prompts or t["sessions"], rate=r, concurrency=None)
                for r in (args.rates or t["rates"])]
    elif s == "traffic":
        t = SCENARIOS["traffic"]
        runs = [dict(name=f"rate {r:g}/s", input=t["input"], output=t["output"], num=args.num_prompts or t["num"],
                     rate=r, concurrency=args.concurrency) for r in (args.rates or t["rates"])]
    else:  # custom
        inp = args.input_len or (("loguniform", *args.input_range) if args.input_range else 1024)
        out = args.output_len or (("uniform", *args.output_range) if args.output_range else 128)
        runs = [dict(name=f"rate {r:g}/s" + (f", concurrency {args.concurrency}" if args.concurrency else ""),
                     input=inp, output=out, num=args.num_prompts or 32, rate=r, concurrency=args.concurrency)
                for r in (args.rates or [math.inf])]
        div_in = div_out = 1  # custom lengths are taken as given
    for r in runs:
        r["input"], r["output"] = scale_len(r["input"], div_in), scale_len(r["output"], div_out)
        if "question" in r:
            r["question"] = scale_len(r["question"], div_in)
    return runs


def run_requests(args, i: int, run: dict) -> tuple[list[list[int]], list[int]]:
    """The prompts and output lengths of load run `i`, the same for every variant. The lengths
    are the same at every rate too (drawn from one seed for the scenario): runs at different
    rates are the same work arriving faster, so their throughputs and tails compare. The tokens
    differ from run to run, so that no run finds another's prompts in the server's prefix cache
    (a repeated prompt is a cache hit, not a prefill)."""
    lens_rng = random.Random(f"{args.seed}/lengths")
    ins = lengths(run["input"], run["num"], lens_rng)
    outs = lengths(run["output"], run["num"], lens_rng)
    return random_prompts(ins, _vocab(args), random.Random(f"{args.seed}/run {i}")), outs


def document_sessions(args, i: int, run: dict) -> tuple[list[list[int]], list[dict]]:
    """The documents and chats of run `i` of the documents scenario: the same lengths, popularity
    draws and question lengths at every rate (one seed), new tokens in every run (no run finds
    another's documents in the prefix cache). A chat picks document d with weight 1 / (d + 1)^zipf."""
    t = SCENARIOS["documents"]
    lens_rng, tok_rng = random.Random(f"{args.seed}/lengths"), random.Random(f"{args.seed}/run {i}")
    docs = random_prompts(lengths(run["input"], t["docs"], lens_rng), _vocab(args), tok_rng)
    weights = [1 / (d + 1) ** t["zipf"] for d in range(t["docs"])]
    sessions = []
    for _ in range(run["num"]):
        doc = lens_rng.choices(range(t["docs"]), weights)[0]
        qs = lengths(run["question"], t["turns"], lens_rng)
        outs = lengths(run["output"], t["turns"], lens_rng)
        sessions.append({"doc": doc, "turns": [(q, n) for q, n in zip(random_prompts(qs, _vocab(args), tok_rng),
                                                                          outs)]})
    return docs, sessions


def measure(args, on_row=None) -> dict:
    """The scenario's results; `on_row(results so far)` after each row. A run cut short (an error, ^C)
    after a row hands what it measured to `on_row` with the error under "error", then raises it."""
    from .common import environment

    args.window = args.window or SCALES[args.scale]["window"]
    args.budget = args.budget or max(1, 8192 // SCALES[args.scale]["div_budget"])
    import torch

    env = environment(torch.device(bench_device(args)))
    if args.url is None and args.step_log_dir is None:  # the engine's step times, beside the client's view
        import tempfile

        args.step_log_dir = tempfile.mkdtemp(prefix="orthros-bench-steps-")
    rows, commands, steps = [], {}, {}

    def results() -> dict:
        return dict(scenario=args.scenario, scale=args.scale, model=SCALES[args.scale]["model"], window=args.window,
                    kv_dtype=args.kv_dtype, env=env, servers=commands, **({"steps": steps} if steps else {}),
                    command="orthros bench serve " + shlex.join(sys.argv[3:] if sys.argv[1:3] == ["bench", "serve"]
                                                                else sys.argv[1:]),
                    rows=rows)

    def add(row: dict) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(results())

    try:
        _measure_rows(args, commands, steps, add)
    except BaseException as e:
        if on_row is not None and rows:
            on_row(dict(results(), error=f"{type(e).__name__}: {e}"))
        raise
    return results()


def _measure_rows(args, commands: dict, steps: dict, add) -> None:
    # the scenarios that start servers of their own, each yielding its rows for one variant
    own_servers = dict(interference=lambda v: _interference(args, v, commands, steps),
                       long=lambda v: long_rows(args, v, commands, steps, Server, _warmup, _vocab(args)),
                       faults=lambda v: faults_rows(args, v, commands, steps, Server, _warmup, _vocab(args)))
    variants = args.variants if not args.url else ["(server at --url)"]
    for variant in variants:
        if args.scenario in own_servers:
            for row in own_servers[args.scenario](variant):
                add(row)
            continue
        with Server(args, variant, args.budget) as srv:
            commands[variant] = srv.command
            rng = random.Random(args.seed)
            _warmup(args, srv, rng, args.budget)
            for i, run in enumerate(_load_runs(args)):
                if args.scenario == "documents":
                    docs, sessions = document_sessions(args, i, run)
                    results, duration = asyncio.run(run_sessions(srv.url, srv.model, docs, sessions, run["rate"],
                                                                 args.seed))
                else:
                    prompts, outs = run_requests(args, i, run)
                    results, duration = asyncio.run(run_load(srv.url, srv.model, prompts, outs, run["rate"],
                                                             run["concurrency"], args.seed))
                row = dict(variant=variant, run=run["name"], rate=None if math.isinf(run["rate"]) else run["rate"],
                           concurrency=run["concurrency"], input=run["input"], output=run["output"],
                           budget=args.budget, **summarize(results, duration),
                           requests=[result_dict(r) for r in results])
                add(row)
                print(f"{variant:8s} {run['name']:>12s}: {row['completed']} ok, TTFT p50 {fmt_ms(row['ttft']['p50'])}, "
                      f"ITL p50 {fmt_ms(row['itl']['p50'])}, {row['output_throughput']:.1f} tok/s", flush=True)
        keep_steps(steps, variant, srv)


def _interference(args, variant, commands, steps):
    """The scenario's rows for one attention variant, one a token budget, each yielded once measured."""
    t = SCENARIOS["interference"]
    sc = SCALES[args.scale]
    div = sc["div_in"]
    for budget in args.budgets or [max(1, b // sc["div_budget"]) for b in t["budgets"]]:
        with Server(args, variant, budget) as srv:
            commands[f"{variant} budget {budget}"] = srv.command
            rng = random.Random(args.seed)
            _warmup(args, srv, rng, budget)
            n_bg, bg_in = t["background"], scale_len(t["background_input"], div)
            long_in = scale_len(t["long_input"], div)
            bg = random_prompts([bg_in] * n_bg, _vocab(args), rng)
            long = random_prompts([long_in], _vocab(args), rng)[0]
            bg_out = sc["max_model_len"] - bg_in - 1
            res = asyncio.run(run_interference(srv.url, srv.model, bg, bg_out, long, 1,
                                               settle=0.2 if args.scale == "tiny" else 2.0))
            row = dict(variant=variant, run=f"budget {budget}", budget=budget, background=n_bg,
                       background_input=bg_in, long_input=long_in, **res)
            print(f"{variant:8s} budget {budget:>6d}: long TTFT {fmt_ms(row['long_ttft_ms'])}, running ITL during "
                  f"prefill p50 {fmt_ms(row['itl_during_prefill']['p50'])} "
                  f"p99 {fmt_ms(row['itl_during_prefill']['p99'])}"
                  f" (before: p50 {fmt_ms(row['itl_before']['p50'])})", flush=True)
        keep_steps(steps, f"{variant} budget {budget}", srv)
        yield row


def run(args):
    from .common import splice_marks

    name = args.tag or f"serve-{args.scenario}"
    if args.scenario in ("interference", "long", "faults") and args.url:
        raise ValueError(f"{args.scenario} starts servers of its own (per token budget or KV dtype): it cannot "
                         "use --url")
    if args.from_json:
        from .common import merge_runs

        runs = []
        for path in args.from_json:
            if not os.path.exists(path):
                raise FileNotFoundError(f"--from-json: no such file {path}")
            with open(path) as f:
                runs.append(json.load(f))
        res = merge_runs(runs)
        # a file written before its run ended says so (files of older runs carry no flag)
        res["complete"] = all(r.get("complete", True) for r in runs)
        res["servers"] = {k: v for r in runs for k, v in r.get("servers", {}).items()}
        if any("steps" in r for r in runs):
            res["steps"] = {k: v for r in runs for k, v in r.get("steps", {}).items()}
        if len(runs) > 1:
            os.makedirs(args.out_dir, exist_ok=True)
            with open(os.path.join(args.out_dir, f"{name}.json"), "w") as f:
                json.dump(res, f, indent=1)
    else:
        path, kept = os.path.join(args.out_dir, f"{name}.json"), []

        def save(res: dict, complete: bool = False) -> None:  # after every row: a run cut short keeps its rows
            os.makedirs(args.out_dir, exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump(dict(res, complete=complete), f, indent=1)
            os.replace(path + ".tmp", path)
            kept[:] = [len(res["rows"])]

        try:
            res = measure(args, save)
        except BaseException:
            if kept:
                print(f"bench serve: the {kept[0]} row(s) measured before it stopped are in {path} "
                      f"(`--from-json {path}` makes their table and plot)", file=sys.stderr, flush=True)
            raise
        save(res, complete=True)
    text = table(res)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"{name}.md"), "w") as f:
        f.write(text + "\n")
    plot_dir = args.plot_dir or args.out_dir
    os.makedirs(plot_dir, exist_ok=True)
    plot(res, os.path.join(plot_dir, f"{name}.png"))
    print(text)
    if splice_marks(args.docs, text, (f"<!-- {name}-table:begin -->", f"<!-- {name}-table:end -->")):
        print(f"table written into {args.docs}")
    failed = sum(r.get("failed", 0) + len(r.get("errors", []) if args.scenario == "interference" else [])
                 for r in res["rows"])
    return 1 if failed else 0
