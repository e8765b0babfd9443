"""Serving: an OpenAI-compatible HTTP server over a continuous-batching engine.

    engine.py     wires scheduler, runner and sampling; the engine thread
    request.py    requests, sampling parameters, token events, submit's errors
    config.py     EngineConfig
    scheduler.py  token budget, chunked prefill, admission, preemption (no model)
    kv_blocks.py  block tables, reference counts, the exact prefix cache
    runner.py     the model and its KV pool: one forward per step, warm-up
    graphs.py     captured CUDA graphs of decode-only steps
    step_log.py   --step-log: a JSON line per step, timed without synchronizing the device
    sampling.py   the next token from logits, stop conditions
    api.py        FastAPI endpoints, SSE streaming, OpenAI-style errors
    protocol.py   request schemas (pydantic) and response shapes
    outputs.py    incremental detokenization, stop strings
    metrics.py    Prometheus metrics
    launch.py     model + engine + app, uvicorn in this or a background thread
    cli.py        `orthros serve`

The KV storage and the cache object the model's layers call live in
`orthros.models.paged_cache`; the model never imports this package. FastAPI
and uvicorn (the `serve` extra) are imported only by api.py / launch.py.
"""
