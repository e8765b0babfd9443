"""The load client of `orthros bench serve`: async streaming requests and their metrics.

Definitions follow `vllm bench serve`:

    TTFT   request sent -> first streamed token
    TPOT   (E2EL - TTFT) / (output tokens - 1), per request with > 1 token
    ITL    the gaps between consecutive streamed chunks, over all requests
    E2EL   request sent -> last token
    request throughput        completed requests / benchmark duration
    output token throughput   generated tokens / benchmark duration

Arrivals are a Poisson process at a given rate (exponential gaps; `inf`
sends everything at once) and/or bounded by a fixed concurrency; in
`run_sessions`, of multi-turn chats whose turns follow their answers. Prompts are
random token ids (sent as ids: exact lengths, no tokenizer needed, distinct so
the prefix cache cannot help), outputs run to exactly their length
(`ignore_eos`).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field


@dataclass
class Result:
    prompt_len: int
    output_len: int  # asked for
    ok: bool = False
    error: str | None = None
    start: float = 0.0  # perf_counter when sent
    ttft: float | None = None
    e2el: float | None = None
    tokens: int = 0  # generated, as the server's usage reports
    cached: int = 0  # prompt tokens the server read from its prefix cache (usage.prompt_tokens_details)
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of each token-carrying chunk
    token_ids: list[int] = field(default_factory=list)  # the generated tokens (a chat's next turn resends them)
    session: int | None = None  # run_sessions: the chat and its turn
    turn: int | None = None

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.tokens - 1)


# ---------------------------------------------------------------- workloads
def lengths(spec, n: int, rng: random.Random) -> list[int]:
    """n lengths from a spec: an int (fixed), ("uniform", lo, hi) or ("loguniform", lo, hi)."""
    if isinstance(spec, int):
        return [spec] * n
    kind, lo, hi = spec
    if kind == "uniform":
        return [rng.randint(lo, hi) for _ in range(n)]
    if kind == "loguniform":
        return [int(round(math.exp(rng.uniform(math.log(lo), math.log(hi))))) for _ in range(n)]
    raise ValueError(f"a length spec is an int, ('uniform', lo, hi) or ('loguniform', lo, hi); got {spec!r}")


def random_prompts(lens: list[int], vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


# ---------------------------------------------------------------- the server's view
def scrape_metrics(url: str) -> dict[str, float]:
    """The server's own `orthros_*` metrics ({name: value}) from /metrics; `url` is its /v1 URL."""
    import httpx

    text = httpx.get(url[: -len("/v1")] + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].startswith("orthros_"):
            out[parts[0]] = float(parts[1])
    return out


# ---------------------------------------------------------------- one request
async def stream_request(client, url: str, model: str, prompt: list[int], max_tokens: int,
                         res: Result | None = None, token_ids: bool = False) -> Result:
    """One streaming completion. A chunk carries tokens where the usage it reports
    (`continuous_usage_stats`) counts more than the last one did. `token_ids`: also keep the
    generated ids (`return_token_ids`, whose first chunk then carries every prompt id as well:
    about 1 MB at 128K tokens, which the server encodes and the client parses before the first
    token shows, so only a caller that resends the answer asks for it). `res` (optional) is
    filled in as the stream runs, so a caller can watch it."""
    res = res if res is not None else Result(len(prompt), max_tokens)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if token_ids:
        body["return_token_ids"] = True
    res.start = time.perf_counter()
    try:
        async with client.stream("POST", url + "/completions", json=body, timeout=None) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = obj["error"].get("message")
                    return res
                usage = obj.get("usage")
                # (a server that reports no usage per chunk: each chunk with a choice is a token's)
                if obj.get("choices") and (usage["completion_tokens"] > res.tokens if usage else True):
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - res.start
                    res.chunk_times.append(now)
                    if token_ids:
                        res.token_ids += obj["choices"][0].get("token_ids") or []
                if usage:
                    res.tokens = usage["completion_tokens"]
                    res.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        if res.chunk_times:
            res.e2el = res.chunk_times[-1] - res.start
            res.ok = res.tokens == max_tokens
            if not res.ok:
                res.error = f"{res.tokens} of {max_tokens} tokens came back"
        else:
            res.error = "no tokens came back"
    except Exception as e:  # noqa: BLE001 - recorded per request, the run goes on
        res.error = f"{type(e).__name__}: {e}"
    return res


def http_client(concurrency: int):
    import httpx

    limits = httpx.Limits(max_connections=max(16, concurrency), max_keepalive_connections=max(16, concurrency))
    return httpx.AsyncClient(limits=limits, timeout=None)


async def run_load(url: str, model: str, prompts: list[list[int]], outputs: list[int], rate: float = math.inf,
                   concurrency: int | None = None, seed: int = 0) -> tuple[list[Result], float]:
    """Send the requests (Poisson at `rate`, at most `concurrency` in flight); (results, duration s)."""
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency or len(prompts))
    async with http_client(concurrency or len(prompts)) as client:
        async def one(p, n):
            async with sem:
                return await stream_request(client, url, model, p, n)

        t0 = time.perf_counter()
        tasks = []
        for i, (p, n) in enumerate(zip(prompts, outputs)):
            tasks.append(asyncio.create_task(one(p, n)))
            if i + 1 < len(prompts) and math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        ends = [r.start + r.e2el for r in results if r.ok]
    return results, (max(ends) if ends else time.perf_counter()) - t0


async def run_sessions(url: str, model: str, docs: list[list[int]], sessions: list[dict], rate: float = math.inf,
                       seed: int = 0) -> tuple[list[Result], float]:
    """Multi-turn chats about shared documents. A session {"doc": i, "turns": [(question ids,
    answer length), ...]} starts at a Poisson arrival (`rate` sessions / s); its first request is
    docs[i] + the first question, each later one the previous prompt + the answer the server gave
    (its token ids) + the next question, sent when that answer is complete. (results of every
    request, each with its session and turn, duration s)."""
    rng = random.Random(seed)
    async with http_client(len(sessions)) as client:
        async def one(k: int, s: dict) -> list[Result]:
            out, prompt = [], list(docs[s["doc"]])
            for turn, (question, n) in enumerate(s["turns"]):
                prompt = prompt + list(question)
                r = await stream_request(client, url, model, prompt, n, token_ids=True)
                r.session, r.turn = k, turn
                out.append(r)
                if not r.ok:
                    break  # the chat cannot go on without its answer
                prompt = prompt + r.token_ids
            return out

        t0 = time.perf_counter()
        tasks = []
        for k, s in enumerate(sessions):
            tasks.append(asyncio.create_task(one(k, s)))
            if k + 1 < len(sessions) and math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = [r for rs in await asyncio.gather(*tasks) for r in rs]
        ends = [r.start + r.e2el for r in results if r.ok]
    return results, (max(ends) if ends else time.perf_counter()) - t0


async def run_interference(url: str, model: str, background: list[list[int]], background_output: int,
                           long_prompt: list[int], long_output: int = 1, settle: float = 0.5) -> dict:
    """Decode the `background` streams; once each has streamed `settle` s, send `long_prompt`.
    Returns the long request's result and the streams' ITL (ms) while it was prefilled (gaps
    overlapping its send -> first token) and before it arrived."""
    bg = [Result(len(p), background_output) for p in background]
    async with http_client(len(background) + 1) as client:
        tasks = [asyncio.create_task(stream_request(client, url, model, p, background_output, res))
                 for p, res in zip(background, bg)]
        while not all(r.chunk_times for r in bg):
            if any(t.done() for t in tasks):
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(settle)
        long = await stream_request(client, url, model, long_prompt, long_output)
        finished_early = any(t.done() for t in tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    t0 = long.start
    t1 = t0 + (long.ttft if long.ttft is not None else 0.0)
    gaps = [(a, b) for r in bg for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    during = [b - a for a, b in gaps if a < t1 and b > t0]
    before = [b - a for a, b in gaps if b <= t0]
    return {"long": result_dict(long), "long_ttft_ms": None if long.ttft is None else 1e3 * long.ttft,
            "itl_during_prefill": stats_ms(during), "itl_before": stats_ms(before),
            "background_finished_early": finished_early, "errors": [e for e in [long.error] if e]}


def summarize(results: list[Result], duration: float) -> dict:
    """vLLM's summary: counts, throughputs, and mean / p50 / p90 / p99 of TTFT, TPOT, ITL, E2EL (ms)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    s = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
         "request_throughput": len(ok) / duration if duration > 0 else 0.0,
         "output_throughput": out_tokens / duration if duration > 0 else 0.0,
         "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
         "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
         "prefix_hit_rate": sum(r.cached for r in ok) / in_tokens if in_tokens else 0.0,
         "errors": sorted({r.error for r in results if r.error})[:5]}
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", [r.tpot for r in ok if r.tpot is not None]),
                         ("itl", [x for r in ok for x in r.itl]), ("e2el", [r.e2el for r in ok])):
        s[name] = stats_ms(values)
    return s


def stats_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None, "n": 0}
    v = sorted(values)
    return {"mean": 1e3 * sum(v) / len(v), "p50": 1e3 * percentile(v, 50), "p90": 1e3 * percentile(v, 90),
            "p99": 1e3 * percentile(v, 99), "max": 1e3 * v[-1], "n": len(v)}


def fmt_ms(v) -> str:
    """Milliseconds for a table: "-" for none, seconds from 10 s."""
    return "-" if v is None else (f"{v / 1e3:.2f} s" if v >= 1e4 else f"{v:.1f} ms")


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    v = sorted_values
    k = (len(v) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def result_dict(r: Result) -> dict:
    d = asdict(r)
    d.pop("chunk_times")
    d.pop("token_ids")
    return d
