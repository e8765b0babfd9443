"""Where a long prompt's time to first token goes outside the engine's steps, as `orthros bench
serve`'s client sees it: a real server (uvicorn, in this process), a streaming request of token
ids, and marks on one clock at each hand-over.

    python benchmarks/serve_ttft_path.py --lengths 8K 128K --reps 3

    send -> server      the client encodes the body and sends it; the server has its headers
    intake              the body read, parsed, validated and submitted to the engine
    to first step       the engine's thread picks the request up
    steps               its prompt chunks, to the step that samples the first token (the work
                        a device would do; here a tiny model on the CPU stands in for it)
    delivery            that token's event -> the API's stream -> the client's parse

Two client modes, the same requests: `usage` (what `bench serve` asks: each chunk's usage
counts its tokens) against the baseline `ids` (`return_token_ids`, whose first chunk also
carries the prompt's ids back). Host-only: writes ttft-path.json under --out and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from orthros.bench.common import environment
from orthros.bench.prefill import parse_len

PARTS = ("send -> server", "intake", "to first step", "steps", "delivery")


class Marks:
    """perf_counter marks of one request's hand-overs (the first of each name)."""

    def __init__(self):
        self.t: dict[str, float] = {}

    def __call__(self, name: str) -> None:
        self.t.setdefault(name, time.perf_counter())


def instrument(app, engine, marks: Marks):
    """Marks at the server's first sight of a request, the engine's submit, its first step and the
    first token's event, and where the API's stream takes that event. Returns what undoes the
    one class-level patch (`Job.next`)."""
    from orthros.serve import api

    @app.middleware("http")
    async def _seen(request, call_next):
        if request.url.path.endswith("/completions"):
            marks("server")
        return await call_next(request)

    submit, step, emit = engine.submit, engine.step, engine._emit

    def _submit(*a, **k):
        r = submit(*a, **k)
        marks("submitted")
        return r

    def _step(*a, **k):
        if "submitted" in marks.t:
            marks("first step")
        return step(*a, **k)

    def _emit(*a, **k):
        marks("token")
        return emit(*a, **k)

    engine.submit, engine.step, engine._emit = _submit, _step, _emit
    nxt = api.Job.next

    async def _next(self):
        i = await nxt(self)
        marks("event")
        return i

    api.Job.next = _next
    return lambda: setattr(api.Job, "next", nxt)


async def one(client, url: str, model: str, prompt: list[int], ids: bool, marks: Marks) -> dict:
    from orthros.bench.serve_client import stream_request

    marks.t.clear()
    r = await stream_request(client, url, model, prompt, 2, token_ids=ids)
    if not r.ok:
        sys.exit(f"the request failed: {r.error}")
    t, end = marks.t, r.start + r.ttft
    cuts = [r.start, t["server"], t["submitted"], t["first step"], t["token"], end]
    return {**{p: (b - a) * 1e3 for p, a, b in zip(PARTS, cuts, cuts[1:])}, "ttft": r.ttft * 1e3}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", nargs="+", default=["8K", "128K"], help="prompt tokens (K = 1024)")
    p.add_argument("--reps", type=int, default=3, help="timed requests per length and mode (the median is reported)")
    p.add_argument("--budget", type=int, default=8192, help="the engine's token budget (prompt chunk length)")
    p.add_argument("--out", default="benchmarks/results/serve")
    a = p.parse_args(argv)

    from orthros.bench.serve_client import http_client
    from orthros.serve.config import EngineConfig
    from orthros.serve.launch import build_app, load_model, serve_in_thread

    lengths = [parse_len(x) for x in a.lengths]
    max_len = max(lengths) + 64
    model, tok, name = load_model(None, "tiny", "cpu", "fp32", window=16, max_model_len=max_len)
    app, engine = build_app(model, tok, name, EngineConfig(block_size=16, max_num_batched_tokens=a.budget,
                                                           max_model_len=max_len, kv_cache_gib=1.0))
    marks = Marks()
    undo = instrument(app, engine, marks)
    srv = serve_in_thread(app, engine)
    rng, vocab = random.Random(0), model.config.vocab_size
    rows = []

    async def run():
        async with http_client(1) as client:
            await one(client, srv.url, name, [rng.randrange(vocab) for _ in range(256)], False, marks)  # warm-up
            for n in lengths:
                for mode in ("ids", "usage"):
                    got = [await one(client, srv.url, name, [rng.randrange(vocab) for _ in range(n)],
                                     mode == "ids", marks) for _ in range(a.reps)]
                    row = {"tokens": n, "mode": mode, **{k: statistics.median(g[k] for g in got) for k in got[0]}}
                    row["outside_steps"] = row["ttft"] - row["steps"]
                    rows.append(row)
                    print(f"{n:>8} tokens, {mode:>5}: " + ", ".join(f"{k} {row[k]:.1f}" for k in (*PARTS, "ttft"))
                          + " ms", flush=True)

    try:
        asyncio.run(run())
    finally:
        srv.stop()
        undo()
    env = environment(torch.device("cpu"))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python benchmarks/serve_ttft_path.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "ttft-path.json").write_text(json.dumps({"command": cmd, "env": env, "reps": a.reps, "budget": a.budget,
                                                    "rows": rows}, indent=1))
    print("\n| prompt tokens | client asks | " + " | ".join(PARTS) + " | outside the steps | vs ids |")
    print("|---:|---|" + "---:|" * (len(PARTS) + 2))
    base = {r["tokens"]: r["outside_steps"] for r in rows if r["mode"] == "ids"}
    for r in rows:
        print(f"| {r['tokens']:,} | {r['mode']} | " + " | ".join(f"{r[k]:.1f} ms" for k in PARTS)
              + f" | {r['outside_steps']:.1f} ms | {r['outside_steps'] / base[r['tokens']]:.2f}x |")
    return rows


if __name__ == "__main__":
    main()
