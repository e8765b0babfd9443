"""The engine: continuous batching with chunked prefill over a paged KV cache.

It wires three parts and runs them in a thread, as nano-vllm and vLLM v1 do:

    scheduler.py  which tokens of which requests a step runs (token budget,
                  chunked prefill, admission, preemption, the prefix cache)
    runner.py     the model, its KV pool, the decode graphs and the warm-up:
                  one forward per step over the scheduled segments
    sampling.py   the next token from a request's logits, and when it stops

The engine runs in a background thread (`start`); `submit` / `abort` are
safe from any thread, and each request's events go to its `sink` callable
(called from the engine thread). If a step raises, the engine is dead:
every request gets an error event, `alive` turns False, and `error` holds
the exception.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Callable

import torch

from ..models.paged_cache import Segment
from .config import EngineConfig
from .kv_blocks import BlockPool
from .request import EngineDead, QueueFull, Request, SamplingParams, TokenEvent
from .runner import ModelRunner
from .sampling import GrammarMasks, finish_reason, greedy_choices, new_generator, sample_event
from .scheduler import ScheduledChunk, Scheduler, check_limits
from .step_log import StepLog

# the request types lived here first: importable from here still
__all__ = ["Engine", "EngineConfig", "EngineDead", "QueueFull", "Request", "SamplingParams", "TokenEvent"]


class Engine:
    def __init__(self, model, config: EngineConfig | None = None, eos_token_ids=(), metrics=None):
        self.cfg = cfg = config or EngineConfig()
        limit = cfg.max_model_len if cfg.max_model_len is not None else model.config.max_position_embeddings
        if not (limit == "auto" or (isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1)):
            raise ValueError(f"max_model_len must be a positive number of tokens or 'auto', got {limit!r}")
        check_limits(cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_queue)
        self.runner = runner = ModelRunner(model, cfg, limit)
        self.max_model_len = runner.max_model_len
        self.model, self.device, self.dtype = runner.model, runner.device, runner.dtype
        self.blocks = BlockPool(runner.num_blocks, cfg.block_size, cfg.prefix_caching, twins=runner.twins)
        last = cfg.decode_last_prompt_token
        self.scheduler = Scheduler(self.blocks, cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_queue,
                                   chunk_align=cfg.chunk_align or (128 if self.device.type == "cuda" else 1),
                                   decode_last_token=runner.graphs is not None if last is None else last,
                                   metrics=metrics)
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.masks = GrammarMasks(model.config.vocab_size, self.device)
        self.metrics = metrics
        if metrics:
            metrics.on_start(self)
        self._wake = threading.Event()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.error: BaseException | None = None
        self.steps = 0
        self._t_start = time.perf_counter()
        self._step_log = StepLog(cfg.step_log, self.device, self._t_start) if cfg.step_log else None
        # CUDA: the ends of the last steps queued. A step that reads no token back returns once its
        # forward is queued, so the host prepares the next step while the device runs it; it waits
        # before queuing a step two ahead of the one the device runs (`_queue_ahead`).
        self._queued = collections.deque() if self.device.type == "cuda" else None

    # the parts' state, read by metrics, the CLI and tests
    pool = property(lambda self: self.runner.pool)
    scratch_block = property(lambda self: self.runner.scratch_block)
    graphs = property(lambda self: self.runner.graphs)
    waiting = property(lambda self: self.scheduler.waiting)
    running = property(lambda self: self.scheduler.running)
    chunk_align = property(lambda self: self.scheduler.chunk_align)
    decode_last_token = property(lambda self: self.scheduler.decode_last_token)

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
        if prompt and (min(prompt) < 0 or max(prompt) >= vocab):  # C loops: a 128K prompt in ~3 ms
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if any(t >= vocab for t in params.logit_bias or ()):
            raise ValueError(f"logit_bias token ids must lie in [0, {vocab})")
        self.check(len(prompt), params.max_tokens)
        if not self.alive:
            raise EngineDead(str(self.error) if self.error else "the engine is stopped")
        req = Request(next(self._ids), list(prompt), params, sink, tokens=list(prompt), arrival=time.perf_counter())
        req.generator = new_generator(params, self.device)
        if params.guide is not None:
            req.matcher = params.guide.matcher()
        self.scheduler.add(req)
        self._wake.set()
        return req

    def abort(self, request_id: int) -> None:
        self.scheduler.abort(request_id)
        self._wake.set()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def start(self) -> None:
        with torch.inference_mode():
            self.warm_up()
            self.runner.capture_graphs()
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
        """See `Scheduler.chunk_lengths`."""
        return self.scheduler.chunk_lengths()

    def warm_up(self) -> None:
        """See `ModelRunner.warm_up`: compilations done before serving (on CUDA)."""
        self.runner.warm_up(self.blocks, self.scheduler.chunk_lengths())

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
        for r in self.scheduler.drain():
            r.finished = True
            r.sink(TokenEvent(None, finish_reason="error", error=msg))
        if self.metrics:
            self.metrics.engine_dead()

    # ------------------------------------------------------------- one step
    @torch.inference_mode()
    def step(self) -> int:
        """Schedule and run one forward; returns the number of tokens it ran."""
        for r in self.scheduler.pop_aborted():
            self._finish(r, "abort")
        self._queue_ahead()
        chunks = self.scheduler.schedule()
        if not chunks:
            if self._step_log is not None:
                self._step_log.flush(wait=True)  # idle: the last steps' lines
            return 0
        t0 = time.perf_counter()
        mark = self._step_log.begin() if self._step_log is not None else None
        self.runner.sync_twins()
        parts = self.runner.forward_parts([Segment(c.tokens, c.start, c.req.table.blocks, c.output) for c in chunks])
        n_tokens = sum(len(c.tokens) for c in chunks)
        # Each part's rows are chosen in one device sync (the constrained rows' grammar masks filled
        # on the host before it, while the device runs the forward). A mixed step's first part is
        # its decodes' graph: their tokens whose choice needs no device are sent before the
        # chunks' forward is launched, so a stream's token (and the first token of a prompt whose
        # last token runs as a decode) does not wait for another prompt's chunk.
        first = next(parts)
        choice = self._choose(chunks, *first)
        rest = self._deliver(chunks, *first, choice, host_only=True)
        second = next(parts, None)  # a split step: the chunks' forward, launched now
        self._deliver(chunks, *first, choice, rows=rest)
        if second is not None:
            self._deliver(chunks, *second, self._choose(chunks, *second))
        for c in chunks:
            if not c.output:  # (the output chunks advanced as their tokens were sent)
                self.scheduler.advance(c)
        self.steps += 1
        if self._queued is not None:
            self._queued.append(torch.cuda.Event())
            self._queued[-1].record()
        if self._step_log is not None:
            self._log_step(chunks, mark)
        if self.metrics:
            self.metrics.on_step(self, n_tokens, len(chunks), time.perf_counter() - t0)
        return n_tokens

    def _queue_ahead(self) -> None:
        """Wait (polling, without a device synchronization) until at most one step is queued behind
        the one the device runs: the host schedules no further ahead than the step it prepares."""
        q = self._queued
        while q and q[0].query():
            q.popleft()
        while q is not None and len(q) >= 2:
            if q[0].query():
                q.popleft()
            else:
                time.sleep(2e-4)

    def _choose(self, chunks: list[ScheduledChunk], idx: list[int], logits: torch.Tensor) -> tuple:
        """`greedy_choices` of the output chunks `chunks[idx[j]]` from their logits [len(idx), V]."""
        return greedy_choices(logits, [chunks[i].req.matcher for i in idx], self.masks)

    def _deliver(self, chunks: list[ScheduledChunk], idx: list[int], logits: torch.Tensor, choice: tuple,
                 host_only: bool = False, rows: list[int] | None = None) -> list[int]:
        """Advance the output chunks `chunks[idx[j]]` for j in `rows` (default all) and send their
        tokens from `logits[j]` and `choice` (`greedy_choices`'); `host_only`: only the rows whose
        choice needs no device work (greedy, no penalties, no log-probabilities). Returns the rows
        left."""
        greedy, masked = choice
        now = time.perf_counter()
        left = []
        for j in range(len(idx)) if rows is None else rows:
            c = chunks[idx[j]]
            if host_only and not c.req.params.host_choice:
                left.append(j)
                continue
            self.scheduler.advance(c)
            self._emit(c.req, logits[j], greedy[j], now, masked.get(j))
        return left

    def _log_step(self, chunks: list[ScheduledChunk], mark) -> None:
        """One line (`serve.step_log`, which adds the step's time): decodes (one new token past the
        prompt) counted, prompt chunks as [tokens, start, has the output position] and their requests'
        ids (`prompts`), and the ids of the requests whose first token the step sent (`first`)."""
        prompt = [c for c in chunks if not (len(c.tokens) == 1 and c.output and c.start >= len(c.req.prompt))]
        rec = dict(step=self.steps, decode=len(chunks) - len(prompt),
                   chunks=[[len(c.tokens), c.start, bool(c.output)] for c in prompt],
                   prompts=[c.req.id for c in prompt],
                   first=[c.req.id for c in chunks if c.output and c.req.num_output == 1],
                   graph=self.runner.used_graph, running=len(self.running), waiting=len(self.waiting))
        self._step_log.end(rec, mark)

    def _finish(self, req: Request, reason: str, event: TokenEvent | None = None) -> None:
        self.scheduler.finish(req)
        ev = event or TokenEvent(None)
        ev.finish_reason = reason
        req.sink(ev)
        if self.metrics:
            self.metrics.on_finish(req, reason, time.perf_counter())

    def _emit(self, req: Request, logits: torch.Tensor, greedy: int, now: float,
              masked: torch.Tensor | None = None) -> None:
        """Sample the next token of `req` from logits [V] (`greedy`: their argmax; a constrained
        request's: those of `masked`, its logits under its grammar's mask), send it, finish the
        request if it is done."""
        output = req.tokens[len(req.prompt):] if req.params.shapes_logits else ()  # penalties only
        ev = sample_event(logits, greedy, req.params, req.generator, output, masked=masked)
        req.tokens.append(ev.token_id)
        if req.matcher is not None and not req.matcher.consume_token(ev.token_id):
            # only where llguidance gave up (a resource limit): nothing was allowed
            why = (req.matcher.get_error() or "the grammar allowed no token").splitlines()[0]
            ev.error = f"structured output failed: {why}"
            self._finish(req, "error", ev)
            return
        if self.metrics:
            self.metrics.on_token(req, now)
        if req.first_token_at is None:
            req.first_token_at = now
        req.last_token_at = now
        reason = finish_reason(req.params, ev.token_id, req.num_output, self.eos, req.matcher)
        if reason is None:
            req.sink(ev)
        else:
            self._finish(req, reason, ev)
