"""The scheduler alone, no model: token budgets, chunked prefill, admission, preemption, prefix
hits and the queue bound, step by step over host-side requests (a forward is simulated by
`_ran`: the chunks' K/V are in the cache, and each output position makes one new token)."""

import pytest

from orthros.serve.kv_blocks import BlockPool
from orthros.serve.request import QueueFull, Request, SamplingParams
from orthros.serve.scheduler import Scheduler


def _req(i, prompt):
    return Request(i, list(prompt), SamplingParams(), lambda ev: None, tokens=list(prompt))


def _scheduler(num_blocks=32, block_size=4, budget=8, max_num_seqs=8, max_queue=8, prefix_caching=True, **kw):
    return Scheduler(BlockPool(num_blocks, block_size, prefix_caching), budget, max_num_seqs, max_queue, **kw)


def _ran(s, chunks, token=7):
    for c in chunks:
        s.advance(c)
        if c.output:
            c.req.tokens.append(token)


def _plan(chunks):
    """[(request id, tokens, start, output)]"""
    return [(c.req.id, len(c.tokens), c.start, c.output) for c in chunks]


def _steps(s, n, budget=None):
    """The plans of `n` steps, each run (`_ran`) before the next; each within `budget` if given."""
    plans = []
    for _ in range(n):
        step = s.schedule()
        plans.append(_plan(step))
        assert budget is None or sum(len(ch.tokens) for ch in step) <= budget
        _ran(s, step)
    return plans


class _Metrics:
    def __init__(self):
        self.admitted = []

        class Counter:
            n = 0

            def inc(self):
                self.n += 1

        self.preemptions = Counter()

    def on_admit(self, req, now):
        self.admitted.append(req.id)


def test_budget_decodes_first_then_prompt_chunks_then_admissions():
    s = _scheduler(budget=8)
    a, b, c = _req(0, range(5)), _req(1, range(100, 120)), _req(2, range(200, 206))
    s.add(a)
    step = s.schedule()
    assert _plan(step) == [(0, 5, 0, True)]  # the whole prompt fits: one chunk with the output position
    _ran(s, step)
    s.add(b)
    s.add(c)
    assert _steps(s, 3, budget=8) == [
        [(0, 1, 5, True), (1, 7, 0, False)],  # a's decode, then b's first chunk: the rest of the budget
        [(0, 1, 6, True), (1, 7, 7, False)],  # c waits: no budget left for it
        [(0, 1, 7, True), (1, 6, 14, True), (2, 1, 0, False)],  # b's last chunk; c admitted with 1 token
    ]
    assert s.running == [a, b, c] and not s.waiting


def test_chunks_cut_by_the_budget_are_aligned_and_their_lengths_enumerated():
    s = _scheduler(chunk_align=128)
    cases = ((10000, 8192), (10000, 8191), (100, 8191), (1000, 300), (1000, 100), (10000, 2044))
    # beside decodes only: the budget they leave, to 128 (8,191 tokens run 8,064, not 7,168)
    assert [s.chunk(left, budget) for left, budget in cases] == [8192, 8064, 100, 256, 100, 1920]
    # beside another prompt's chunk: coarser, to a quarter of the rest's power of two
    assert [s.chunk(left, budget, alone=False) for left, budget in cases] == [8192, 7168, 100, 256, 0, 1792]
    s = _scheduler(budget=300, max_num_seqs=8, chunk_align=128)
    assert s.chunk_lengths() == [256]  # whatever 0..8 decodes leave of 300 tokens
    # the warm-up's lengths: the budget, and what up to 64 / 200 decodes leave of it
    assert _scheduler(budget=8192, max_num_seqs=64, chunk_align=128).chunk_lengths() == [8064, 8192]
    assert _scheduler(budget=8192, max_num_seqs=200, chunk_align=128).chunk_lengths() == [7936, 8064, 8192]
    assert _scheduler(budget=9, max_num_seqs=2).chunk_lengths() == [7, 8, 9]  # no alignment: every length


def test_a_long_prompt_beside_a_decode_runs_in_as_few_steps_as_the_grain_allows():
    """The paper setting in small: request a decodes while b, 16 budgets long, prefills. Each of b's
    chunks is the budget less a's token, rounded to 16 (496 of 512): b needs 17 chunk steps (the
    quarter-power rounding, 448 a step, took 19), and never more tokens than the budget."""
    s = _scheduler(num_blocks=3000, budget=512, max_num_seqs=4, chunk_align=16, decode_last_token=True)
    s.add(_req(0, range(5)))
    _steps(s, 2)  # a's prompt, then its last token: a decodes from here on
    s.add(_req(1, range(1000, 1000 + 16 * 512)))  # (no prefix shared with a's prompt)
    plans = _steps(s, 17, budget=512)
    assert all(p[0][:2] == (0, 1) for p in plans)  # a's decode in every step
    assert [p[1][1] for p in plans] == [496] * 16 + [16 * 512 - 16 * 496 - 1]  # b's chunks; its last token next
    assert plans[-1][1][2] + plans[-1][1][1] == 16 * 512 - 1


def test_decode_last_prompt_token_leaves_the_last_token_to_a_decode():
    s = _scheduler(budget=8, decode_last_token=True)
    s.add(_req(0, range(5)))
    first = s.schedule()
    assert _plan(first) == [(0, 4, 0, False)]  # no output position in a prompt chunk
    _ran(s, first)
    assert _plan(s.schedule()) == [(0, 1, 4, True)]  # the last prompt token, as a decode
    assert s.chunk(1, 8) == 1 and s.chunk(20, 8) == 8  # a one-token prompt; a cut chunk is not shortened


def test_a_decode_without_a_free_block_preempts_the_newest_request():
    metrics = _Metrics()
    s = _scheduler(num_blocks=4, budget=16, prefix_caching=False, metrics=metrics)
    a, b = _req(0, range(8)), _req(1, range(50, 58))
    s.add(a)
    s.add(b)
    step = s.schedule()
    assert _plan(step) == [(0, 8, 0, True), (1, 8, 0, True)] and s.blocks.num_free == 0
    _ran(s, step)  # 9 tokens each: both decodes need a third block
    step = s.schedule()
    assert _plan(step) == [(0, 1, 8, True)]  # b gave its blocks to a's decode
    assert s.running == [a] and list(s.waiting) == [b] and metrics.preemptions.n == 1
    assert b.computed == 0 and not b.table.blocks and len(a.table.blocks) == 3
    _ran(s, step)
    assert _plan(s.schedule()) == [(0, 1, 9, True)]  # b cannot come back yet (3 blocks, 1 free)
    s.finish(a)
    step = s.schedule()
    assert _plan(step) == [(1, 9, 0, True)]  # recomputed: the prompt and its generated token
    assert metrics.admitted == [0, 1, 1]


def test_the_newest_request_preempts_itself_when_its_decode_needs_a_block():
    s = _scheduler(num_blocks=5, budget=32, prefix_caching=False)
    a, b = _req(0, range(11)), _req(1, range(50, 58))  # 3 + 2 blocks: the pool is full
    s.add(a)
    s.add(b)
    _ran(s, s.schedule())  # a: 12 tokens, its blocks hold them; b: 9 tokens, a third block needed
    step = s.schedule()
    assert _plan(step) == [(0, 1, 11, True)] and s.running == [a] and list(s.waiting) == [b]
    assert s.blocks.num_free == 2 and b.computed == 0  # b waits for its 3 blocks


def test_prefix_hits_skip_the_cached_blocks_and_leave_one_token_to_compute():
    s = _scheduler(budget=64)
    shared = list(range(10, 18))  # two full blocks
    a = _req(0, shared + [1, 2])
    s.add(a)
    _ran(s, s.schedule())
    b, c = _req(1, shared + [3, 4, 5]), _req(2, shared)
    s.add(b)
    s.add(c)
    step = s.schedule()
    assert _plan(step)[1:] == [(1, 3, 8, True), (2, 4, 4, True)]  # c: its last block is recomputed
    assert b.cached_tokens == 8 and c.cached_tokens == 4
    assert b.table.blocks[:2] == a.table.blocks[:2] and c.table.blocks[0] == a.table.blocks[0]
    assert s.blocks.blocks[a.table.blocks[0]].ref == 3
    s2 = _scheduler(budget=64, prefix_caching=False)
    for r in (_req(0, shared + [1, 2]), _req(1, shared + [3, 4, 5])):
        s2.add(r)
        _ran(s2, s2.schedule())
    assert r.cached_tokens == 0 and r.computed == 11  # no cache: the whole prompt ran


def test_queue_bound_and_seat_limit():
    s = _scheduler(budget=64, max_num_seqs=2, max_queue=2)
    a, b = _req(0, range(5)), _req(1, range(10, 15))
    s.add(a)
    s.add(b)
    with pytest.raises(QueueFull):
        s.add(_req(2, range(3)))
    _ran(s, s.schedule())
    assert s.running == [a, b] and not s.waiting
    late, later = _req(3, range(30, 34)), _req(4, range(40, 42))
    s.add(late)
    s.add(later)  # the queue has room again
    step = s.schedule()
    assert _plan(step) == [(0, 1, 5, True), (1, 1, 5, True)] and list(s.waiting) == [late, later]  # no seat
    _ran(s, step)
    s.finish(b)
    assert _plan(s.schedule()) == [(0, 1, 6, True), (3, 4, 0, True)] and list(s.waiting) == [later]


def test_admission_waits_for_memory_first_come_first_served():
    s = _scheduler(num_blocks=6, budget=64)
    s.add(_req(0, range(8)))
    _ran(s, s.schedule())
    tall = _req(1, range(100, 124))  # 6 blocks: the whole pool
    s.add(tall)
    s.add(_req(2, range(200, 202)))  # one block would be free for it
    assert _plan(s.schedule()) == [(0, 1, 8, True)]  # tall waits for memory, and nobody overtakes it
    assert [r.id for r in s.waiting] == [1, 2] and not tall.table.blocks and s.blocks.num_used == 3


def test_aborts_take_requests_off_the_queue_and_the_running_list():
    s = _scheduler(budget=8, max_num_seqs=1)
    a, b = _req(0, range(6)), _req(1, range(6))
    s.add(a)
    s.add(b)
    _ran(s, s.schedule())
    assert s.blocks.num_used == 2
    s.abort(1)
    s.abort(0)
    gone = s.pop_aborted()
    assert gone == [b, a] and not s.waiting and s.has_work()  # a is still running until finished
    for r in gone:
        s.finish(r)
    assert not s.has_work() and s.blocks.num_used == 0 and a.finished and s.pop_aborted() == []


def test_a_prompt_beside_another_s_last_chunk_waits_for_an_aligned_first_chunk():
    # A's last chunk leaves 1 token of the budget: B is not admitted with a 1-token chunk (which
    # would start every later chunk of B one token past the alignment) but a step later
    s = _scheduler(budget=8, chunk_align=4, decode_last_token=True)
    a, b = _req(0, range(16)), _req(1, range(100, 116))
    s.add(a)
    s.add(b)
    plans = _steps(s, 6)
    assert plans[:3] == [
        [(0, 8, 0, False)],
        [(0, 7, 8, False)],  # A's last chunk; its last token is left to a decode; B waits
        [(0, 1, 15, True), (1, 4, 0, False)],  # B's first chunk: what is left, aligned
    ]
    starts = [start for plan in plans for rid, n, start, out in plan if rid == 1]
    assert starts == [0, 4, 8, 12] and all(x % 4 == 0 for x in starts)


def test_a_lone_prompt_takes_the_bare_rest_of_the_budget():
    # running decodes leave 3 tokens of an 8-token budget each step: with no other prompt chunk in
    # the step, the prompt runs 3 tokens a step rather than waiting for an aligned 4 that never comes
    s = _scheduler(budget=8, chunk_align=4, max_num_seqs=8)
    short = [_req(i, [i]) for i in range(5)]
    for r in short:
        s.add(r)
    _ran(s, s.schedule())  # the five 1-token prompts: one chunk each, each with its output position
    long = _req(9, range(100, 120))
    s.add(long)
    for _ in range(3):
        step = s.schedule()
        assert [(rid, n, start) for rid, n, start, _ in _plan(step) if rid == 9] == [(9, 3, long.computed)]
        _ran(s, step)
