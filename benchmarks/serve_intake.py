"""What a long token-id prompt costs the server before its first chunk runs: the body's JSON
parse, the request schema's validation, the prompt's checks and the engine's `submit`, all on
the API's thread and all holding the GIL that the engine's thread needs to launch its kernels.

    python benchmarks/serve_intake.py --lengths 8K 128K 1M

A thread that wakes every 0.5 ms stands in for the engine's: its longest gap while a request
is taken in is how late a running stream's next step can start. The baseline, measured in the
same run, is `json.loads` of the body alone (what any JSON API pays). Host-only (a tiny model on
the CPU: no forward runs); writes intake.json under --out and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import threading
import time
from pathlib import Path

import torch

from orthros.bench.prefill import parse_len


class Ticker:
    """A thread that sleeps 0.5 ms at a time and keeps its longest gap between wake-ups."""

    def __init__(self):
        self.gap, self._on, self._t = 0.0, True, None

    def __enter__(self):
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        time.sleep(0.01)
        self.gap = 0.0
        return self

    def _run(self):
        last = time.perf_counter()
        while self._on:
            time.sleep(0.0005)
            now = time.perf_counter()
            self.gap = max(self.gap, now - last)
            last = now

    def __exit__(self, *exc):
        time.sleep(0.005)  # the wake-up that ends the gap spanning the intake's end
        gap = self.gap
        self._on = False
        self._t.join()
        self.gap = gap


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", nargs="+", default=["8K", "128K", "1M"], help="prompt tokens (K = 1024)")
    p.add_argument("--vocab", type=int, default=128256, help="token ids drawn below this (Llama 3's vocabulary)")
    p.add_argument("--reps", type=int, default=7, help="timed intakes per length (the median is reported)")
    p.add_argument("--out", default="benchmarks/results/serve")
    a = p.parse_args(argv)

    from orthros.models import OrthrosConfig, OrthrosForCausalLM
    from orthros.serve.engine import Engine, EngineConfig
    from orthros.serve.protocol import CompletionRequest
    from orthros.serve.request import SamplingParams

    lengths = [parse_len(x) for x in a.lengths]
    cfg = OrthrosConfig.from_name("tiny", vocab_size=a.vocab, max_position_embeddings=max(lengths) + 2)
    eng = Engine(OrthrosForCausalLM(cfg).eval(),
                 EngineConfig(block_size=16, num_blocks=max(lengths) // 16 + 2, max_model_len=max(lengths) + 1))
    rng = random.Random(0)
    rows = []
    for n in lengths:
        body = json.dumps({"model": "m", "prompt": [rng.randrange(a.vocab) for _ in range(n)], "max_tokens": 1,
                           "stream": True}).encode()
        floor, intake, gaps = [], [], []
        for _ in range(a.reps):
            t = time.perf_counter()
            json.loads(body)
            floor.append(time.perf_counter() - t)
            with Ticker() as tick:
                t = time.perf_counter()
                req = CompletionRequest.model_validate(json.loads(body))  # FastAPI's way: parse, then validate
                for prompt in req.prompts():
                    eng.submit(list(prompt), SamplingParams(max_tokens=req.max_tokens), lambda ev: None)
                intake.append(time.perf_counter() - t)
            gaps.append(tick.gap)
            eng.scheduler.waiting.clear()
        f, i, g = (statistics.median(x) * 1e3 for x in (floor, intake, gaps))
        rows.append({"tokens": n, "body_bytes": len(body), "json_loads_ms": f, "intake_ms": i,
                     "intake_over_json": i / f, "longest_gap_ms": g})
        print(f"{n:>8} tokens: json.loads {f:6.1f} ms, intake {i:6.1f} ms ({i / f:.2f}x), longest gap {g:5.1f} ms",
              flush=True)
    env = {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
           "torch": torch.__version__, "pydantic": __import__("pydantic").VERSION,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "intake.json").write_text(json.dumps({"env": env, "reps": a.reps, "rows": rows}, indent=1))
    print("\n| prompt tokens | body | json.loads | whole intake | intake / json.loads "
          "| longest gap of a 0.5 ms ticker |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tokens']:,} | {r['body_bytes'] / 2**20:.1f} MiB | {r['json_loads_ms']:.1f} ms | "
              f"{r['intake_ms']:.1f} ms | {r['intake_over_json']:.2f}x | {r['longest_gap_ms']:.1f} ms |")


if __name__ == "__main__":
    main()
