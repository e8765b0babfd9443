"""Serving: an OpenAI-compatible HTTP server over a continuous-batching engine.

    engine.py     scheduler + the engine thread (one forward per step, chunked prefill)
    kv_blocks.py  block tables, reference counts, the exact prefix cache
    graphs.py     captured CUDA graphs of decode-only steps
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
