"""Prometheus metrics of a server (`GET /metrics`), on a registry of its own.

Latencies are taken in the engine thread when a token is sampled (TTFT from
arrival to the first token, inter-token latency between a request's
consecutive tokens, end-to-end to its last), so they exclude the HTTP
transport; `orthros bench serve` measures the client's view.
"""

from __future__ import annotations

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
TOKEN_BUCKETS = tuple(2**i for i in range(18))


class ServerMetrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.requests = Counter("orthros_requests", "Finished requests, by finish reason", ["finish_reason"],
                                registry=r)
        self.rejected = Counter("orthros_requests_rejected", "Requests refused before queueing, by reason",
                                ["reason"], registry=r)
        self.prompt_tokens = Counter("orthros_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("orthros_prefix_cache_hit_tokens", "Prompt tokens read from the prefix cache",
                                     registry=r)
        self.generation_tokens = Counter("orthros_generation_tokens", "Generated tokens", registry=r)
        self.preemptions = Counter("orthros_preemptions", "Requests preempted for KV memory (recomputed later)",
                                   registry=r)
        self.ttft = Histogram("orthros_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("orthros_inter_token_latency_seconds", "Between consecutive tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("orthros_e2e_request_latency_seconds", "Arrival to the last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("orthros_request_queue_time_seconds", "Arrival to admission",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.step_time = Histogram("orthros_step_seconds", "One engine step on the host (a step that reads no "
                                   "token back returns once its forward is queued)", buckets=LATENCY_BUCKETS,
                                   registry=r)
        self.step_tokens = Histogram("orthros_step_tokens", "Tokens run in one step", buckets=TOKEN_BUCKETS,
                                     registry=r)
        self.waiting = Gauge("orthros_num_requests_waiting", "Requests in the queue", registry=r)
        self.running = Gauge("orthros_num_requests_running", "Requests admitted (prefilling or decoding)",
                             registry=r)
        self.kv_used = Gauge("orthros_kv_blocks_used", "KV blocks held by requests", registry=r)
        self.kv_total = Gauge("orthros_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.kv_pool_bytes = Gauge("orthros_kv_pool_bytes", "Device memory of the KV pool (packed blocks and their "
                                   "bf16 twins for a low-bit pool)", registry=r)
        self.block_size = Gauge("orthros_kv_block_size", "Tokens a KV block holds", registry=r)
        self.max_model_len = Gauge("orthros_max_model_len", "The longest request (prompt + output) served, tokens",
                                   registry=r)
        self.memory_peak = Gauge("orthros_device_memory_peak_bytes", "Peak device memory allocated by the server's "
                                 "process (CUDA; weights, KV pool and activations)", registry=r)
        self.alive = Gauge("orthros_engine_alive", "1 while the engine runs", registry=r)
        self.alive.set(1)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    # ------------------------------------------------------- engine hooks
    def on_start(self, engine) -> None:
        self.kv_pool_bytes.set(engine.pool.memory_bytes)
        self.max_model_len.set(engine.max_model_len)
        self.block_size.set(engine.blocks.block_size)
        # the engine's state is read when scraped, not set on its steps: an idle engine runs none, and
        # a gauge set in its last step would show the request that step finished
        self.waiting.set_function(lambda: len(engine.waiting))
        self.running.set_function(lambda: len(engine.running))
        self.kv_used.set_function(lambda: engine.blocks.num_used)
        self.kv_total.set_function(lambda: engine.blocks.num_blocks)
        if engine.device.type == "cuda":
            import torch

            self.memory_peak.set_function(lambda dev=engine.device: torch.cuda.max_memory_allocated(dev))

    def on_step(self, engine, tokens: int, segments: int, seconds: float) -> None:
        self.step_time.observe(seconds)
        self.step_tokens.observe(tokens)

    def on_admit(self, req, now: float) -> None:
        if req.num_output == 0:  # not a readmission after preemption
            self.queue_time.observe(now - req.arrival)
            self.cached_tokens.inc(req.cached_tokens)

    def on_token(self, req, now: float) -> None:
        if req.first_token_at is None:
            self.ttft.observe(now - req.arrival)
        else:
            self.itl.observe(now - req.last_token_at)
        self.generation_tokens.inc()

    def on_finish(self, req, reason: str, now: float) -> None:
        self.requests.labels(reason).inc()
        self.prompt_tokens.inc(len(req.prompt))
        self.e2e.observe(now - req.arrival)

    def engine_dead(self) -> None:
        self.alive.set(0)
