"""The `faults` scenario of `orthros bench serve`: what a server does with requests that go wrong,
at the scale they go wrong at, seen from the client.

    burst        64 long prompts (32K-128K, log-uniform) sent at once to a server with 4 seats and
                 a queue of 16: the overflow must get 503 (queue_full) at once, and every accepted
                 request must stream all of its tokens; then a short request must still be served
    disconnect   a 128K prompt whose client goes away while it is prefilled: the server must free
                 its KV blocks (the /metrics gauge back to 0) and serve the next request
    too long     a prompt one token over the server's --max-model-len: a 400 naming the limit, at once

Each row is one check, with what was measured and whether it held; the run fails (exit code 1) if
any check did not hold.
"""

from __future__ import annotations

import asyncio
import random
import time

from .serve_client import (http_client, lengths, random_prompts, result_dict, scrape_metrics, stream_request,
                           summarize)
from .serve_server import SCALES, keep_steps, scale_len

K = 1024
BURST = dict(num=64, input=("loguniform", 32 * K, 128 * K), output=64, max_num_seqs=4, max_queue=16)
DISCONNECT_INPUT = 128 * K


def _idle(srv) -> bool:
    g = scrape_metrics(srv.url)
    return g.get("orthros_kv_blocks_used", 1) == 0 and g.get("orthros_num_requests_running", 1) == 0 \
        and g.get("orthros_num_requests_waiting", 1) == 0


def _wait_idle(srv, timeout: float) -> float | None:
    """Seconds until the server holds no request and no KV block (None: not within `timeout`)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if _idle(srv):
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def _alive(srv, model: str, vocab: int) -> bool:
    """A short request after the fault is served in full."""
    (p,) = random_prompts([16], vocab, random.Random("alive"))

    async def go():
        async with http_client(1) as client:
            return await stream_request(client, srv.url, model, p, 4)

    return asyncio.run(go()).ok


def burst(srv, model: str, vocab: int, scale_len, seed: int) -> dict:
    rng = random.Random(f"{seed}/burst")
    n, out = BURST["num"], scale_len(BURST["output"], "out")
    prompts = random_prompts(lengths(scale_len(BURST["input"], "in"), n, rng), vocab, rng)

    async def go():
        async with http_client(n) as client:
            t0 = time.perf_counter()
            res = await asyncio.gather(*(stream_request(client, srv.url, model, p, out) for p in prompts))
            return list(res), time.perf_counter() - t0

    results, duration = asyncio.run(go())
    served = [r for r in results if r.ok]
    refused = [r for r in results if (r.error or "").startswith("HTTP 503") and "queue_full" in r.error]
    lost = [r for r in results if not r.ok and r not in refused]
    idle_s = _wait_idle(srv, 60)
    alive = _alive(srv, model, vocab)
    s = summarize(served, duration)
    held = not lost and len(refused) > 0 and idle_s is not None and alive
    return dict(run="burst", sent=n, served=len(served), refused_503=len(refused), lost=len(lost),
                lost_errors=sorted({r.error for r in lost})[:5], input_tokens=sum(r.prompt_len for r in results),
                output=out, seats=BURST["max_num_seqs"], queue=BURST["max_queue"], ttft=s["ttft"], e2el=s["e2el"],
                duration_s=duration, idle_after_s=idle_s, alive_after=alive, held=held,
                requests=[result_dict(r) for r in results])


def disconnect(srv, model: str, vocab: int, length: int, seed: int, asked: int = 16) -> dict:
    """Stream a long prompt; once the server holds its blocks (it is being prefilled), close the
    connection; time until the blocks are free again. The generation counter says how many tokens
    the request made before the server saw it gone (0: the close came mid-prefill; fewer than asked:
    it was cut short, which is all a tiny model on a busy CPU can promise)."""
    import httpx

    (p,) = random_prompts([length], vocab, random.Random(f"{seed}/disconnect"))
    body = {"model": model, "prompt": p, "max_tokens": asked, "temperature": 0.0, "ignore_eos": True, "stream": True}
    used = first = None
    generated = scrape_metrics(srv.url).get("orthros_generation_tokens_total", 0)
    with httpx.Client(timeout=None) as client:
        with client.stream("POST", srv.url + "/completions", json=body) as resp:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 120:
                used = scrape_metrics(srv.url).get("orthros_kv_blocks_used", 0)
                if used > 0:
                    break
                time.sleep(0.01)
            first = resp.status_code
        t_closed = time.monotonic()  # the stream is closed here
    idle_s = _wait_idle(srv, 60)
    tokens = int(scrape_metrics(srv.url).get("orthros_generation_tokens_total", 0) - generated)
    alive = _alive(srv, model, vocab)
    held = first == 200 and bool(used) and tokens < asked and idle_s is not None and alive
    return dict(run="disconnect mid-prefill", input_tokens=length, blocks_held=int(used or 0), status=first,
                freed_after_s=idle_s, closed_after_s=t_closed - t0, tokens_before_abort=tokens, asked=asked,
                alive_after=alive, held=held)


def too_long(srv, model: str, vocab: int) -> dict:
    import httpx

    limit = int(scrape_metrics(srv.url).get("orthros_max_model_len", 0))
    (p,) = random_prompts([limit + 1], vocab, random.Random("too long"))
    t0 = time.perf_counter()
    r = httpx.post(srv.url + "/completions", json={"model": model, "prompt": p, "max_tokens": 1}, timeout=120)
    ms = 1e3 * (time.perf_counter() - t0)
    msg = r.json().get("error", {}).get("message", "") if r.headers.get("content-type", "").startswith(
        "application/json") else r.text[:200]
    held = r.status_code == 400 and str(limit) in msg
    return dict(run="one token over --max-model-len", input_tokens=limit + 1, status=r.status_code,
                message=msg[:300], response_ms=ms, held=held)


def faults_rows(args, variant: str, commands: dict, steps: dict, server_cls, warmup, vocab: int):
    """The scenario's rows for one attention variant, each yielded as soon as its check is done."""
    sc = SCALES[args.scale]
    scaled = lambda spec, kind: scale_len(spec, sc["div_in"] if kind == "in" else sc["div_out"])  # noqa: E731
    # at the tiny scale a prompt near the longest length and a longer answer, so that the request
    # outlasts a few polls of /metrics on a busy CPU
    length, asked = (scaled(DISCONNECT_INPUT, "in"), 16) if args.scale != "tiny" else (sc["max_model_len"] - 96, 64)
    extra = ["--max-num-seqs", str(BURST["max_num_seqs"]), "--max-queue", str(BURST["max_queue"])]
    with server_cls(args, variant, args.budget, extra=extra) as srv:
        commands[variant] = srv.command
        warmup(args, srv, random.Random(args.seed), args.budget)
        for check in (lambda: too_long(srv, srv.model, vocab),
                      lambda: disconnect(srv, srv.model, vocab, length, args.seed, asked),
                      lambda: burst(srv, srv.model, vocab, scaled, args.seed)):
            row = dict(variant=variant, **check())
            row["failed"] = 0 if row["held"] else 1
            print(f"{variant:8s} {row['run']}: {'held' if row['held'] else 'DID NOT HOLD'} "
                  + ", ".join(f"{k} {row[k]}" for k in ("status", "served", "refused_503", "lost", "freed_after_s")
                              if k in row), flush=True)
            yield row
    keep_steps(steps, variant, srv)


def faults_table(res: dict) -> str:
    def ms(v):
        return "-" if v is None else (f"{v / 1e3:.2f} s" if v >= 1e4 else f"{v:.0f} ms")

    lines = ["| attention | check | what was sent | what came back | held |", "|---|---|---|---|---|"]
    for r in res["rows"]:
        if r["run"] == "burst":
            sent = f"{r['sent']} prompts at once, {r['input_tokens']:,} tokens; {r['seats']} seats, queue {r['queue']}"
            idle = "never idle" if r["idle_after_s"] is None else f"idle {r['idle_after_s']:.1f} s after"
            got = (f"{r['served']} served in full (TTFT p50 {ms(r['ttft']['p50'])}, p99 {ms(r['ttft']['p99'])}), "
                   f"{r['refused_503']} × 503, {r['lost']} lost; {idle}; "
                   f"{'serving' if r['alive_after'] else 'NOT serving'} after")
        elif r["run"].startswith("disconnect"):
            sent = (f"{r['input_tokens']:,} tokens, closed after {r['closed_after_s']:.2f} s ({r['blocks_held']} "
                    f"blocks held; {r['tokens_before_abort']} of {r['asked']} tokens made before the server saw it)")
            freed = "not freed" if r["freed_after_s"] is None else f"blocks freed {r['freed_after_s']:.2f} s later"
            got = f"{freed}; {'serving' if r['alive_after'] else 'NOT serving'} after"
        else:
            sent = f"{r['input_tokens']:,} tokens"
            got = f"HTTP {r['status']} in {ms(r['response_ms'])}: {r['message'][:120]}"
        lines.append(f"| {r['variant']} | {r['run']} | {sent} | {got} | {'yes' if r['held'] else '**no**'} |")
    return "\n".join(lines)


def faults_plot(res: dict, ax) -> None:
    """The burst, request by request: the served ones' TTFT and end-to-end latency, the refused
    ones as marks at zero (a 503 comes back at once)."""
    for i, r in enumerate(x for x in res["rows"] if x["run"] == "burst"):
        reqs = r.get("requests") or []
        served = sorted((q for q in reqs if q["ok"]), key=lambda q: q["e2el"])
        xs = range(len(served))
        ax.plot(xs, [q["ttft"] for q in served], "o", color=f"C{i}", label=f"{r['variant']} TTFT")
        ax.plot(xs, [q["e2el"] for q in served], "x", color=f"C{i}", label=f"{r['variant']} end to end")
        ax.plot([len(served) + j for j in range(r["refused_503"])], [0] * r["refused_503"], "|", color=f"C{i}",
                label=f"{r['variant']}: {r['refused_503']} × 503, {r['lost']} lost")
    ax.set(xlabel="request (served ones by latency, then the refused)", ylabel="seconds",
           title="a burst of long prompts")
