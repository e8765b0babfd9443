"""The engine: continuous batching with chunked prefill over a paged KV cache.

Every request is a token list (prompt, then generated tokens) and a count of
tokens whose K/V are in the cache (`computed`). A step schedules, under a
token budget (`max_num_batched_tokens`), as vLLM does:

    1. running decodes, one token each (a new block when one fills; if none
       is free, the newest running request is preempted: its blocks are
       released and it is recomputed later, mostly from the prefix cache);
    2. running prompts not fully prefilled: their next chunk;
    3. waiting requests, first come first served, admitted while blocks for
       their whole prompt are free (after reusing cached prefix blocks) and
       fewer than `max_num_seqs` run: their first chunk.

and runs all of it as one forward (`models.paged_cache.PagedStepCache`): a
chunk whose end is not the end of its token list has no output position
(base stream only); the others have one, at their last token, whose logits
give the next token. A decode is the one-token case of the same rule.
On CUDA the decodes of a step run through captured graphs (`serve.graphs`),
beside an eager forward for the step's chunks (`Engine._forward`).

The engine runs in a background thread (`start`); `submit` / `abort` are
safe from any thread, and each request's events go to its `sink` callable
(called from the engine thread). If a step raises, the engine is dead:
every request gets an error event, `alive` turns False, and `error` holds
the exception.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..generate import SamplingConfig, sample
from ..models.paged_cache import PagedKVPool, PagedStepCache, Segment, kv_bytes_per_token
from .kv_blocks import BlockPool, BlockTable


class QueueFull(Exception):
    """The waiting queue is at its bound (`max_queue`)."""


class EngineDead(Exception):
    """The engine thread stopped after an error."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # keep going past the model's end-of-sequence tokens
    min_tokens: int = 0  # no stop before this many tokens
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's and the top k

    def __post_init__(self):
        SamplingConfig(self.temperature, self.top_k, self.top_p)  # validates
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")


@dataclass
class TokenEvent:
    """One generated token (or the end of a request). finish_reason: None while running,
    then "stop" | "length" | "abort" | "error"."""

    token_id: int | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    error: str | None = None


@dataclass(eq=False)  # identity: `req in running` must not compare prompts field by field
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    sink: Callable[[TokenEvent], None]
    tokens: list[int] = field(default_factory=list)
    computed: int = 0
    table: BlockTable = field(default_factory=BlockTable)
    generator: torch.Generator | None = None
    arrival: float = 0.0
    first_token_at: float | None = None
    last_token_at: float | None = None
    cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    finished: bool = False

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt)


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: from kv_cache_gib
    kv_cache_gib: float | None = None  # None: CUDA 90% of free memory after warm-up, CPU 1 GiB
    max_num_batched_tokens: int = 2048  # the per-step token budget
    max_num_seqs: int = 64
    max_queue: int = 256  # waiting requests before `submit` raises QueueFull
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    kv_dtype: str = "auto"
    prefix_caching: bool = True
    cuda_graphs: bool = True  # decode-only steps on CUDA replay captured graphs
    # With graphs: a step mixing decodes and prompt chunks replays the decodes' graph, then runs
    # the chunks eagerly (two forwards) instead of one eager forward over all of them
    split_mixed_steps: bool = True
    # A prompt's last token runs as a decode (the step after its last chunk, which then has no
    # output position and runs the base stream only): a chunk with an output position runs
    # both streams eagerly, ~2x the host's kernel launches of a base-only chunk (50-80 ms on
    # an H200 at the 8B shape), while the decode joins the captured graph. None: wherever
    # decode graphs run.
    decode_last_prompt_token: bool | None = None
    # A prompt chunk cut short by the budget is rounded down to a multiple of this (and of a
    # quarter of its power of two): compiled attention kernels then see few distinct chunk
    # lengths. None: 128 on CUDA, 1 (no rounding) elsewhere.
    chunk_align: int | None = None
    # A JSON-lines file with one record per step (what it ran, how long it took; the device is
    # synchronized at the end of each step to time it): to find which steps are slow.
    step_log: str | None = None


class Engine:
    def __init__(self, model, config: EngineConfig | None = None, eos_token_ids=(), metrics=None):
        self.model = model.eval()
        self.cfg = cfg = config or EngineConfig()
        mc = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.max_model_len = cfg.max_model_len or mc.max_position_embeddings
        if cfg.max_num_batched_tokens < 1 or cfg.max_num_seqs < 1 or cfg.max_queue < 0:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1, max_queue >= 0")
        num_blocks = cfg.num_blocks or self._blocks_from_memory()
        # one block more than the block manager hands out: a scratch block for padded rows
        self.pool = PagedKVPool(mc, num_blocks + 1, cfg.block_size, self.device, self.dtype, cfg.kv_dtype)
        self.scratch_block = num_blocks
        self.blocks = BlockPool(num_blocks, cfg.block_size, cfg.prefix_caching)
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.metrics = metrics
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._aborts: set[int] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.error: BaseException | None = None
        self.steps = 0
        self._t_start = time.perf_counter()
        self._used_graph = False
        self._step_log = None
        if cfg.step_log:
            try:
                self._step_log = open(cfg.step_log, "a", buffering=1)  # line-buffered: a killed server loses no line
            except OSError as e:
                raise ValueError(f"cannot write the step log {cfg.step_log}: {e.strerror}") from None
        self.chunk_align = cfg.chunk_align or (128 if self.device.type == "cuda" else 1)
        self.graphs = None
        if cfg.cuda_graphs and self.device.type == "cuda":
            from .graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self)
        last = cfg.decode_last_prompt_token
        self.decode_last_token = self.graphs is not None if last is None else last

    def _blocks_from_memory(self) -> int:
        per_block = kv_bytes_per_token(self.model.config, self.dtype, self.cfg.kv_dtype) * self.cfg.block_size
        gib = self.cfg.kv_cache_gib
        if gib is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                # headroom for the activations of a full token budget (MLP rows dominate)
                mc = self.model.config
                act = self.cfg.max_num_batched_tokens * (3 * mc.intermediate_size + 8 * mc.hidden_size) * 4
                act += self.cfg.max_num_batched_tokens * mc.vocab_size * 4 // 8
                budget = 0.9 * free - act - (2 << 30)
            else:
                budget = 1 << 30
        else:
            budget = gib * 2**30
        n = int(budget // per_block) - 1
        if n < 2:
            raise ValueError(f"no memory for the KV cache ({budget / 2**30:.2f} GiB for blocks of {per_block} bytes)")
        return n

    # ------------------------------------------------------------ public API
    @property
    def alive(self) -> bool:
        return self.error is None and not self._stop

    @property
    def capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.blocks.block_size

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """ValueError (a 400 for the server) when a request can never run."""
        if prompt_len < 1:
            raise ValueError("the prompt is empty")
        total = prompt_len + max_tokens
        if total > self.max_model_len:
            raise ValueError(f"this model's maximum context length is {self.max_model_len} tokens; the request "
                             f"asks for {total} ({prompt_len} in the prompt, {max_tokens} to generate)")
        if self.blocks.blocks_for(total) > self.blocks.num_blocks:
            raise ValueError(f"the KV cache holds {self.capacity_tokens} tokens; the request needs {total}")

    def submit(self, prompt: list[int], params: SamplingParams, sink: Callable[[TokenEvent], None]) -> Request:
        """Queue a request; raises ValueError (bad request), QueueFull or EngineDead."""
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        self.check(len(prompt), params.max_tokens)
        if not self.alive:
            raise EngineDead(str(self.error) if self.error else "the engine is stopped")
        req = Request(next(self._ids), list(prompt), params, sink, tokens=list(prompt), arrival=time.perf_counter())
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        if params.temperature > 0:
            req.generator = torch.Generator(device=self.device)
            req.generator.manual_seed(seed)
        with self._lock:
            if len(self.waiting) >= self.cfg.max_queue:
                raise QueueFull(f"the queue holds {self.cfg.max_queue} waiting requests")
            self.waiting.append(req)
        self._wake.set()
        return req

    def abort(self, request_id: int) -> None:
        with self._lock:
            self._aborts.add(request_id)
        self._wake.set()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborts)

    def start(self) -> None:
        with torch.inference_mode():
            self.warm_up()
            if self.graphs is not None and not self.pool.fp8:  # fp8 scales come from the first prefill: later
                self.graphs.capture_all()
        self._thread = threading.Thread(target=self._loop, name="orthros-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._step_log is not None:
            self._step_log.close()
            self._step_log = None

    def run_until_done(self, max_steps: int = 1_000_000) -> None:
        """Step in the calling thread until nothing is left (tests, offline use)."""
        for _ in range(max_steps):
            if not self.has_work():
                return
            self.step()
        raise RuntimeError(f"work left after {max_steps} steps")

    def chunk_lengths(self) -> list[int]:
        """The lengths a prompt chunk cut by the token budget can have (whatever the running
        decodes leave of the budget); a prompt's last chunk is whatever remains."""
        budget, n = self.cfg.max_num_batched_tokens, self.cfg.max_num_seqs
        return sorted({self._chunk(budget + 1, b) for b in range(max(1, budget - n), budget + 1)})

    def warm_up(self) -> None:
        """On CUDA, before serving, so that no step of a running stream waits for a compilation:
        compile the windowed-chunk attention for every budget-cut chunk length (first chunk and
        later ones; other lengths run the blocked op, `PagedKVPool.compiled_chunks`), then run
        one mixed step (a prompt's last chunk beside a decode, both with an output position:
        the eager path's kernels, which the captured decode graphs do not compile). The writes
        go to blocks that are free again afterwards."""
        if self.device.type == "cuda":
            if self.model.config.attention != "full":
                self._compile_chunks()
            self._warm_mixed_step()
            torch.cuda.synchronize(self.device)

    def _warm_forward(self, parts: list[tuple[int, int, bool]]) -> None:
        """One forward over fake sequences [(tokens, start, output)] in blocks freed afterwards
        (skipped if the pool has too few free); it chooses no fp8 scales."""
        need = [self.blocks.blocks_for(start + n) for n, start, _ in parts]
        if sum(need) > self.blocks.num_free:
            return
        tables = [self.blocks.allocate(k) for k in need]
        try:
            # eager: the graphs are captured from real steps (an fp8 pool's scales come later)
            self._eager_forward([Segment([0] * n, start, blocks, out) for (n, start, out), blocks in zip(parts, tables)])
        finally:
            for blocks in tables:
                self.blocks.release(BlockTable(blocks=blocks))
        if self.pool.fp8:  # the warm-up's tokens must not choose the scales
            self.pool.scaled = [False] * self.pool.num_layers
            self.pool.k_scale.fill_(1.0)
            self.pool.v_scale.fill_(1.0)

    def _compile_chunks(self) -> None:
        lengths = [n for n in self.chunk_lengths() if n >= 128]
        self.pool.compiled_chunks = frozenset(lengths)
        for n in lengths:
            for start in (0, self.model.config.window_size):
                self._warm_forward([(n, start, False)])

    def _warm_mixed_step(self) -> None:
        W = self.model.config.window_size or 16
        self._warm_forward([(W + 3, W, True), (1, W + 1, True)])

    # ------------------------------------------------------------- the loop
    def _loop(self) -> None:
        while not self._stop:
            if not self.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                self.step()
            except BaseException as e:  # noqa: BLE001 - the engine dies; requests are told
                self._die(e)
                return

    def _die(self, e: BaseException) -> None:
        self.error = e
        msg = f"the engine stopped: {type(e).__name__}: {e}"
        with self._lock:
            reqs = list(self.running) + list(self.waiting)
            self.running.clear()
            self.waiting.clear()
        for r in reqs:
            r.finished = True
            r.sink(TokenEvent(None, finish_reason="error", error=msg))
        if self.metrics:
            self.metrics.engine_dead()

    # ------------------------------------------------------------- one step
    @torch.inference_mode()
    def step(self) -> int:
        """Schedule and run one forward; returns the number of tokens it ran."""
        self._apply_aborts()
        segments, reqs = self._schedule()
        if self.metrics:
            self.metrics.on_schedule(self)
        if not segments:
            return 0
        t0 = time.perf_counter()
        logits = self._forward(segments)
        n_tokens = sum(len(s.tokens) for s in segments)
        now = time.perf_counter()
        greedy = logits.argmax(-1).tolist() if logits.shape[0] else []  # one device sync for all rows
        out_i = 0
        for seg, req in zip(segments, reqs):
            req.computed += len(seg.tokens)
            self.blocks.register_full(req.tokens, req.computed, req.table)
            if seg.output:
                self._emit(req, logits[out_i], greedy[out_i], now)
                out_i += 1
        self.steps += 1
        if self._step_log is not None:
            self._log_step(segments, reqs, t0)
        if self.metrics:
            self.metrics.on_step(self, n_tokens, len(segments), time.perf_counter() - t0)
        return n_tokens

    def _log_step(self, segments: list[Segment], reqs: list[Request], t0: float) -> None:
        """One line: decodes (one new token past the prompt) counted, prompt chunks as
        [tokens, start, has the output position]."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        dec = [len(s.tokens) == 1 and s.output and s.start >= len(r.prompt) for s, r in zip(segments, reqs)]
        rec = dict(step=self.steps, t=round(t0 - self._t_start, 6), ms=round((now - t0) * 1e3, 3), decode=sum(dec),
                   chunks=[[len(s.tokens), s.start, bool(s.output)] for s, d in zip(segments, dec) if not d],
                   graph=self._used_graph, running=len(self.running), waiting=len(self.waiting))
        self._step_log.write(json.dumps(rec) + "\n")

    def _forward(self, segments: list[Segment]) -> torch.Tensor:
        """The step's logits [N, V] at the segments' output positions, in their order.

        Decode-only steps replay a captured graph. A step mixing decodes and prompt chunks runs,
        where graphs are on (`EngineConfig.split_mixed_steps`), the decodes through their graph
        and the chunks in a second, eager forward: run eagerly, a decode row costs the whole
        model's per-layer kernel launches on the host (hundreds of small kernels for a few
        rows), which is what running streams would wait for beside every chunk."""
        self._used_graph = False
        if self.graphs is not None:
            dec = self._decodes(segments)
            decodes = [segments[i] for i in dec]
            if dec and (len(dec) == len(segments) or self.cfg.split_mixed_steps) and self.graphs.fits(decodes):
                picked = set(dec)
                rest = [s for i, s in enumerate(segments) if i not in picked]
                # the chunks' cache first: its host-to-device copies then run while the device is
                # idle, not queued behind the graph (a pageable copy holds the host until it is done)
                cache = PagedStepCache(self.pool, self.model.config, rest) if rest else None
                out = self.graphs.run(decodes)
                if out is not None:
                    self._used_graph = True
                    return out if cache is None else self._merge(segments, out, self._run(cache))
        return self._eager_forward(segments)

    @staticmethod
    def _decodes(segments: list[Segment]) -> list[int]:
        """Indices of the segments a decode graph can run: one token, an output position."""
        return [i for i, s in enumerate(segments) if len(s.tokens) == 1 and s.output]

    @staticmethod
    def _merge(segments: list[Segment], dec_logits: torch.Tensor, rest_logits: torch.Tensor) -> torch.Tensor:
        """Interleave the decodes' logits and the other segments' back into the segments' order."""
        dec = set(Engine._decodes(segments))
        order, d, r = [], 0, dec_logits.shape[0]
        for i, s in enumerate(segments):
            if i in dec:
                order.append(d)
                d += 1
            elif s.output:
                order.append(r)
                r += 1
        both = torch.cat([dec_logits, rest_logits])
        return both if order == list(range(len(order))) else both[torch.tensor(order, device=both.device)]

    def _eager_forward(self, segments: list[Segment]) -> torch.Tensor:
        return self._run(PagedStepCache(self.pool, self.model.config, segments))

    def _run(self, cache: PagedStepCache) -> torch.Tensor:
        m = self.model
        h = m.model(m.model.embed_tokens(cache.input_ids), cache.layout, cache)
        return m.lm_head(h)[0].float()

    def _apply_aborts(self) -> None:
        with self._lock:
            ids, self._aborts = self._aborts, set()
            if not ids:
                return
            gone = [r for r in self.waiting if r.id in ids]
            for r in gone:
                self.waiting.remove(r)
        gone += [r for r in self.running if r.id in ids]
        for r in gone:
            self._finish(r, "abort")

    def _finish(self, req: Request, reason: str, event: TokenEvent | None = None) -> None:
        req.finished = True
        if req in self.running:
            self.running.remove(req)
        self.blocks.release(req.table)
        ev = event or TokenEvent(None)
        ev.finish_reason = reason
        req.sink(ev)
        if self.metrics:
            self.metrics.on_finish(req, reason, time.perf_counter())

    def _grow(self, req: Request, tokens: int) -> bool:
        """Give `req` blocks for `tokens` tokens; False if the pool has too few free."""
        need = self.blocks.blocks_for(tokens) - len(req.table.blocks)
        if need <= 0:
            return True
        if need > self.blocks.num_free:
            return False
        req.table.blocks += self.blocks.allocate(need)
        return True

    def _preempt(self, req: Request) -> None:
        """Free a running request's blocks; it goes back to the head of the queue and is
        recomputed (prompt + generated tokens) when readmitted."""
        self.running.remove(req)
        self.blocks.release(req.table)
        req.computed = 0
        with self._lock:
            self.waiting.appendleft(req)
        if self.metrics:
            self.metrics.preemptions.inc()

    def _schedule(self) -> tuple[list[Segment], list[Request]]:
        budget = self.cfg.max_num_batched_tokens
        plan: list[tuple[Request, int]] = []
        # 1. decodes: one token left to run (a prompt whose rest came from the prefix cache too)
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running or len(req.tokens) - req.computed != 1:
                continue
            while not self._grow(req, len(req.tokens)):
                victim = self.running[-1]
                self._preempt(victim)
                if any(r is victim for r, _ in plan):
                    plan = [(r, n) for r, n in plan if r is not victim]
                    budget += 1
                if victim is req:
                    break
            if req in self.running:
                plan.append((req, 1))
                budget -= 1
        # 2. prompts being prefilled (their blocks were allocated at admission)
        for req in self.running:
            left = len(req.tokens) - req.computed
            if left > 1 and budget > 0:
                n = self._chunk(left, budget)
                plan.append((req, n))
                budget -= n
        # 3. admissions
        while budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            with self._lock:
                if not self.waiting:
                    break
                req = self.waiting[0]
            cached = self.blocks.match_prefix(req.tokens, req.table)
            if self.blocks.blocks_for(len(req.tokens)) - len(req.table.blocks) > self.blocks.num_free:
                self.blocks.release(req.table)  # wait for memory; FCFS: nobody overtakes
                break
            self._grow(req, len(req.tokens))
            with self._lock:
                self.waiting.popleft()
            req.computed = cached
            if req.num_output == 0:
                req.cached_tokens = cached
            self.running.append(req)
            n = self._chunk(len(req.tokens) - req.computed, budget)
            plan.append((req, n))
            budget -= n
            if self.metrics:
                self.metrics.on_admit(req, time.perf_counter())
        segments = [Segment(req.tokens[req.computed:req.computed + n], req.computed, req.table.blocks,
                            req.computed + n == len(req.tokens)) for req, n in plan]
        return segments, [req for req, _ in plan]

    def _chunk(self, left: int, budget: int) -> int:
        """Tokens of a prompt to run now: all that is left if the budget allows, else the budget
        rounded down (see `EngineConfig.chunk_align`), or the bare budget if that rounds to 0;
        the prompt's last token is left for a decode step (`EngineConfig.decode_last_prompt_token`)."""
        if left <= budget:
            return left - 1 if self.decode_last_token and left > 1 else left
        a = self.chunk_align
        if a > 1:
            a = max(a, (1 << (budget.bit_length() - 1)) // 4 // a * a)
        return budget // a * a or budget

    # ------------------------------------------------------------ sampling
    def _emit(self, req: Request, logits: torch.Tensor, greedy: int, now: float) -> None:
        """Sample the next token of `req` from logits [V] (`greedy`: their argmax), send it,
        finish the request if it is done."""
        p = req.params
        if p.temperature == 0:
            tok = greedy
        else:
            tok = int(sample(logits[None], SamplingConfig(p.temperature, p.top_k, p.top_p), req.generator)[0])
        ev = TokenEvent(tok)
        if p.logprobs is not None:
            lp = torch.log_softmax(logits, -1)
            ev.logprob = float(lp[tok])
            if p.logprobs:
                top = torch.topk(lp, p.logprobs)
                ev.top_logprobs = list(zip(top.indices.tolist(), top.values.tolist()))
        req.tokens.append(tok)
        if self.metrics:
            self.metrics.on_token(req, now)
        if req.first_token_at is None:
            req.first_token_at = now
        req.last_token_at = now
        n = req.num_output
        stop = n >= p.min_tokens and (tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos))
        if stop:
            self._finish(req, "stop", ev)
        elif n >= p.max_tokens:
            self._finish(req, "length", ev)
        else:
            req.sink(ev)
