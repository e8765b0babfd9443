"""Build an engine + app from a model directory or a preset, and run it under uvicorn
(in this thread, or in a background thread for tests and in-process benchmarks)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import EngineConfig
from .engine import Engine

DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def load_model(model_dir: str | None, preset: str | None, device: str, dtype: str = "auto",
               attention: str | None = None, window: int | None = None, layers: int | None = None,
               max_model_len: int | str | None = None, seed: int = 0):
    """(model, tokenizer or None, served name): a saved model directory, or a preset with
    random weights (no tokenizer: prompts are token ids)."""
    from ..models import OrthrosConfig

    dev = torch.device(device)
    want = DTYPES[dtype] or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    over = {k: v for k, v in (("attention", attention), ("window_size", window)) if v is not None}
    if (model_dir is None) == (preset is None):
        raise ValueError("give a model directory or --preset, not both" if preset else
                         "give a model directory or --preset NAME (random weights of a named size)")
    if layers is not None and preset is None:
        raise ValueError("--layers applies to --preset only (a saved model keeps its layers)")
    if preset is not None:
        if layers is not None:
            over["num_hidden_layers"] = layers
        from ..random_model import build_model

        cfg = OrthrosConfig.from_name(preset, **over)
        if isinstance(max_model_len, int):
            cfg.max_position_embeddings = max(cfg.max_position_embeddings, max_model_len)
        torch.manual_seed(seed)
        return build_model(cfg, dev, want), None, preset
    from ..data.tokenizer import load_tokenizer
    from ..loading import load_model as load_checked, read_config

    d = Path(model_dir)
    cfg = read_config(d)  # config, weights and tokenizer checked before a weight is read; safetensors only
    for k, v in over.items():
        setattr(cfg, k, v)
    cfg.validate()
    model = load_checked(d, dtype=want, config=cfg).to(dev).eval()
    try:
        tok = load_tokenizer(d, model.config.vocab_size)
    except FileNotFoundError:
        tok = None
    return model, tok, d.name


def eos_ids(model, tokenizer) -> list[int]:
    ids = set()
    for src in (model.config.eos_token_id, getattr(tokenizer, "eos_token_id", None)):
        if src is None:
            continue
        ids.update([src] if isinstance(src, int) else src)
    return sorted(ids)


def build_app(model, tokenizer, name: str, engine_config: EngineConfig, api_key: str | None = None,
              tool_parser: str = "auto"):
    from .api import create_app
    from .metrics import ServerMetrics

    metrics = ServerMetrics()
    engine = Engine(model, engine_config, eos_token_ids=eos_ids(model, tokenizer), metrics=metrics)
    return create_app(engine, tokenizer, name, metrics, api_key, tool_parser), engine


def open_access_warning(host: str, api_key: str | None) -> str | None:
    """What `orthros serve` warns about before it listens, or None."""
    if api_key is None and not is_loopback(host):
        return (f"orthros serve: warning: listening on {host} without an API key: anyone who can reach this port "
                "can use the model (set --api-key or $ORTHROS_API_KEY)")
    return None


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is reachable from this machine only."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost: assume others can reach it
        return False


def bind(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening socket (port 0: a free one, no race with other processes)."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(fam, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


@dataclass
class RunningServer:
    """A uvicorn server in a background thread; `url` is its /v1 base."""

    server: object
    thread: threading.Thread
    host: str
    port: int
    engine: Engine

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return self.base + "/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def serve_in_thread(app, engine: Engine, host: str = "127.0.0.1", port: int = 0, timeout: float = 60) -> RunningServer:
    import uvicorn

    sock = bind(host, port)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="orthros-uvicorn", daemon=True)
    thread.start()
    t0 = time.monotonic()
    while not server.started:
        if not thread.is_alive() or time.monotonic() - t0 > timeout:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    return RunningServer(server, thread, host, port, engine)
