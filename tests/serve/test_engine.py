"""The engine under batching: greedy outputs of requests served concurrently (different lengths,
staggered arrivals, shared prefixes, cancellations, preemption for memory) equal
`orthros.generate.generate` on each prompt alone, for Orthros and the full / SWA baselines
(and Orthros with a sparse MLP in each output routing mode)."""

import random

import pytest
import torch

from orthros.generate import generate
from orthros.serve.engine import Engine, EngineConfig, QueueFull, SamplingParams

from ..conftest import DEVICE, make_model, rel_err
from .conftest import decode_graphs, decoding_engine


def _workload(seed=0):
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(21)]
    prompts = [shared + [rng.randrange(256) for _ in range(rng.randrange(0, 25))] for _ in range(4)]
    prompts += [[rng.randrange(256) for _ in range(rng.randrange(1, 45))] for _ in range(4)]
    return prompts, [rng.randrange(1, 10) for _ in prompts]


class Collector:
    def __init__(self):
        self.events = {}

    def sink(self, key):
        return lambda ev: self.events.setdefault(key, []).append(ev)

    def tokens(self, key):
        return [e.token_id for e in self.events.get(key, []) if e.token_id is not None]

    def reason(self, key):
        return self.events[key][-1].finish_reason


@pytest.mark.parametrize("attention, routing", [("orthros", None), ("full", None), ("swa", None),
                                                  ("orthros", "sinks"), ("swa", "sinks"),
                                                  ("orthros", "independent"), ("orthros", "bound"),
                                                  ("orthros", "base")])
def test_concurrent_greedy_equals_alone(attention, routing):
    """routing: None for the dense tiny model, "sinks" for it with attention sinks, else the MoE one
    with that `output_routing` (packed decode-only steps pair each output row with its base row)."""
    moe = {} if routing in (None, "sinks") else dict(base="tiny-moe", output_routing=routing)
    if routing == "sinks":
        moe = dict(sink_tokens=3)
    model = make_model(attention, window=6, initializer_range=0.3, **moe)
    prompts, max_tokens = _workload()
    eng = Engine(model, EngineConfig(block_size=4, num_blocks=48, max_num_batched_tokens=13, max_num_seqs=6,
                                     chunk_align=4))
    out = Collector()
    reqs = {}
    cancel = {2, 6}
    for step in range(400):
        if step % 2 == 0 and step // 2 < len(prompts):  # one arrival every other step
            i = step // 2
            reqs[i] = eng.submit(prompts[i], SamplingParams(max_tokens=max_tokens[i] + 6 * (i in cancel)),
                                 out.sink(i))
        for i in cancel:  # cancelled after their first token
            if i in reqs and out.tokens(i) and not reqs[i].finished:
                eng.abort(reqs[i].id)
        if not eng.has_work() and len(reqs) == len(prompts):
            break
        eng.step()
    assert not eng.has_work() and eng.blocks.num_used == 0
    assert eng.blocks.hit_tokens > 0  # the shared prefix was reused
    for i, p in enumerate(prompts):
        got = out.tokens(i)
        if i in cancel:
            assert out.reason(i) == "abort" and 1 <= len(got) < max_tokens[i] + 6
        else:
            assert out.reason(i) == "length" and len(got) == max_tokens[i]
        ref = generate(model, [p], max_new_tokens=len(got))[0, len(p):].tolist()
        assert got == ref, (i, got, ref)


def _order_sink(eng, out: Collector, order: list):
    """sink(i) for `Engine.submit`: collects into `out`, and appends (step, "token", i) to `order`
    as each token goes out."""

    def sink(i):
        keep = out.sink(i)
        return lambda ev: (order.append((eng.steps, "token", i)) if ev.token_id is not None else None, keep(ev))

    return sink


class _EagerGraphs:
    """Stands in for `serve.graphs.DecodeGraphs` on CPU: runs the decodes it is given eagerly
    (their own forward) and counts the steps it saw mixed with prompt chunks."""

    def __init__(self, runner):
        self.runner, self.calls = runner, []

    def fits(self, segments):
        return True

    def run(self, segments):
        self.calls.append(len(segments))
        return self.runner.eager_forward(segments)


@pytest.mark.parametrize("attention", ["orthros", "full"])
def test_mixed_steps_split_into_decodes_and_chunks_equal_alone(attention):
    """With graphs on, a step mixing decodes and prompt chunks is two forwards (the decodes', the
    chunks'), whose logits go back to the segments' order: outputs still equal each prompt alone."""
    model = make_model(attention, window=6, initializer_range=0.3)
    prompts, max_tokens = _workload(1)
    eng = Engine(model, EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=9, max_num_seqs=6,
                                     chunk_align=4, cuda_graphs=False))
    eng.runner.graphs = _EagerGraphs(eng.runner)
    mixed = []  # steps split into the decodes' forward and the chunks'
    parts = eng.runner.forward_parts

    def counted(segments):
        got = list(parts(segments))
        if len(got) == 2:
            mixed.append([len(idx) for idx, _ in got])
        return iter(got)

    eng.runner.forward_parts = counted
    out = Collector()
    for i, p in enumerate(prompts):
        eng.submit(p, SamplingParams(max_tokens=max_tokens[i]), out.sink(i))
        eng.step()
    eng.run_until_done()
    assert mixed and eng.graphs.calls  # steps whose decodes ran apart from the chunks beside them
    for i, p in enumerate(prompts):
        assert out.tokens(i) == generate(model, [p], max_new_tokens=max_tokens[i])[0, len(p):].tolist(), i


@pytest.mark.parametrize("attention", ["orthros", "full"])
def test_last_prompt_token_runs_as_a_decode(attention):
    """With `decode_last_prompt_token` (on wherever graphs are), a prompt's chunks never hold
    an output position: its last token runs as a decode, in the decodes' forward. Outputs still
    equal each prompt alone (shared prefixes among them)."""
    model = make_model(attention, window=6, initializer_range=0.3)
    prompts, max_tokens = _workload(3)
    eng = Engine(model, EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=9, max_num_seqs=6,
                                     chunk_align=4, cuda_graphs=False, decode_last_prompt_token=True))
    eng.runner.graphs = _EagerGraphs(eng.runner)
    chunks_with_output = []
    forward = eng.runner.run
    eng.runner.run = lambda cache: (chunks_with_output.extend(
        d.r1 - d.r0 for d in cache._dense if d.r1 - 1 in cache.layout.out_idx[0].tolist()), forward(cache))[1]
    out = Collector()
    for i, p in enumerate(prompts):
        eng.submit(p, SamplingParams(max_tokens=max_tokens[i]), out.sink(i))
        eng.step()
    eng.run_until_done()
    assert eng.graphs.calls and not chunks_with_output
    for i, p in enumerate(prompts):
        assert out.tokens(i) == generate(model, [p], max_new_tokens=max_tokens[i])[0, len(p):].tolist(), i
    # off wherever graphs are (the CPU default; graphs, on by default on CUDA, turn it on there, hence
    # pinned off): a prompt's last chunk carries its output position
    eng2 = Engine(model, EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=9, chunk_align=4,
                                      cuda_graphs=False))
    chunk, chunk2 = eng.scheduler.chunk, eng2.scheduler.chunk
    assert not eng2.decode_last_token and chunk2(5, 9) == 5 and chunk(5, 9) == 4 and chunk(1, 9) == 1


def test_chunks_padded_to_the_compiled_lengths_change_no_output():
    """With a grid of compiled chunk lengths, a windowed chunk off the grid (a prompt's last
    chunk, a short prompt) runs padded to the next length on it: the outputs still equal each
    prompt alone."""
    from orthros.models.paged_cache import PagedStepCache

    model = make_model("orthros", window=6, initializer_range=0.3)
    prompts, max_tokens = _workload(2)
    eng = Engine(model, EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=13, max_num_seqs=6,
                                     chunk_align=4))
    eng.pool.compiled_chunks = frozenset({8, 12, 16})
    padded = []
    init = PagedStepCache.__init__

    def spy(self, *a, **k):
        init(self, *a, **k)
        padded.extend((d.r1 - d.r0, d.rows) for d in self._dense if d.rows > d.r1 - d.r0)

    PagedStepCache.__init__ = spy
    try:
        out = Collector()
        for i, p in enumerate(prompts):
            eng.submit(p, SamplingParams(max_tokens=max_tokens[i]), out.sink(i))
        eng.run_until_done()
    finally:
        PagedStepCache.__init__ = init
    assert padded and all(m in (8, 12, 16) and m > n for n, m in padded)
    for i, p in enumerate(prompts):
        assert out.tokens(i) == generate(model, [p], max_new_tokens=max_tokens[i])[0, len(p):].tolist(), i


@pytest.mark.parametrize("sinks", [0, 2])
def test_only_the_warm_up_s_chunk_shapes_count_as_compiled(sinks):
    """`ops.paged_read.compiled_shape` against the key counts `PagedStepCache` really gathers: the
    shapes the warm-up builds (a chunk of a grid length at position 0, and one past the first window
    and its sinks) are compiled; the same length starting inside the first window (after a short
    prefix-cache hit) is not, and would otherwise compile a kernel in a serving step."""
    from orthros.models.paged_cache import PagedStepCache, Segment
    from orthros.ops.paged_read import compiled_shape

    W = 6
    model = make_model("orthros", window=W, initializer_range=0.3, sink_tokens=sinks)
    eng = Engine(model, EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=8, chunk_align=4))
    eng.pool.compiled_chunks = grid = frozenset({8})
    blocks = list(range(8))
    warm = (0, W + sinks)  # `ModelRunner.compile_chunks`' starts
    starts = sorted({*warm, 4, W, W - 1 + sinks, 12})
    for start in starts:
        (d,) = PagedStepCache(eng.pool, model.config, [Segment([1] * 8, start, blocks, False)])._dense
        on = compiled_shape(grid, d.rows, d.slots.numel(), W, sinks)
        assert on == (start in warm or start >= W - 1 + sinks), (start, d.rows, d.slots.numel())
    assert compiled_shape(grid, 8, 8 + 100, None, sinks)  # full attention: the length alone


def test_a_split_step_sends_its_decodes_tokens_before_it_launches_the_chunks():
    """In a mixed step split on graphs, the decodes' greedy tokens go out before the chunks'
    forward is launched (on a GPU they do not wait for another prompt's chunk); a sampled
    request's token, whose choice needs the device, goes out after it. Every output still equals
    its prompt alone (the sampled one: its seeded draws served alone)."""
    model = make_model("orthros", window=6, initializer_range=0.3)
    cfg = dict(block_size=4, num_blocks=64, max_num_batched_tokens=9, max_num_seqs=6, chunk_align=4,
               cuda_graphs=False, decode_last_prompt_token=True)
    eng = Engine(model, EngineConfig(**cfg))
    eng.runner.graphs = _EagerGraphs(eng.runner)
    order = []  # (step, "token", request) and (step, "chunks"), as they happen
    parts = eng.runner.forward_parts

    def marked(segments):  # a split step's second part: the chunks' forward, launched when asked for
        it = parts(segments)
        yield next(it)
        for p in it:
            order.append((eng.steps, "chunks"))
            yield p

    eng.runner.forward_parts = marked
    out = Collector()

    sink = _order_sink(eng, out, order)

    prompts, _ = _workload(4)
    SAMPLED = 1
    sampled = SamplingParams(max_tokens=6, temperature=0.8, seed=3)
    for i, p in enumerate(prompts):
        eng.submit(p, sampled if i == SAMPLED else SamplingParams(max_tokens=6), sink(i))
        eng.step()
    eng.run_until_done()
    split = {e[0]: k for k, e in enumerate(order) if e[1] == "chunks"}  # step -> where its chunks ran
    early = late = 0
    for k, e in enumerate(order):
        if e[1] == "token" and e[0] in split:
            if e[2] == SAMPLED:
                assert k > split[e[0]], e
                late += 1
            else:
                assert k < split[e[0]], e
                early += 1
    assert early and late  # both kinds of decode ran beside a chunk
    for i, p in enumerate(prompts):
        if i != SAMPLED:
            assert out.tokens(i) == generate(model, [p], max_new_tokens=6)[0, len(p):].tolist(), i
    alone, col = Engine(model, EngineConfig(**cfg)), Collector()
    alone.submit(prompts[SAMPLED], sampled, col.sink(0))
    alone.run_until_done()
    assert len(col.tokens(0)) == 6 and out.tokens(SAMPLED) == col.tokens(0)


def test_chunks_cut_by_the_budget_are_aligned():
    """The alignment of budget-cut chunks, with a prompt's last token left in its last chunk (pinned:
    decode graphs, on by default on CUDA, would leave it to a decode and cut (100, 8191) to 99)."""
    eng = Engine(make_model("orthros"), EngineConfig(block_size=4, num_blocks=8, chunk_align=128,
                                                     decode_last_prompt_token=False))
    cases = ((10000, 8192), (10000, 8191), (100, 8191), (1000, 300), (1000, 100))
    assert [eng.scheduler.chunk(left, budget) for left, budget in cases] == [8192, 8064, 100, 256, 100]


def test_preemption_recomputes_exactly():
    """A pool too small for every running request: the newest is preempted, recomputed later
    (prompt + its generated tokens), and its output is unchanged."""
    model = make_model("orthros", window=6, initializer_range=0.3)
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(14)] for _ in range(4)]  # 4 blocks each, 7 when done
    eng = Engine(model, EngineConfig(block_size=4, num_blocks=18, max_num_batched_tokens=64, max_num_seqs=6,
                                     prefix_caching=False))
    out = Collector()
    for i, p in enumerate(prompts):
        eng.submit(p, SamplingParams(max_tokens=12), out.sink(i))
    preempted = 0
    real = eng.scheduler.preempt

    def counting(req):
        nonlocal preempted
        preempted += 1
        real(req)

    eng.scheduler.preempt = counting
    eng.run_until_done()
    assert preempted > 0 and eng.blocks.num_used == 0
    for i, p in enumerate(prompts):
        assert out.tokens(i) == generate(model, [p], max_new_tokens=12)[0, len(p):].tolist()


def test_stop_tokens_sampling_seed_and_logprobs():
    model = make_model("orthros", window=6, initializer_range=0.3)
    prompt = list(range(30, 50))
    eng = Engine(model, EngineConfig(block_size=4, num_blocks=64))
    ref = generate(model, [prompt], max_new_tokens=8)[0, len(prompt):].tolist()
    out = Collector()
    eng.submit(prompt, SamplingParams(max_tokens=8, stop_token_ids=(ref[3],)), out.sink("stop"))
    eng.submit(prompt, SamplingParams(max_tokens=8, logprobs=3), out.sink("lp"))
    for k in range(3):  # the same seed gives the same sample, alone or batched with others
        eng.submit(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=7), out.sink(("seed", k)))
        if k == 0:
            eng.run_until_done()
    eng.submit(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=8), out.sink("other"))
    eng.run_until_done()
    assert out.tokens("stop") == ref[: ref.index(ref[3]) + 1] and out.reason("stop") == "stop"
    lp = [e for e in out.events["lp"] if e.token_id is not None]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ref[:1]], device=DEVICE), logits_to_keep=2).logits[0].float().log_softmax(-1)
    assert abs(lp[0].logprob - float(logits[0, ref[0]])) < 1e-4
    assert lp[0].top_logprobs[0][0] == ref[0] and len(lp[0].top_logprobs) == 3  # greedy: the top token
    assert abs(lp[1].logprob - float(logits[1, ref[1]])) < 1e-4
    seeded = [out.tokens(("seed", k)) for k in range(3)]
    assert seeded[0] == seeded[1] == seeded[2] != out.tokens("other")


def test_fp8_kv_matches_the_static_fp8_cache():
    """The fp8 pool takes its scales from the first tokens written, as StaticOrthrosCache does
    from its first chunk: one request prefilled whole gives generate(kv_dtype="fp8")'s tokens."""
    model = make_model("orthros", window=6, initializer_range=0.3)
    prompt = list(range(60, 100))
    ref = generate(model, [prompt], max_new_tokens=10, fast=True, compile=False, kv_dtype="fp8")
    eng = Engine(model, EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=64, kv_dtype="fp8"))
    assert eng.pool.storage == torch.float8_e4m3fn
    out = Collector()
    eng.submit(prompt, SamplingParams(max_tokens=10), out.sink(0))
    eng.run_until_done()
    assert out.tokens(0) == ref[0, len(prompt):].tolist()


def test_bad_requests_and_queue_bound():
    model = make_model("orthros")
    eng = Engine(model, EngineConfig(block_size=4, num_blocks=8, max_queue=2, max_model_len=40))
    sink = Collector().sink(0)
    with pytest.raises(ValueError, match="maximum context length is 40"):
        eng.submit([1] * 30, SamplingParams(max_tokens=11), sink)
    with pytest.raises(ValueError, match="KV cache holds 32 tokens"):
        eng.submit([1] * 30, SamplingParams(max_tokens=5), sink)
    with pytest.raises(ValueError, match="token ids must lie"):
        eng.submit([1, 256], SamplingParams(), sink)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    eng.submit([1], SamplingParams(), sink)
    eng.submit([1], SamplingParams(), sink)
    with pytest.raises(QueueFull):
        eng.submit([1], SamplingParams(), sink)


def test_max_model_len_auto_is_what_the_pool_holds():
    """'auto': one request may fill the pool, past the model's max_position_embeddings; a longer
    one is a clear error, as is a limit that is not a length."""
    model = make_model("orthros", max_position_embeddings=16)
    eng = Engine(model, EngineConfig(block_size=4, num_blocks=10, max_model_len="auto"))
    assert eng.max_model_len == eng.capacity_tokens == 40
    sink = Collector().sink(0)
    eng.submit([1] * 30, SamplingParams(max_tokens=10), sink)  # 40 tokens: past the model's 16
    with pytest.raises(ValueError, match="maximum context length is 40"):
        eng.submit([1] * 30, SamplingParams(max_tokens=11), sink)
    for bad in (0, "all", 2.5):
        with pytest.raises(ValueError, match="max_model_len"):
            Engine(model, EngineConfig(block_size=4, num_blocks=10, max_model_len=bad))


@pytest.mark.parametrize("attention, sinks", [("orthros", 0), ("full", 0), ("orthros", 2)])
@torch.no_grad()
def test_static_decode_buffers_equal_the_eager_step(attention, sinks):
    """What the CUDA graphs capture, run eagerly on CPU: a decode-only step over the static
    buffers, padded to its bucket with scratch rows, gives the eager step's logits (with attention
    sinks too)."""
    model = make_model(attention, window=6, initializer_range=0.3, sink_tokens=sinks)
    eng, segments = decoding_engine(model)
    eager = eng.runner.forward(segments)
    graphs = decode_graphs(eng)
    assert graphs.buckets == [1, 2, 4, 8]
    graphs._fill(segments, 4)
    static = graphs._forward(graphs._cache(4))[:3]
    assert torch.allclose(static, eager, atol=1e-5, rtol=1e-5)


def test_decode_graphs_fused_kernels_equal_the_eager_step_triton_interpreter():
    """The decode graphs run the layers' elementwise work as the fused Triton kernels at any
    batch size (on CUDA); under TRITON_INTERPRET=1 on CPU, that forward equals the eager step."""
    from ..conftest import run_triton_interpreted

    r = run_triton_interpreted("-m", "tests.serve.graphs_fused_cases", timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs (the interpreter test above covers the kernels on CPU)")
@pytest.mark.parametrize("attention", ["orthros", "full"])
def test_bf16_decode_graphs_with_fused_kernels_match_the_eager_step(attention):
    """A bf16 model's captured decode step (fused Triton elementwise kernels) is captured, replays
    exactly what its first run computed, and stays within bf16 rounding of the eager step."""
    model = make_model(attention, window=6, initializer_range=0.3).to(torch.bfloat16)
    eng, segments = decoding_engine(model, max_num_seqs=4, cuda_graphs=False)
    with torch.inference_mode():
        eager = eng.runner.forward(segments).float()
        graphs = decode_graphs(eng)
        assert graphs.fuse
        first = graphs.run(segments)  # eager, with the fused kernels; then captured
        replay = graphs.run(segments)
    assert not graphs.disabled and 4 in graphs.graphs
    assert torch.equal(first, replay)
    # bf16 rounding, amplified by the large initial weights (initializer_range 0.3): the fused
    # kernels round in other places than the eager ops (2.1e-2 seen on an H200); a wrong kernel is O(1)
    assert rel_err(replay, eager) < 3e-2


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_chunk_warm_up_leaves_no_trace(kv_dtype):
    """The warm-up's forwards (CUDA compiles the budget-cut chunk lengths and the mixed step's
    kernels with them) free their blocks, choose no fp8 scales, and change no later result;
    the lengths are those `_chunk` cuts."""
    model = make_model("orthros", window=6, initializer_range=0.3)
    cfg = EngineConfig(block_size=4, num_blocks=96, max_num_batched_tokens=300, max_num_seqs=8, chunk_align=128,
                       kv_dtype=kv_dtype)
    eng = Engine(model, cfg)
    assert eng.chunk_lengths() == sorted({eng.scheduler.chunk(10**6, b) for b in range(292, 301)}) == [256]
    with torch.inference_mode():
        eng.runner.compile_chunks(eng.blocks, eng.chunk_lengths())
        eng.runner.warm_mixed_step(eng.blocks)  # a last chunk beside a decode
    assert eng.pool.compiled_chunks == frozenset({256}) and eng.blocks.num_used == 0
    assert not any(eng.pool.scaled) and bool((eng.pool.k_scale == 1).all())
    prompt = list(range(3, 40))
    ref = generate(model, [prompt], max_new_tokens=6, fast=kv_dtype == "fp8", compile=False,
                   **({"kv_dtype": "fp8"} if kv_dtype == "fp8" else {}))[0, len(prompt):].tolist()
    out = Collector()
    eng.submit(prompt, SamplingParams(max_tokens=6), out.sink(0))
    eng.run_until_done()
    assert out.tokens(0) == ref


def test_eager_forwards_keep_no_autograd_graph_outside_inference_mode():
    """The runner's eager forwards run without autograd however they are called: the warm-up
    called by a script outside `Engine.start` (benchmarks/serve_chunk_profile.py) kept every
    layer's activations of an 8,192-token chunk and ran out of memory on an 80 GB card."""
    model = make_model("orthros", window=6, initializer_range=0.3)
    eng = Engine(model, EngineConfig(block_size=4, num_blocks=96, max_num_batched_tokens=300, max_num_seqs=8,
                                     chunk_align=128))
    grad = []
    hook = model.model.layers[0].mlp.register_forward_hook(lambda *_: grad.append(torch.is_grad_enabled()))
    try:
        assert torch.is_grad_enabled()
        eng.runner.compile_chunks(eng.blocks, eng.chunk_lengths())
        eng.runner.warm_mixed_step(eng.blocks)
        eng.warm_up()  # on CUDA, the same two; elsewhere nothing
    finally:
        hook.remove()
    assert len(grad) >= 3 and not any(grad), grad


def test_static_block_table_copies_only_what_changed_and_stays_exact():
    """The captured step's block table is refilled incrementally (appended blocks only): after
    rows grow, change hands to shorter or longer lists, and turn into padding, it equals the
    table built from scratch."""
    from orthros.models.paged_cache import Segment

    model = make_model("orthros", window=6)
    eng = Engine(model, EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4, max_model_len=64))
    graphs = decode_graphs(eng)
    sc = eng.scratch_block

    def expect(lists, b):
        t = torch.full((b, graphs.max_blocks), sc, dtype=torch.int32)
        for i, bl in enumerate(lists):
            t[i, : len(bl)] = torch.tensor(bl, dtype=torch.int32)
        return t

    a, c, d = [5, 9], [1, 2, 3, 4, 6], [7]
    steps = [([a, c], 2), ([a, c], 2), ([a, c, d], 4), ([c, d], 2), ([d], 1), ([a, c, d], 4)]
    for k, (lists, b) in enumerate(steps):
        if k == 1:
            a += [11]  # a request's list grows in place between steps
        if k == 3:
            c.append(12)
        graphs._fill([Segment([0], len(bl) * 4 - 1, bl, True) for bl in lists], b)
        assert torch.equal(graphs.table[:b].cpu(), expect(lists, b)), k


def test_step_log_records_every_step(tmp_path):
    """--step-log: one JSON line per step; its chunks and decodes add up to the tokens the
    engine ran and to each request's prompt and output; an unwritable path is a clear error."""
    import json

    model = make_model("orthros", window=6)
    prompts, max_tokens = _workload(1)
    prompts.append(list(range(17)))  # its last chunk is one token (16 + 1): a chunk, not a decode
    max_tokens.append(3)
    log = tmp_path / "steps.jsonl"
    eng = Engine(model, EngineConfig(block_size=4, num_blocks=96, max_num_batched_tokens=16, chunk_align=4,
                                     prefix_caching=False, step_log=str(log)))
    out = Collector()
    ids = [eng.submit(p, SamplingParams(max_tokens=max_tokens[i]), out.sink(i)).id for i, p in enumerate(prompts)]
    ran = 0
    while eng.has_work():
        ran += eng.step()
    eng.stop()
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    # each prompt chunk names its request; each request's first token is sent by one step, after its chunks
    assert all(len(r["prompts"]) == len(r["chunks"]) for r in recs)
    assert sorted(i for r in recs for i in r["first"]) == sorted(ids)
    for i, p in zip(ids, prompts):
        assert sum(c[0] for r in recs for c, j in zip(r["chunks"], r["prompts"]) if j == i) == len(p)
    from orthros.bench.serve_server import prompt_times

    times = {x["request"]: x for x in prompt_times(recs)}
    assert sorted(times) == sorted(ids)
    for i in ids:
        x = times[i]
        steps = [r for r in recs if x["first_chunk_step"] <= r["step"] <= x["first_token_step"]]
        assert x["chunk_steps"] == sum(i in r["prompts"] for r in steps) >= 1
        assert x["chunk_steps"] + x["other_steps"] == len(steps)
        assert x["engine_ttft_s"] >= x["chunk_s"] + x["other_s"] - 1e-3
    assert [r["step"] for r in recs] == list(range(1, eng.steps + 1))
    assert sum(r["decode"] + sum(c[0] for c in r["chunks"]) for r in recs) == ran
    assert sum(c[0] for r in recs for c in r["chunks"]) == sum(map(len, prompts))
    assert sum(r["decode"] for r in recs) == sum(len(out.tokens(i)) - 1 for i in range(len(prompts)))
    assert sum(c[2] for r in recs for c in r["chunks"]) == len(prompts)  # one last chunk per prompt
    assert all(r["ms"] >= 0 and 0 <= r["t"] for r in recs) and max(r["decode"] for r in recs) > 1
    with pytest.raises(ValueError, match="cannot write the step log"):
        Engine(model, EngineConfig(block_size=4, num_blocks=8, step_log=str(tmp_path / "no" / "dir" / "x.jsonl")))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA sync debug mode (a CPU step is done when it returns)")
@pytest.mark.parametrize("attention", ["orthros", "full"])
def test_a_prompt_chunk_step_does_not_synchronize_the_device(tmp_path, attention):
    """A step of prompt chunks without an output position reads nothing back: it queues its forward
    and returns, so the host prepares the next step while the device runs this one, with a step
    log too. Fails on any synchronizing call in such a step (a pageable upload, an .item())."""
    import json

    model = make_model(attention, window=6)
    log = tmp_path / "steps.jsonl"
    eng = Engine(model, EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=16, chunk_align=4,
                                     prefix_caching=False, step_log=str(log)))
    out = Collector()
    prompt = [(7 * i) % 200 + 1 for i in range(70)]  # chunks at 0, 16, 32, 48, then the last 6 tokens
    eng.submit(prompt, SamplingParams(max_tokens=3), out.sink(0))
    eng.step()
    eng.step()  # the first chunk of each key count: whatever they build, built
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert eng.step() == 16 and eng.step() == 16
    finally:
        torch.cuda.set_sync_debug_mode(0)
    eng.run_until_done()
    eng.stop()
    assert out.tokens(0) == generate(model, [prompt], max_new_tokens=3)[0, len(prompt):].tolist()
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, eng.steps + 1)) and all(r["ms"] > 0 for r in recs)


def test_the_host_queues_no_step_two_ahead_of_the_device(monkeypatch):
    """`Engine._queue_ahead` (CUDA: a step of prompt chunks returns once its forward is queued): before
    scheduling, finished steps are dropped and, while two are still queued, it polls the older one's
    end (sleeping between polls, no device synchronization) until it is done. Stand-in events."""
    import collections

    from orthros.serve import engine as engine_module

    class Ev:
        def __init__(self, busy: int):
            self.busy = busy  # queries answered "not done" before "done"

        def query(self):
            self.busy -= 1
            return self.busy < 0

    eng = Engine(make_model("orthros"), EngineConfig(block_size=4, num_blocks=8))
    naps = []
    monkeypatch.setattr(engine_module.time, "sleep", naps.append)
    older, newer = Ev(3), Ev(10 ** 6)
    eng._queued = collections.deque([Ev(0), older, newer])  # one done, then two queued
    eng._queue_ahead()
    assert list(eng._queued) == [newer] and older.busy < 0 and len(naps) == 2
    eng._queued = collections.deque([newer])
    eng._queue_ahead()  # one step queued: the host goes on at once
    assert list(eng._queued) == [newer] and len(naps) == 2


def test_a_chunk_s_attention_inputs_do_not_depend_on_the_decodes_beside_it(monkeypatch):
    """A prompt chunk's attention gets the same shapes and strides whatever else runs in its step
    (compiled kernels are guarded on both: a stride that followed the step's row count made
    every new mix of decodes beside a chunk compile it again)."""
    import orthros.ops.paged_read as paged_cache  # where a chunk's attention is called

    seen = []
    real = paged_cache.attention

    def recording(q, k, v, *a, **kw):
        seen.append((tuple(q.shape), q.stride(), tuple(k.shape), k.stride()))
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(paged_cache, "attention", recording)
    model = make_model("orthros", window=6)
    eng = Engine(model, EngineConfig(block_size=4, num_blocks=96, max_num_batched_tokens=20, chunk_align=4,
                                     prefix_caching=False))
    out = Collector()
    for i, n in enumerate((40, 40, 40)):  # the same prompt length, beside 0, 1 and 2 decoding requests
        eng.submit(list(range(1 + i, n + 1 + i)), SamplingParams(max_tokens=30), out.sink(i))
        for _ in range(4):
            eng.step()
    eng.run_until_done()
    by_shape = {}
    for q_shape, q_stride, k_shape, k_stride in seen:
        by_shape.setdefault((q_shape, k_shape), set()).add((q_stride, k_stride))
    assert len(seen) > 6 and any(n > 1 for (q_shape, _), _ in by_shape.items() for n in [q_shape[1]])
    assert all(len(strides) == 1 for strides in by_shape.values()), by_shape
