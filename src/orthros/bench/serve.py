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
import subprocess
import sys
import time

from ..models.static_cache import KV_DTYPES, LOWBIT_KV_DTYPES
from .serve_faults import faults_plot, faults_rows, faults_table
from .serve_long import CAPACITY_DTYPES, LONG_CASES, long_plot, long_rows, long_table
from .serve_client import (lengths, percentile, random_prompts, result_dict, run_interference, run_load,
                           run_sessions, summarize)

VARIANTS = ("orthros", "full")
K = 1024

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
SCALES = {
    "gpu": dict(model="llama-3.1-8b", dtype="bf16", div_in=1, div_out=1, div_budget=1, max_model_len=129 * K + 1024,
                block_size=16, window=128),
    "tiny": dict(model="tiny", dtype="fp32", div_in=512, div_out=16, div_budget=128, max_model_len=1024,
                 block_size=4, window=16),
}


def _scale_len(spec, div: int):
    if isinstance(spec, int):
        return spec if div == 1 else max(1, spec // div)
    kind, lo, hi = spec
    return (kind, _scale_len(lo, div), max(_scale_len(lo, div) + 1, _scale_len(hi, div)))


def parse_rate(s: str) -> float:
    return math.inf if s.lower() in ("inf", "infinity") else float(s)


def add_arguments(p):
    from .common import add_docs_argument
    from .prefill import parse_len

    p.add_argument("--scenario", choices=(*SCENARIOS, "custom"), default="paper")
    p.add_argument("--scale", choices=sorted(SCALES), default="gpu")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--url", default=None, help="an already running server's /v1 URL (else servers are started)")
    p.add_argument("--model-name", default=None, help="the model name the --url server serves")
    p.add_argument("--server", choices=("subprocess", "inprocess"), default="subprocess",
                   help="how started servers run (inprocess shares this process and its GIL)")
    p.add_argument("--window", type=int, default=None, help="Orthros window size (default: 128; tiny scale 16)")
    p.add_argument("--layers", type=int, default=None, help="override the layer count (smoke runs)")
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES,
                   help="the started servers' KV storage (int4 / int2 / k4v2: Orthros only; long sets its own)")
    p.add_argument("--long-cases", nargs="*", default=None, metavar="KV:LEN",
                   help=f"long: one request per case (default {' '.join(LONG_CASES)}; none: skip)")
    p.add_argument("--capacity-dtypes", nargs="*", default=None, metavar="KV",
                   help=f"long: KV dtypes whose pools are filled with 128K requests (default "
                        f"{' '.join(CAPACITY_DTYPES)}; none: skip)")
    p.add_argument("--budget", type=int, default=None,
                   help="max_num_batched_tokens, not interference (default: 8192; tiny scale 64)")
    p.add_argument("--budgets", nargs="+", type=int, default=None, help="interference: token budgets")
    p.add_argument("--rates", nargs="+", type=parse_rate, default=None,
                   help="Poisson arrival rates (req/s, documents: chats/s; inf)")
    p.add_argument("--concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--num-prompts", type=int, default=None, help="requests a run (documents: chats)")
    p.add_argument("--input-len", type=parse_len, default=None, help="custom: prompt length (fixed)")
    p.add_argument("--input-range", type=parse_len, nargs=2, default=None, help="custom: log-uniform prompt lengths")
    p.add_argument("--output-len", type=int, default=None, help="custom: output length (fixed)")
    p.add_argument("--output-range", type=int, nargs=2, default=None, help="custom: uniform output lengths")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up rounds per server (compilation)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-log-dir", default=None,
                   help="each started server logs its engine steps to DIR/<tag>-<attention>-budget<N>.jsonl "
                        "(--step-log)")
    p.add_argument("--device", default=None, help="started servers' device (default: cuda if available)")
    p.add_argument("--out-dir", default="benchmarks/results/serve", help="where serve-<scenario>.json / .md go")
    p.add_argument("--plot-dir", default="benchmarks/results/serve", help="where serve-<scenario>.png goes")
    add_docs_argument(p, "docs/serving.md")
    p.add_argument("--tag", default=None, help="output files <tag>.json / .md / .png and the table's marks "
                   "(default: serve-<scenario>)")
    p.add_argument("--from-json", nargs="+", default=None,
                   help="only re-render the table and plot from saved JSON (several, e.g. one per variant: one table)")


# ------------------------------------------------------------------ servers
class Server:
    """A server for one (attention, budget): started here, or the one at --url."""

    def __init__(self, args, attention: str, budget: int, kv_dtype: str | None = None,
                 max_model_len: int | str | None = None, name: str | None = None, extra: list[str] = ()):
        self.args, self.attention, self.budget, self.extra = args, attention, budget, list(extra)
        self.kv_dtype, self.max_model_len = kv_dtype or args.kv_dtype, max_model_len
        self.name = name or f"{attention}-budget{budget}"
        self.proc = self.thread_server = None
        self.command = None
        self.step_log = self.steps = None
        self.log_tail = None  # a started subprocess server's last output lines

    def __enter__(self):
        a, sc = self.args, SCALES[self.args.scale]
        if a.url:
            self.url, self.model = a.url.rstrip("/"), a.model_name or _served_name(a.url)
            return self
        device = _device(a)
        argv = ["--preset", sc["model"], "--attention", self.attention, "--window", str(a.window),
                "--dtype", sc["dtype"], "--device", device,
                "--max-model-len", str(self.max_model_len or sc["max_model_len"]),
                "--max-num-batched-tokens", str(self.budget), "--kv-dtype", self.kv_dtype,
                "--max-num-seqs", "64", "--max-queue", "4096"]
        if self.kv_dtype not in LOWBIT_KV_DTYPES:  # a low-bit server picks the block size its key groups need
            argv += ["--block-size", str(sc["block_size"])]
        if a.layers:
            argv += ["--layers", str(a.layers)]
        argv += self.extra  # a scenario's own server settings (later flags win)
        if a.step_log_dir:
            os.makedirs(a.step_log_dir, exist_ok=True)
            # the run's tag first: runs that share a directory (and a budget) keep their own logs
            self.step_log = os.path.join(a.step_log_dir, f"{a.tag or 'serve-' + a.scenario}-{self.name}.jsonl")
            if os.path.exists(self.step_log):
                os.remove(self.step_log)  # this server's steps only
            argv += ["--step-log", self.step_log]
        if device == "cpu" or a.scale == "tiny":  # a tiny model needs little, and a shared GPU keeps the rest
            argv += ["--kv-cache-gib", "0.25"]
        self.model = sc["model"]
        if a.server == "inprocess":
            self._start_inprocess(argv)
        else:
            self._start_subprocess(argv)
        return self

    def _start_inprocess(self, argv):
        import argparse

        from ..serve import cli
        from ..serve.launch import build_app, load_model, serve_in_thread

        p = argparse.ArgumentParser()
        cli.add_arguments(p)
        ns = p.parse_args(argv)
        model, tok, name = load_model(None, ns.preset, ns.device, ns.dtype, ns.attention, ns.window, ns.layers,
                                      ns.max_model_len, seed=self.args.seed)
        app, engine = build_app(model, tok, name, cli.engine_config(ns))
        self.thread_server = serve_in_thread(app, engine)
        self.url = self.thread_server.url
        self.command = "in-process: orthros serve " + shlex.join(argv)

    def _start_subprocess(self, argv):
        from ..serve.launch import bind

        sock = bind()
        port = sock.getsockname()[1]
        sock.close()
        cmd = [sys.executable, "-m", "orthros", "serve", *argv, "--port", str(port)]
        self.command = shlex.join(cmd[2:])
        import tempfile

        # a file, not a pipe: nobody reads the log while the load runs, and a full pipe blocks the server
        self.log = tempfile.NamedTemporaryFile("w+", prefix="orthros-serve-", suffix=".log")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        self.url = f"http://127.0.0.1:{port}/v1"
        import httpx

        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.log.read()[-3000:]}")
            try:
                if httpx.get(self.url[:-3] + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > 900:
                self.proc.kill()
                raise RuntimeError("the server did not come up in 15 minutes")
            time.sleep(0.25)

    def __exit__(self, *exc):
        if self.thread_server is not None:
            self.thread_server.stop()
            import gc

            gc.collect()
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.log.seek(0)
            self.log_tail = self.log.read().splitlines()[-20:]
            self.log.close()
        if self.step_log and os.path.exists(self.step_log):
            self.steps = step_summary(self.step_log)
            if self.log_tail:  # a warning such as a failed graph capture shows there
                self.steps["server_log_tail"] = self.log_tail


def step_summary(path: str, top: int = 8) -> dict:
    """A step log (`orthros serve --step-log`) in short: step-time quantiles and the slowest steps."""
    recs = []
    with open(path) as f:
        for line in f:
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a killed server
                pass
    ms = sorted(r["ms"] for r in recs)
    q = (lambda p: percentile(ms, p)) if ms else (lambda p: None)
    return dict(path=path, steps=len(recs), ms_p50=q(50), ms_p99=q(99), ms_max=q(100),
                slowest=sorted(recs, key=lambda r: -r["ms"])[:top], prompts=prompt_times(recs))


def prompt_times(recs: list[dict]) -> list[dict]:
    """Where each prompt's time to its first token went, in the engine: from the start of the step
    of its first chunk to the end of the step that sent its first token, the steps that ran its
    chunks (their time whole, whatever ran beside) and the others in between (another prompt's
    chunk, or its last token run as a decode). Requests served from the prefix cache alone, or
    logged before ids were, are left out."""
    out, seen = [], {}
    for k, r in enumerate(recs):
        for rid in r.get("prompts", ()):
            seen.setdefault(rid, k)
        for rid in r.get("first", ()):
            if rid not in seen:
                continue
            k0 = seen.pop(rid)
            span = recs[k0:k + 1]
            mine = [x["ms"] for x in span if rid in x.get("prompts", ())]
            out.append(dict(request=rid, first_chunk_step=recs[k0]["step"], first_token_step=r["step"],
                            engine_ttft_s=round(r["t"] + r["ms"] / 1e3 - recs[k0]["t"], 4),
                            chunk_steps=len(mine), chunk_s=round(sum(mine) / 1e3, 4),
                            other_steps=len(span) - len(mine),
                            other_s=round((sum(x["ms"] for x in span) - sum(mine)) / 1e3, 4)))
    return out


def _die_with_parent() -> None:
    """In the server's process, before exec: be sent SIGTERM when this process dies, however
    it dies (a killed benchmark must not leave a server holding the GPU's memory)."""
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _served_name(url: str) -> str:
    import httpx

    return httpx.get(url.rstrip("/") + "/models", timeout=10).json()["data"][0]["id"]


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
        r["input"], r["output"] = _scale_len(r["input"], div_in), _scale_len(r["output"], div_out)
        if "question" in r:
            r["question"] = _scale_len(r["question"], div_in)
    return runs


def _device(args) -> str:
    """--device, else CUDA where there is one, except for the tiny scale: a CPU smoke run (fp32
    FlexAttention on CUDA would compile once per chunk shape)."""
    import torch

    return args.device or ("cuda" if torch.cuda.is_available() and args.scale != "tiny" else "cpu")


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

    env = environment(torch.device(_device(args)))
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
                print(f"{variant:8s} {run['name']:>12s}: {row['completed']} ok, TTFT p50 {_ms(row['ttft']['p50'])}, "
                      f"ITL p50 {_ms(row['itl']['p50'])}, {row['output_throughput']:.1f} tok/s", flush=True)
        _keep_steps(steps, variant, srv)


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
            n_bg, bg_in, long_in = t["background"], _scale_len(t["background_input"], div), _scale_len(t["long_input"], div)
            bg = random_prompts([bg_in] * n_bg, _vocab(args), rng)
            long = random_prompts([long_in], _vocab(args), rng)[0]
            bg_out = sc["max_model_len"] - bg_in - 1
            res = asyncio.run(run_interference(srv.url, srv.model, bg, bg_out, long, 1,
                                               settle=0.2 if args.scale == "tiny" else 2.0))
            row = dict(variant=variant, run=f"budget {budget}", budget=budget, background=n_bg,
                       background_input=bg_in, long_input=long_in, **res)
            print(f"{variant:8s} budget {budget:>6d}: long TTFT {_ms(row['long_ttft_ms'])}, running ITL during "
                  f"prefill p50 {_ms(row['itl_during_prefill']['p50'])} p99 {_ms(row['itl_during_prefill']['p99'])}"
                  f" (before: p50 {_ms(row['itl_before']['p50'])})", flush=True)
        _keep_steps(steps, f"{variant} budget {budget}", srv)
        yield row


def _keep_steps(steps: dict, key: str, srv: Server) -> None:
    """The server's step-log summary (--step-log-dir) into the results, its slowest steps printed."""
    if srv.steps:
        steps[key] = srv.steps
        print(f"{key}: {srv.steps['steps']} steps, p50 {_ms(srv.steps['ms_p50'])}, max {_ms(srv.steps['ms_max'])}; "
              "slowest: " + "; ".join(f"{r['ms']:.0f} ms ({r['decode']} decodes, chunks {r['chunks']})"
                                      for r in srv.steps["slowest"][:3]), flush=True)
        long = sorted(srv.steps["prompts"], key=lambda x: -x["engine_ttft_s"])[:4]
        if long:
            print(f"{key}: slowest prompts to their first token, in the engine: " + "; ".join(
                f"{x['engine_ttft_s']:.2f} s = {x['chunk_steps']} steps with its chunks {x['chunk_s']:.2f} s + "
                f"{x['other_steps']} others {x['other_s']:.2f} s" for x in long), flush=True)


def _ms(v) -> str:
    return "-" if v is None else (f"{v / 1e3:.2f} s" if v >= 1e4 else f"{v:.1f} ms")


# ------------------------------------------------------------------ report
def table(res: dict) -> str:
    e = res["env"]
    head = (f"`{res['command']}` — {res['model']} shape, window {res['window']}, KV {res['kv_dtype']}, "
            f"{e['gpu']}, torch {e['torch']}, {e['date']} (scale `{res['scale']}`"
            + (": a CPU smoke run, not a measurement" if res["scale"] == "tiny" else "") + ")\n\n")
    if res["scenario"] == "interference":
        lines = ["| attention | token budget | 128K-prompt TTFT | running ITL p50 during its prefill | p99 | max "
                 "| ITL p50 before |", "|---|---:|---:|---:|---:|---:|---:|"]
        for r in res["rows"]:
            d, b = r["itl_during_prefill"], r["itl_before"]
            lines.append(f"| {r['variant']} | {r['budget']} | {_ms(r['long_ttft_ms'])} | {_ms(d['p50'])} | "
                         f"{_ms(d['p99'])} | {_ms(d['max'])} | {_ms(b['p50'])} |")
        return head + "\n".join(lines) + engine_table(res)
    if res["scenario"] == "long":
        return head + long_table(res) + engine_table(res)
    if res["scenario"] == "faults":
        return head + faults_table(res) + engine_table(res)
    hits = res["scenario"] == "documents"  # the share of prompt tokens read from the prefix cache
    lines = ["| attention | run | ok | req/s | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | ITL p50 | ITL p99 "
             "| E2EL p50 | E2EL p99 |" + (" prefix hits |" if hits else ""),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if hits else "")]
    for r in res["rows"]:
        lines.append(f"| {r['variant']} | {r['run']} | {r['completed']}/{r['completed'] + r['failed']} | "
                     f"{r['request_throughput']:.3f} | {r['output_throughput']:.1f} | {_ms(r['ttft']['p50'])} | "
                     f"{_ms(r['ttft']['p99'])} | {_ms(r['tpot']['p50'])} | {_ms(r['itl']['p50'])} | "
                     f"{_ms(r['itl']['p99'])} | {_ms(r['e2el']['p50'])} | {_ms(r['e2el']['p99'])} |"
                     + (f" {100 * r.get('prefix_hit_rate', 0.0):.1f}% |" if hits else ""))
    return head + "\n".join(lines) + equal_tail_table(res["rows"]) + engine_table(res)


def engine_table(res: dict) -> str:
    """The engine's own view beside the client's: each server's step times (its step log; every
    step of its life, warm-up included), the slowest step and what it ran."""
    steps = res.get("steps") or {}
    if not steps:
        return ""
    lines = ["\n\nThe engine's view (`--step-log`: every step of each server, warm-up included):\n",
             "| server | steps | step p50 | step p99 | step max | the slowest step ran |", "|---|---:|---:|---:|---:|---|"]
    for key, st in steps.items():
        slow = st.get("slowest") or [{}]
        what = f"{slow[0].get('decode', 0)} decodes, chunks {slow[0].get('chunks', [])}" if slow[0] else "-"
        lines.append(f"| {key} | {st['steps']} | {_ms(st['ms_p50'])} | {_ms(st['ms_p99'])} | {_ms(st['ms_max'])} "
                     f"| {what} |")
    return "\n".join(lines)


def equal_tail_table(rows: list[dict], base: str = "full", other: str = "orthros") -> str:
    """Throughput at equal tail latency: for each `base` run, the fastest `other` run whose TTFT
    p99 is no higher, and the ratio of their request (and token) throughputs. Only runs of the
    same prompt lengths (rated runs of one scenario) compare; empty if either variant is missing."""
    rated = lambda v: sorted((r for r in rows if r["variant"] == v and r.get("rate") and r["ttft"]["p99"]),
                             key=lambda r: r["rate"])
    a, b = rated(base), rated(other)
    if not a or not b or len({r.get("total_input_tokens") for r in a + b}) > 1:
        return ""  # runs with different prompts (e.g. of an older benchmark) do not compare in req/s
    lines = ["", "", f"At equal tail latency: for each {base} run, the {other} run with the highest request "
             f"throughput whose TTFT p99 is no higher (runs at every rate carry the same prompt lengths).", "",
             f"| {base} run | TTFT p99 | req/s | {other} run | TTFT p99 | req/s | req/s ratio | tokens/s ratio |",
             "|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in a:
        ok = [x for x in b if x["ttft"]["p99"] <= r["ttft"]["p99"]]
        if not ok:
            lines.append(f"| {r['run']} | {_ms(r['ttft']['p99'])} | {r['request_throughput']:.3f} | none as low | "
                         "| | | |")
            continue
        x = max(ok, key=lambda x: x["request_throughput"])
        lines.append(f"| {r['run']} | {_ms(r['ttft']['p99'])} | {r['request_throughput']:.3f} | {x['run']} | "
                     f"{_ms(x['ttft']['p99'])} | {x['request_throughput']:.3f} | "
                     f"{x['request_throughput'] / r['request_throughput']:.2f}x | "
                     f"{x['total_token_throughput'] / r['total_token_throughput']:.2f}x |")
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    from .common import save_figure, subplots

    rows = res["rows"]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    if res["scenario"] == "long":
        fig, axes = subplots(2, 5.5, 4)
        long_plot(res, (fig, axes))
    elif res["scenario"] == "faults":
        fig, (ax,) = subplots(1, 6, 4)
        faults_plot(res, ax)
    elif res["scenario"] == "interference":
        fig, (ax,) = subplots(1, 5.5, 4)
        for i, v in enumerate(variants):
            rs = [r for r in rows if r["variant"] == v and r["itl_during_prefill"]["p99"] is not None]
            x = [r["budget"] for r in rs]
            ax.plot(x, [r["itl_during_prefill"]["p99"] for r in rs], "o-", color=f"C{i}", label=f"{v} p99")
            ax.plot(x, [r["itl_during_prefill"]["p50"] for r in rs], "x--", color=f"C{i}", label=f"{v} p50")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="token budget per step", ylabel="ITL of running streams (ms)",
               title="decode latency while a long prompt prefills")
    elif res["scenario"] in ("traffic", "documents") or len({r["run"] for r in rows}) > 2:
        # Tail TTFT against throughput, in tokens / s (prompt + output) and requests / s (runs at
        # every rate carry the same lengths, so the two agree), each point named by its run
        fig, axes = subplots(2, 5.5, 4)
        for key, label, ax in (("total_token_throughput", "tokens / s (prompt + output)", axes[0]),
                               ("request_throughput", "completed requests / s", axes[1])):
            for v in variants:
                rs = [r for r in rows if r["variant"] == v and r["ttft"]["p99"] is not None and key in r]
                ax.plot([r[key] for r in rs], [r["ttft"]["p99"] / 1e3 for r in rs], "o-", label=v)
                for r in rs:
                    ax.annotate(r["run"], (r[key], r["ttft"]["p99"] / 1e3), fontsize=7, xytext=(3, 3),
                                textcoords="offset points")
            ax.set(xlabel=label, ylabel="TTFT p99 (s)", title="throughput vs tail TTFT")
    else:
        fig, axes = subplots(2, 4.5, 4)
        runs = list(dict.fromkeys(r["run"] for r in rows))
        width = 0.8 / max(1, len(variants))
        for ax, key, label in zip(axes, ("ttft", "e2el"), ("TTFT p50 (s)", "end-to-end p50 (s)")):
            for j, v in enumerate(variants):
                vals = [next((r[key]["p50"] or 0) / 1e3 for r in rows if r["variant"] == v and r["run"] == run)
                        for run in runs]
                ax.bar([i + j * width for i in range(len(runs))], vals, width, label=v)
            ax.set_xticks([i + width * (len(variants) - 1) / 2 for i in range(len(runs))], runs)
            ax.set(ylabel=label, title=label.split(" (")[0])
    for ax in fig.axes:
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    save_figure(fig, path)


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
        res["servers"] = {k: v for r in runs for k, v in r.get("servers", {}).items()}
        if any("steps" in r for r in runs):
            res["steps"] = {k: v for r in runs for k, v in r.get("steps", {}).items()}
        if len(runs) > 1:
            os.makedirs(args.out_dir, exist_ok=True)
            with open(os.path.join(args.out_dir, f"{name}.json"), "w") as f:
                json.dump(res, f, indent=1)
    else:
        path, kept = os.path.join(args.out_dir, f"{name}.json"), []

        def save(res: dict) -> None:  # after every row: a run cut short keeps what it measured
            os.makedirs(args.out_dir, exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump(res, f, indent=1)
            os.replace(path + ".tmp", path)
            kept[:] = [len(res["rows"])]

        try:
            res = measure(args, save)
        except BaseException:
            if kept:
                print(f"bench serve: the {kept[0]} row(s) measured before it stopped are in {path} "
                      f"(`--from-json {path}` makes their table and plot)", file=sys.stderr, flush=True)
            raise
        save(res)
    text = table(res)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"{name}.md"), "w") as f:
        f.write(text + "\n")
    os.makedirs(args.plot_dir, exist_ok=True)
    plot(res, os.path.join(args.plot_dir, f"{name}.png"))
    print(text)
    if splice_marks(args.docs, text, (f"<!-- {name}-table:begin -->", f"<!-- {name}-table:end -->")):
        print(f"table written into {args.docs}")
    failed = sum(r.get("failed", 0) + len(r.get("errors", []) if args.scenario == "interference" else [])
                 for r in res["rows"])
    return 1 if failed else 0
