"""Serve a model over an OpenAI-compatible HTTP API (continuous batching, paged KV cache).

    orthros serve runs/tiny-orthros --port 8000
    orthros serve --preset llama-3.1-8b --attention full --port 8000   # random weights, token-id prompts

Endpoints: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.
Needs the `serve` extra: pip install 'orthros[serve]'.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from ..errors import check_count, count_arg, positive_arg
from ..models.static_cache import KV_DTYPES, LOWBIT_KV_DTYPES
from .config import EngineConfig

LOWBIT_BLOCK_SIZE = 64  # a low-bit pool's blocks hold whole key groups (`models.paged_lowbit`)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--block-size", type=count_arg(1), default=None,
                   help="tokens per KV block (default 16; with a low-bit --kv-dtype 64, whole key groups)")
    g.add_argument("--num-blocks", type=count_arg(1), default=None,
                   help="KV blocks in the pool (default: from --kv-cache-gib)")
    g.add_argument("--kv-cache-gib", type=positive_arg, default=None,
                   help="KV cache memory (default: CUDA 90%% of what is free after loading, CPU 1 GiB)")
    g.add_argument("--max-num-batched-tokens", type=count_arg(1), default=2048,
                   help="token budget of one step (decodes first, then prompt chunks)")
    g.add_argument("--max-num-seqs", type=count_arg(1), default=64, help="requests running at once")
    g.add_argument("--max-queue", type=count_arg(0), default=256, help="waiting requests before 503")
    g.add_argument("--max-model-len", type=_model_len, default=None,
                   help="prompt + output limit: tokens, or 'auto' for what the KV pool holds "
                        "(default: the model's max_position_embeddings)")
    g.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES,
                   help="KV storage: the model's dtype, bf16 / fp16 / fp32, fp8 (e4m3), or, Orthros models only, "
                        "int4 / int2 / k4v2 (int4 keys, int2 values): the sink tokens and each request's window "
                        "in bf16, older tokens group-quantized after a Hadamard rotation (as generate's low-bit "
                        "cache): ~3.5x (int4), ~4.5x (k4v2), ~6.4x (int2) the tokens of bf16 in the same memory (head size 128)")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-cuda-graphs", action="store_true", help="run decode-only steps eagerly on CUDA")
    g.add_argument("--step-log", default=None, metavar="PATH",
                   help="append one JSON line per engine step (what it ran, its time) to PATH")


def _model_len(s: str) -> int | str:
    if s == "auto":
        return s
    try:
        n = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of tokens or 'auto', not {s!r}") from None
    return check_count(n, 1)


def engine_config(args) -> EngineConfig:
    block_size = args.block_size or (LOWBIT_BLOCK_SIZE if args.kv_dtype in LOWBIT_KV_DTYPES else 16)
    return EngineConfig(block_size=block_size, num_blocks=args.num_blocks, kv_cache_gib=args.kv_cache_gib,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                        max_queue=args.max_queue, max_model_len=args.max_model_len, kv_dtype=args.kv_dtype,
                        prefix_caching=not args.no_prefix_caching, cuda_graphs=not args.no_cuda_graphs,
                        step_log=args.step_log)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--preset", default=None, help="serve a named config with random weights instead of MODEL_DIR")
    g.add_argument("--attention", default=None, choices=("orthros", "full", "swa"), help="override the model's")
    g.add_argument("--window", type=count_arg(1), default=None, help="override the sliding window")
    g.add_argument("--layers", type=count_arg(1), default=None, help="preset only: number of layers")
    g.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp16", "fp32"),
                   help="weights (default: bf16 on CUDA, fp32 on CPU)")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    g.add_argument("--served-model-name", default=None, help="the `model` clients send (default: the directory name)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="model directory (config.json, weights, tokenizer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=count_arg(0, 65535), default=8000, help="0: a free port")
    p.add_argument("--tool-call-parser", default="auto", choices=("auto", "hermes", "llama3_json"),
                   help="how tool calls are read from chat answers (default: the format the chat template shows)")
    p.add_argument("--api-key", default=os.environ.get("ORTHROS_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 requests (default: $ORTHROS_API_KEY; none: open)")
    add_model_arguments(p)
    add_engine_arguments(p)


def run(args) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise ValueError(f"orthros serve needs the serving extra: pip install 'orthros[serve]' ({e})") from e
    from .launch import bind, build_app, load_model, open_access_warning

    model, tok, name = load_model(args.model, args.preset, args.device, args.dtype, args.attention, args.window,
                                  args.layers, args.max_model_len)
    app, engine = build_app(model, tok, args.served_model_name or name, engine_config(args), args.api_key,
                            args.tool_call_parser)
    sock = bind(args.host, args.port)
    if engine.max_model_len > engine.capacity_tokens:
        print(f"orthros serve: the KV pool holds {engine.capacity_tokens:,} tokens, fewer than --max-model-len "
              f"{engine.max_model_len:,}: longer requests get a 400 (--max-model-len auto sizes the limit to the "
              "pool; --kv-dtype fp8 / int4 / int2 or more --kv-cache-gib hold more)", file=sys.stderr, flush=True)
    warning = open_access_warning(args.host, args.api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    kv = engine.pool.memory_bytes / 2**30
    print(f"orthros serve: {name} ({model.config.attention}) on {args.device}, {engine.blocks.num_blocks} KV blocks "
          f"x {engine.blocks.block_size} tokens ({kv:.2f} GiB, {engine.pool.storage}), "
          f"http://{args.host}:{sock.getsockname()[1]}/v1", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="info", lifespan="on")).run(sockets=[sock])
    return 0
