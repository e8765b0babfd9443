"""`orthros bench serve`'s servers: one `orthros serve` per (attention, token budget, KV dtype),
started in a subprocess (or in this process, or the one at --url), and what its step log says.

The scales (`--scale`) live here: the model shape, dtype and server limits each one starts with."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

from ..models.static_cache import LOWBIT_KV_DTYPES
from .serve_client import fmt_ms, percentile

K = 1024

# Lengths are written at the GPU scale; a scale divides prompts, outputs and budgets (min 1).
SCALES = {
    "gpu": dict(model="llama-3.1-8b", dtype="bf16", div_in=1, div_out=1, div_budget=1, max_model_len=129 * K + 1024,
                block_size=16, window=128),
    "tiny": dict(model="tiny", dtype="fp32", div_in=512, div_out=16, div_budget=128, max_model_len=1024,
                 block_size=4, window=16),
}


def scale_len(spec, div: int):
    if isinstance(spec, int):
        return spec if div == 1 else max(1, spec // div)
    kind, lo, hi = spec
    return (kind, scale_len(lo, div), max(scale_len(lo, div) + 1, scale_len(hi, div)))


def bench_device(args) -> str:
    """--device, else CUDA where there is one, except for the tiny scale: a CPU smoke run (fp32
    FlexAttention on CUDA would compile once per chunk shape)."""
    import torch

    return args.device or ("cuda" if torch.cuda.is_available() and args.scale != "tiny" else "cpu")


class Server:
    """A server for one (attention, budget): started here, or the one at --url."""

    def __init__(self, args, attention: str, budget: int, kv_dtype: str | None = None,
                 max_model_len: int | str | None = None, name: str | None = None, extra: list[str] = ()):
        self.args, self.attention, self.budget, self.extra = args, attention, budget, list(extra)
        self.kv_dtype, self.max_model_len = kv_dtype or args.kv_dtype, max_model_len
        self.name = name or f"{attention}-budget{budget}"
        self.proc = self.thread_server = None
        self.command = None
        self.step_log = self.steps = None
        self.log_tail = None  # a started subprocess server's last output lines

    def __enter__(self):
        a, sc = self.args, SCALES[self.args.scale]
        if a.url:
            self.url, self.model = a.url.rstrip("/"), a.model_name or _served_name(a.url)
            return self
        device = bench_device(a)
        argv = ["--preset", sc["model"], "--attention", self.attention, "--window", str(a.window),
                "--dtype", sc["dtype"], "--device", device,
                "--max-model-len", str(self.max_model_len or sc["max_model_len"]),
                "--max-num-batched-tokens", str(self.budget), "--kv-dtype", self.kv_dtype,
                "--max-num-seqs", "64", "--max-queue", "4096"]
        if self.kv_dtype not in LOWBIT_KV_DTYPES:  # a low-bit server picks the block size its key groups need
            argv += ["--block-size", str(sc["block_size"])]
        if a.layers:
            argv += ["--layers", str(a.layers)]
        argv += shlex.split(a.server_args or "")
        argv += self.extra  # a scenario's own server settings (later flags win)
        if a.step_log_dir:
            os.makedirs(a.step_log_dir, exist_ok=True)
            # the run's tag first: runs that share a directory (and a budget) keep their own logs
            self.step_log = os.path.join(a.step_log_dir, f"{a.tag or 'serve-' + a.scenario}-{self.name}.jsonl")
            if os.path.exists(self.step_log):
                os.remove(self.step_log)  # this server's steps only
            argv += ["--step-log", self.step_log]
        if device == "cpu" or a.scale == "tiny":  # a tiny model needs little, and a shared GPU keeps the rest
            argv += ["--kv-cache-gib", "0.25"]
        self.model = sc["model"]
        if a.server == "inprocess":
            self._start_inprocess(argv)
        else:
            self._start_subprocess(argv)
        return self

    def _start_inprocess(self, argv):
        import argparse

        from ..serve import cli
        from ..serve.launch import build_app, load_model, serve_in_thread

        p = argparse.ArgumentParser()
        cli.add_arguments(p)
        ns = p.parse_args(argv)
        model, tok, name = load_model(None, ns.preset, ns.device, ns.dtype, ns.attention, ns.window, ns.layers,
                                      ns.max_model_len, seed=self.args.seed)
        app, engine = build_app(model, tok, name, cli.engine_config(ns))
        self.thread_server = serve_in_thread(app, engine)
        self.url = self.thread_server.url
        self.command = "in-process: orthros serve " + shlex.join(argv)

    def _start_subprocess(self, argv):
        from ..serve.launch import bind

        sock = bind()
        port = sock.getsockname()[1]
        sock.close()
        cmd = [sys.executable, "-m", "orthros", "serve", *argv, "--port", str(port)]
        self.command = shlex.join(cmd[2:])
        import tempfile

        # a file, not a pipe: nobody reads the log while the load runs, and a full pipe blocks the server
        self.log = tempfile.NamedTemporaryFile("w+", prefix="orthros-serve-", suffix=".log")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        self.url = f"http://127.0.0.1:{port}/v1"
        import httpx

        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.log.read()[-3000:]}")
            try:
                if httpx.get(self.url[:-3] + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > 900:
                self.proc.kill()
                raise RuntimeError("the server did not come up in 15 minutes")
            time.sleep(0.25)

    def __exit__(self, *exc):
        if self.thread_server is not None:
            self.thread_server.stop()
            import gc

            gc.collect()
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.log.seek(0)
            self.log_tail = self.log.read().splitlines()[-20:]
            self.log.close()
        if self.step_log and os.path.exists(self.step_log):
            self.steps = step_summary(self.step_log)
            if self.log_tail:  # a warning such as a failed graph capture shows there
                self.steps["server_log_tail"] = self.log_tail


def step_summary(path: str, top: int = 8) -> dict:
    """A step log (`orthros serve --step-log`) in short: step-time quantiles and the slowest steps."""
    recs = []
    with open(path) as f:
        for line in f:
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a killed server
                pass
    ms = sorted(r["ms"] for r in recs)
    q = (lambda p: percentile(ms, p)) if ms else (lambda p: None)
    return dict(path=path, steps=len(recs), ms_p50=q(50), ms_p99=q(99), ms_max=q(100),
                slowest=sorted(recs, key=lambda r: -r["ms"])[:top], prompts=prompt_times(recs))


def prompt_times(recs: list[dict]) -> list[dict]:
    """Where each prompt's time to its first token went, in the engine: from the start of the step
    of its first chunk to the end of the step that sent its first token, the steps that ran its
    chunks (their time whole, whatever ran beside) and the others in between (another prompt's
    chunk, or its last token run as a decode). Requests served from the prefix cache alone, or
    logged before ids were, are left out."""
    out, seen = [], {}
    for k, r in enumerate(recs):
        for rid in r.get("prompts", ()):
            seen.setdefault(rid, k)
        for rid in r.get("first", ()):
            if rid not in seen:
                continue
            k0 = seen.pop(rid)
            span = recs[k0:k + 1]
            mine = [x["ms"] for x in span if rid in x.get("prompts", ())]
            out.append(dict(request=rid, first_chunk_step=recs[k0]["step"], first_token_step=r["step"],
                            engine_ttft_s=round(r["t"] + r["ms"] / 1e3 - recs[k0]["t"], 4),
                            chunk_steps=len(mine), chunk_s=round(sum(mine) / 1e3, 4),
                            other_steps=len(span) - len(mine),
                            other_s=round((sum(x["ms"] for x in span) - sum(mine)) / 1e3, 4)))
    return out


def _die_with_parent() -> None:
    """In the server's process, before exec: be sent SIGTERM when this process dies, however
    it dies (a killed benchmark must not leave a server holding the GPU's memory)."""
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _served_name(url: str) -> str:
    import httpx

    return httpx.get(url.rstrip("/") + "/models", timeout=10).json()["data"][0]["id"]


def keep_steps(steps: dict, key: str, srv: Server) -> None:
    """The server's step-log summary (--step-log-dir) into the results, its slowest steps printed."""
    if srv.steps:
        steps[key] = srv.steps
        print(f"{key}: {srv.steps['steps']} steps, p50 {fmt_ms(srv.steps['ms_p50'])}, "
              f"max {fmt_ms(srv.steps['ms_max'])}; "
              "slowest: " + "; ".join(f"{r['ms']:.0f} ms ({r['decode']} decodes, chunks {r['chunks']})"
                                      for r in srv.steps["slowest"][:3]), flush=True)
        long = sorted(srv.steps["prompts"], key=lambda x: -x["engine_ttft_s"])[:4]
        if long:
            print(f"{key}: slowest prompts to their first token, in the engine: " + "; ".join(
                f"{x['engine_ttft_s']:.2f} s = {x['chunk_steps']} steps with its chunks {x['chunk_s']:.2f} s + "
                f"{x['other_steps']} others {x['other_s']:.2f} s" for x in long), flush=True)
