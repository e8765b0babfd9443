"""The scheduler: which tokens of which requests one engine step runs.

It holds the waiting queue and the running requests, and gives them KV blocks
from a `kv_blocks.BlockPool`; it knows nothing of the model or the device.
A step is scheduled under a token budget (`max_num_batched_tokens`), as vLLM
does:

    1. running decodes, one token each (a new block when one fills; if none
       is free, the newest running request is preempted: its blocks are
       released and it is recomputed later, mostly from the prefix cache);
    2. running prompts not fully prefilled: their next chunk;
    3. waiting requests, first come first served, admitted while blocks for
       their whole prompt are free (after reusing cached prefix blocks) and
       fewer than `max_num_seqs` run: their first chunk.

With `chunk_align` > 1, a chunk cut by the budget is a multiple of it: the compiled attention
kernels are specialised to a chunk's length (and key count, `ops.paged_read.compiled_shape`), so
few lengths mean few kernels, all built by the warm-up. A chunk that
shares its step with decodes only is cut at that grain (the budget less a few decodes: 8,191 tokens
become 8,064), so the lengths the warm-up compiles are the budget and one or two below it; a chunk
beside another prompt's chunk is cut coarser, to a multiple of a quarter of the rest's power of two
(those rests vary with the other prompt's length, and coarse cuts keep their lengths few). When what
is left of the budget rounds down to nothing, a prompt gets that bare remainder only if no other
prompt chunk runs in the step (so the first prompt always progresses); otherwise it waits a
step. (A 1-token first chunk, left over beside another prompt's last chunk, used to start every
later chunk of a 128K prompt one token past alignment.)

A chunk whose end is not the end of its token list has no output position
(base stream only); the others have one, at their last token, whose logits
give the next token. A decode is the one-token case of the same rule.

`add` and `abort` are safe from any thread; everything else runs in the
engine's thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from .kv_blocks import BlockPool
from .request import QueueFull, Request


def check_limits(max_num_batched_tokens: int, max_num_seqs: int, max_queue: int) -> None:
    if max_num_batched_tokens < 1 or max_num_seqs < 1 or max_queue < 0:
        raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1, max_queue >= 0")


@dataclass
class ScheduledChunk:
    """`tokens` of `req` from position `start` (its `computed` when scheduled) run this step;
    `output`: the chunk ends the request's token list, so its last token's logits are wanted."""

    req: Request
    tokens: list[int]
    start: int
    output: bool


class Scheduler:
    def __init__(self, blocks: BlockPool, max_num_batched_tokens: int, max_num_seqs: int, max_queue: int,
                 chunk_align: int = 1, decode_last_token: bool = False, metrics=None):
        """chunk_align: see `EngineConfig.chunk_align` (resolved: 1 is no rounding);
        decode_last_token: see `EngineConfig.decode_last_prompt_token` (resolved)."""
        check_limits(max_num_batched_tokens, max_num_seqs, max_queue)
        self.blocks = blocks
        self.budget, self.max_num_seqs, self.max_queue = max_num_batched_tokens, max_num_seqs, max_queue
        self.chunk_align, self.decode_last_token = chunk_align, decode_last_token
        self.metrics = metrics
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._aborts: set[int] = set()
        self._lock = threading.Lock()  # guards `waiting` and `_aborts` against other threads

    # ------------------------------------------------------- from any thread
    def add(self, req: Request) -> None:
        """Queue `req` (QueueFull at the bound)."""
        with self._lock:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"the queue holds {self.max_queue} waiting requests")
            self.waiting.append(req)

    def abort(self, request_id: int) -> None:
        """Mark a request to be dropped; `pop_aborted` hands it over at the next step."""
        with self._lock:
            self._aborts.add(request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborts)

    # ---------------------------------------------------- the engine thread
    def pop_aborted(self) -> list[Request]:
        """The requests marked by `abort` (waiting ones taken off the queue, then running ones);
        the caller ends each with `finish`."""
        with self._lock:
            ids, self._aborts = self._aborts, set()
            if not ids:
                return []
            gone = [r for r in self.waiting if r.id in ids]
            for r in gone:
                self.waiting.remove(r)
        return gone + [r for r in self.running if r.id in ids]

    def finish(self, req: Request) -> None:
        """`req` is done: it leaves the running list and its blocks go back to the pool."""
        req.finished = True
        if req in self.running:
            self.running.remove(req)
        self.blocks.release(req.table)

    def drain(self) -> list[Request]:
        """Every request, running then waiting, taken out (the engine died)."""
        with self._lock:
            reqs = list(self.running) + list(self.waiting)
            self.running.clear()
            self.waiting.clear()
        return reqs

    def advance(self, chunk: ScheduledChunk) -> None:
        """After the step's forward: the chunk's K/V are in the cache; its full blocks join the
        prefix cache."""
        req = chunk.req
        req.computed += len(chunk.tokens)
        self.blocks.register_full(req.tokens, req.computed, req.table)

    def grow(self, req: Request, tokens: int) -> bool:
        """Give `req` blocks for `tokens` tokens; False if the pool has too few free."""
        need = self.blocks.blocks_for(tokens) - len(req.table.blocks)
        if need <= 0:
            return True
        if need > self.blocks.num_free:
            return False
        req.table.blocks += self.blocks.allocate(need)
        return True

    def preempt(self, req: Request) -> None:
        """Free a running request's blocks; it goes back to the head of the queue and is
        recomputed (prompt + generated tokens) when readmitted."""
        self.running.remove(req)
        self.blocks.release(req.table)
        req.computed = 0
        with self._lock:
            self.waiting.appendleft(req)
        if self.metrics:
            self.metrics.preemptions.inc()

    def schedule(self) -> list[ScheduledChunk]:
        """This step's chunks: decodes, then prompt chunks, then admissions (see the module)."""
        budget = self.budget
        plan: list[tuple[Request, int]] = []
        # 1. decodes: one token left to run (a prompt whose rest came from the prefix cache too)
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running or len(req.tokens) - req.computed != 1:
                continue
            while not self.grow(req, len(req.tokens)):
                victim = self.running[-1]
                self.preempt(victim)
                if any(r is victim for r, _ in plan):
                    plan = [(r, n) for r, n in plan if r is not victim]
                    budget += 1
                if victim is req:
                    break
            if req in self.running:
                plan.append((req, 1))
                budget -= 1
        # 2. prompts being prefilled (their blocks were allocated at admission)
        prompts = 0  # prompt chunks planned so far
        for req in self.running:
            left = len(req.tokens) - req.computed
            if left > 1 and budget > 0:
                n = self.chunk(left, budget, alone=not prompts)
                if n:
                    plan.append((req, n))
                    budget -= n
                    prompts += 1
        # 3. admissions
        while budget > 0 and len(self.running) < self.max_num_seqs:
            with self._lock:
                if not self.waiting:
                    break
                req = self.waiting[0]
            cached = self.blocks.match_prefix(req.tokens, req.table)
            n = self.chunk(len(req.tokens) - cached, budget, alone=not prompts)
            if not n or self.blocks.blocks_for(len(req.tokens)) - len(req.table.blocks) > self.blocks.num_free:
                self.blocks.release(req.table)  # wait for budget or memory; FCFS: nobody overtakes
                break
            self.grow(req, len(req.tokens))
            with self._lock:
                self.waiting.popleft()
            req.computed = cached
            if req.num_output == 0:
                req.cached_tokens = cached
            self.running.append(req)
            plan.append((req, n))
            budget -= n
            prompts += 1
            if self.metrics:
                self.metrics.on_admit(req, time.perf_counter())
        if self.blocks.twins is not None:  # a low-bit pool: the bf16 twins the running requests read or write
            new = {id(r): n for r, n in plan}
            self.blocks.twins.retain(b for r in self.running
                                     for b in self.blocks.twins.needed(r.table.blocks, r.computed, new.get(id(r), 0)))
        return [ScheduledChunk(req, req.tokens[req.computed:req.computed + n], req.computed,
                               req.computed + n == len(req.tokens)) for req, n in plan]

    # ---------------------------------------------------------- chunk sizes
    def chunk(self, left: int, budget: int, alone: bool = True) -> int:
        """Tokens of a prompt to run now: all that is left if the budget allows, else the budget
        rounded down (to `chunk_align` when the prompt is the step's only one, `alone`: only
        decodes took the rest; beside another prompt's chunk, to a quarter of the budget's power of
        two too), or, if that rounds to 0, the bare budget when `alone` and 0 (wait a step) when
        not; the prompt's last token is left for a decode step (`EngineConfig.decode_last_prompt_token`)."""
        if left <= budget:
            return left - 1 if self.decode_last_token and left > 1 else left
        a = self.chunk_align
        if a > 1 and not alone:
            a = max(a, (1 << (budget.bit_length() - 1)) // 4 // a * a)
        return budget // a * a or (budget if alone else 0)

    def chunk_lengths(self) -> list[int]:
        """The lengths a prompt chunk cut by the token budget can have (whatever the running
        decodes leave of the budget); a prompt's last chunk is whatever remains."""
        budget, n = self.budget, self.max_num_seqs
        return sorted({self.chunk(budget + 1, b) for b in range(max(1, budget - n), budget + 1)})
