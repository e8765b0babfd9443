"""The `long` scenario of `orthros bench serve`: the longest requests, and the most 128K ones, that a
server's KV cache holds, sent through its OpenAI API.

    long   one request per --long-cases case (default fp8:1M int4:1M int4:2M int2:4M, 128 tokens
           out), each on a server of that KV dtype that sizes its pool and its --max-model-len
           itself (--max-model-len auto); then, for each --capacity-dtypes dtype (default bf16 fp8
           int4 int2), as many concurrent 128K-token requests as that server's pool holds (at most
           --concurrency, default 64: the server's --max-num-seqs)

Each row gives what the client saw (TTFT, decode tokens/s after the first token, end to end) beside
what the server reports on /metrics: its KV pool's bytes, its max model length and its process's
peak device memory. A request longer than the pool holds is sent anyway: its row records the
server's 400 (the limit it names) instead of hanging.
"""

from __future__ import annotations

import asyncio
import math
import random

from ..models.static_cache import KV_DTYPES, LOWBIT_KV_DTYPES
from .serve_client import fmt_ms, random_prompts, result_dict, run_load, scrape_metrics, summarize
from .serve_server import SCALES, keep_steps, scale_len

K = 1024
M = K * K
LONG_CASES = ("fp8:1M", "int4:1M", "int4:2M", "int2:4M")
CAPACITY_DTYPES = ("bf16", "fp8", "int4", "int2")
CAPACITY_INPUT = 128 * K
OUTPUT = 128


def parse_case(s: str) -> tuple[str, int]:
    """'int4:2M' -> ('int4', 2097152)."""
    from .prefill import parse_len

    dtype, sep, length = s.partition(":")
    if not sep or dtype not in KV_DTYPES:
        raise ValueError(f"a --long-cases case is KV_DTYPE:LENGTH with KV_DTYPE one of {', '.join(KV_DTYPES)} "
                         f"(e.g. int4:2M), got {s!r}")
    try:
        return dtype, parse_len(length)
    except ValueError as e:  # read after parsing: the flag is named here
        raise ValueError(f"--long-cases {s}: {e}") from None


def server_gauges(srv) -> dict:
    """The server's /metrics gauges this scenario reports (None where the server has none)."""
    vals = scrape_metrics(srv.url)
    names = dict(kv_pool_bytes="orthros_kv_pool_bytes", max_model_len="orthros_max_model_len",
                 memory_peak_bytes="orthros_device_memory_peak_bytes", kv_blocks="orthros_kv_blocks_total",
                 block_size="orthros_kv_block_size",
                 preemptions="orthros_preemptions_total")
    return {k: (int(vals[v]) if v in vals else None) for k, v in names.items()}


def _row(variant, run, kv_dtype, prompt_len, out, n, results, duration, gauges) -> dict:
    s = summarize(results, duration)
    ok = [r for r in results if r.ok]
    decode = [(r.tokens - 1) / (r.e2el - r.ttft) for r in ok if r.tokens > 1 and r.e2el > r.ttft]
    return dict(variant=variant, run=run, kv_dtype=kv_dtype, input=prompt_len, output=out, concurrency=n,
                decode_tok_s=sum(decode) / len(decode) if decode else None, **gauges, **s,
                requests=[result_dict(r) for r in results])


def long_rows(args, variant: str, commands: dict, steps: dict, server_cls, warmup, vocab: int):
    """The scenario's rows for one attention variant (servers started one after another), each yielded
    as soon as it is measured."""
    sc = SCALES[args.scale]
    div = sc["div_in"]
    out = max(1, OUTPUT // sc["div_out"])
    cases = [parse_case(c) for c in (LONG_CASES if args.long_cases is None else args.long_cases)]
    capacity = CAPACITY_DTYPES if args.capacity_dtypes is None else args.capacity_dtypes
    bad = [kv for kv in capacity if kv not in KV_DTYPES]
    if bad:
        raise ValueError(f"--capacity-dtypes takes {', '.join(KV_DTYPES)}, got {', '.join(bad)}")
    if variant != "orthros":  # the low-bit pools keep the base stream's window in bf16: Orthros only
        skipped = sorted(({kv for kv, _ in cases} | set(capacity)) & set(LOWBIT_KV_DTYPES))
        if skipped:
            print(f"{variant}: no {' / '.join(skipped)} KV cache (Orthros only): those rows are skipped", flush=True)
        cases = [(kv, n) for kv, n in cases if kv not in LOWBIT_KV_DTYPES]
        capacity = [kv for kv in capacity if kv not in LOWBIT_KV_DTYPES]
    for kv, length in cases:
        length = scale_len(length, div)
        name = f"{variant} {kv} {length}"
        with server_cls(args, variant, args.budget, kv_dtype=kv, max_model_len="auto",
                        name=f"{variant}-{kv}-long") as srv:
            commands[name] = srv.command
            warmup(args, srv, random.Random(args.seed), args.budget)
            prompt = random_prompts([length], vocab, random.Random(f"{args.seed}/long {length}"))
            results, duration = asyncio.run(run_load(srv.url, srv.model, prompt, [out], concurrency=1))
            row = _row(variant, f"one {kv} request", kv, length, out, 1, results, duration, server_gauges(srv))
            print(f"{name}: TTFT {fmt_ms(row['ttft']['p50'])}, decode {row['decode_tok_s'] or 0:.1f} tok/s, "
                  "max model len "
                  f"{row['max_model_len']}" + (f", {row['errors']}" if row["errors"] else ""), flush=True)
        keep_steps(steps, name, srv)
        yield row
    for kv in capacity:
        length = scale_len(CAPACITY_INPUT, div)
        name = f"{variant} {kv} x{length}"
        with server_cls(args, variant, args.budget, kv_dtype=kv, name=f"{variant}-{kv}-capacity") as srv:
            commands[name] = srv.command
            warmup(args, srv, random.Random(args.seed), args.budget)
            g = server_gauges(srv)
            holds = g["kv_blocks"] // math.ceil((length + out) / g["block_size"])  # requests of this length
            n = max(1, min(holds, args.concurrency or 64))
            prompts = random_prompts([length] * n, vocab, random.Random(f"{args.seed}/capacity {kv}"))
            results, duration = asyncio.run(run_load(srv.url, srv.model, prompts, [out] * n, concurrency=n))
            row = _row(variant, f"{n} concurrent (the pool holds {holds})", kv, length, out, n, results, duration,
                       server_gauges(srv))
            row["pool_holds"] = holds
            print(f"{name}: the pool holds {row['pool_holds']}, sent {n}: {row['completed']} ok, TTFT p50 "
                  f"{fmt_ms(row['ttft']['p50'])} p99 {fmt_ms(row['ttft']['p99'])}, "
                  f"{row['output_throughput']:.1f} tok/s "
                  f"out", flush=True)
        keep_steps(steps, name, srv)
        yield row


def long_table(res: dict) -> str:
    gib = lambda b: "-" if not b else f"{b / 2**30:.1f} GiB"  # (no peak memory on a CPU)
    lines = ["| attention | KV | run | prompt | ok | TTFT p50 | TTFT p99 | decode tok/s (each) | out tok/s (all) "
             "| max model len | KV pool | peak memory | error |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        err = "; ".join(r["errors"])[:120] if r["errors"] else ""
        lines.append(f"| {r['variant']} | {r['kv_dtype']} | {r['run']} | {r['input']} | {r['completed']}/"
                     f"{r['completed'] + r['failed']} | {fmt_ms(r['ttft']['p50'])} | {fmt_ms(r['ttft']['p99'])} | "
                     f"{'-' if r['decode_tok_s'] is None else format(r['decode_tok_s'], '.1f')} | "
                     f"{r['output_throughput']:.1f} | {r['max_model_len']} | {gib(r['kv_pool_bytes'])} | "
                     f"{gib(r['memory_peak_bytes'])} | {err} |")
    return "\n".join(lines)


def long_plot(res: dict, fig_axes) -> None:
    """TTFT against prompt length (one request each), and how many 128K requests each dtype held."""
    fig, (a, b) = fig_axes
    one = [r for r in res["rows"] if r["concurrency"] == 1 and r["ttft"]["p50"] is not None
           and r["run"].startswith("one")]
    for kv in dict.fromkeys(r["kv_dtype"] for r in one):
        rs = sorted((r for r in one if r["kv_dtype"] == kv), key=lambda r: r["input"])
        a.plot([r["input"] / M for r in rs], [r["ttft"]["p50"] / 1e3 for r in rs], "o-", label=kv)
    a.set(xlabel="prompt (M tokens)", ylabel="TTFT (s)", title="one long request")
    cap = [r for r in res["rows"] if not r["run"].startswith("one")]
    b.bar([f"{r['variant']}\n{r['kv_dtype']}" for r in cap], [r["completed"] for r in cap])
    b.set(ylabel="concurrent 128K requests completed", title="what the pool holds")
