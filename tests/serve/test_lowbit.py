"""The engine over a low-bit KV pool (`--kv-dtype int4 | int2 | k4v2`): greedy tokens equal the static
low-bit cache's (`generate(kv_dtype=...)`), concurrent requests equal each alone, a prefix-cache hit
on low-bit blocks equals the request computed whole, the pool counts packed bytes, and what it
cannot serve is a clear error."""

import random

import pytest
import torch

from orthros.generate import generate
from orthros.models.paged_cache import kv_bytes_per_token
from orthros.serve.engine import Engine, EngineConfig, SamplingParams
from orthros.serve.kv_blocks import BlockPool, BlockTable
from orthros.serve.kv_twins import TwinBlocks

from ..conftest import make_model
from .test_engine import Collector

W = 8  # the window: a token leaves the bf16 part once 8 + up to 63 newer ones are in (key groups of 64)


def _engine(model, kv_dtype, **over):
    cfg = dict(block_size=64, num_blocks=48, max_num_batched_tokens=48, max_num_seqs=8, max_model_len=512,
               kv_dtype=kv_dtype)
    return Engine(model, EngineConfig(**{**cfg, **over}))


def _serve(eng, prompts, max_tokens, together=True):
    """Greedy tokens of each prompt: submitted together (one batch), or each alone on the engine."""
    out = Collector()
    for i, p in enumerate(prompts):
        eng.submit(p, SamplingParams(max_tokens=max_tokens), out.sink(i))
        if not together:
            eng.run_until_done()
    eng.run_until_done()
    assert eng.blocks.num_used == 0
    return [out.tokens(i) for i in range(len(prompts))]


def _static(model, prompt, n, kv_dtype):
    return generate(model, [prompt], max_new_tokens=n, fast=True, compile=False, kv_dtype=kv_dtype)[0, len(prompt):].tolist()


def _prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("kv_dtype, sinks", [("int4", 0), ("int2", 0), ("k4v2", 0), ("int4", 3), ("int2", 6)])
@torch.no_grad()
def test_greedy_tokens_equal_the_static_lowbit_cache(kv_dtype, sinks):
    """Prompts chunked by the step budget (48) over blocks of 64, decoding past key-group edges: the
    tokens of `generate` with the static low-bit cache of the same dtype (the same stored bits); with
    attention sinks too (6: more than the format's 4 bf16 sink slots)."""
    model = make_model("orthros", window=W, initializer_range=0.3, sink_tokens=sinks)
    prompts = _prompts([150, 70, 5])
    got = _serve(_engine(model, kv_dtype), prompts, 60)
    for p, g in zip(prompts, got):
        assert g == _static(model, p, 60, kv_dtype)
    # and the storage shows: the 16-bit pool's tokens differ somewhere
    assert got != _serve(_engine(model, "auto", block_size=4, num_blocks=256), prompts, 60)
    if sinks:  # and the sinks: the same weights without them serve other tokens
        plain = make_model("orthros", window=W, initializer_range=0.3)
        plain.load_state_dict(model.state_dict())
        assert got != _serve(_engine(plain, kv_dtype), prompts, 60)


@torch.no_grad()
def test_int2_keeps_the_int4_key_layers():
    """int2 keeps the keys of `config.kv_int4_key_layers` in int4, as `LowBitStaticCache` does."""
    model = make_model("orthros", window=W, initializer_range=0.3)
    model.config.kv_int4_key_layers = [1]
    eng = _engine(model, "int2")
    assert eng.pool.layer_key_bits == [2, 4] and eng.pool.kq[1].shape[-1] == 2 * eng.pool.kq[0].shape[-1]
    prompts = _prompts([140, 9], seed=1)
    for p, g in zip(prompts, _serve(eng, prompts, 40)):
        assert g == _static(model, p, 40, "int2")


@pytest.mark.parametrize("kv_dtype", ["int4", "int2"])
@torch.no_grad()
def test_concurrent_greedy_equals_alone(kv_dtype):
    """8 requests of different lengths in one batch (prompt chunks beside decodes, blocks interleaved in
    the pool) give each request's tokens served alone."""
    model = make_model("orthros", window=W, initializer_range=0.3)
    prompts = _prompts([150, 7, 70, 130, 40, 100, 66, 1], seed=2)
    together = _serve(_engine(model, kv_dtype), prompts, 40)
    alone = _serve(_engine(model, kv_dtype), prompts, 40, together=False)
    assert together == alone and all(len(t) == 40 for t in together)


@torch.no_grad()
def test_prefix_hit_on_lowbit_blocks_gives_the_same_tokens():
    """A prompt sharing 3 full blocks (192 tokens: packed, their tail still in bf16 twins) with an
    earlier one reads them from the prefix cache and gives the tokens of the static cache."""
    model = make_model("orthros", window=W, initializer_range=0.3)
    shared = _prompts([200], seed=3)[0]
    a, b = shared + _prompts([30], seed=4)[0], shared[:195] + _prompts([20], seed=5)[0]
    eng = _engine(model, "int4")
    ta = _serve(eng, [a], 30)[0]
    hits = eng.blocks.hit_tokens
    tb, ta2 = _serve(eng, [b, a], 30)
    assert eng.blocks.hit_tokens - hits >= 2 * 192  # both read the shared blocks from the cache
    assert ta == ta2 == _static(model, a, 30, "int4")
    assert tb == _static(model, b, 30, "int4")


def test_prefix_match_ends_where_the_bf16_tail_is_gone():
    """A cached run is used only as far as the bf16 twins its continuation reads are kept (sinks in block
    0, the blocks from the bound on); a block handed out afresh loses its twin."""
    bs = 16
    twins = TwinBlocks(8, 9, bs, sinks=4, recent=8, key_group=16, reserved=(8,))
    pool = BlockPool(8, bs, twins=twins)
    tokens = list(range(70))
    t = BlockTable()
    t.blocks = pool.allocate(5)
    twins.retain(twins.needed(t.blocks, 0, 70))  # a 70-token prompt written whole: every block in bf16
    assert all(twins.twin_of[b] >= 0 for b in t.blocks)
    pool.register_full(tokens, 70, t)
    twins.retain(twins.needed(t.blocks, 70))  # after it: block 0 and the blocks from bound(71) = 48 on
    assert sorted(twins.pinned) == sorted(twins.twin_of[b] for b in (t.blocks[0], t.blocks[3], t.blocks[4], 8))
    pool.release(t)
    twins.retain(())
    # the twins stay filled; a match of 4 blocks (64 tokens) reads block 0 and blocks 3 (from bound(65) = 48)
    t2 = BlockTable()
    assert pool.match_prefix(tokens + [1], t2) == 64
    pool.release(t2)
    twins.drop(_block(pool, tokens, 3))  # the tail block's twin is gone
    t3 = BlockTable()
    n = pool.match_prefix(tokens + [1], t3)
    assert n == 48  # 3 blocks: bound(49) = 32, blocks 2 and 0 still have theirs
    pool.release(t3)
    twins.drop(_block(pool, tokens, 0))  # the sinks are gone: no prefix is usable
    assert pool.match_prefix(tokens + [1], BlockTable()) == 0


def _block(pool, tokens, i):
    """The cached block holding tokens [16 i, 16 (i + 1)) of `tokens`."""
    from orthros.serve.kv_blocks import chain_hash

    h = None
    for j in range(i + 1):
        h = chain_hash(h, tokens[16 * j:16 * (j + 1)])
    return pool.cached[h]


def test_pool_counts_packed_bytes_and_auto_model_len_follows():
    """The same KV memory holds ~3.5x (int4) / ~6.4x (int2) the tokens of bf16 (Llama-like heads: D = 128),
    and --max-model-len auto is what the pool holds."""
    from orthros import OrthrosConfig

    big = OrthrosConfig.from_name("tiny", head_dim=128)
    bf16 = kv_bytes_per_token(big, torch.bfloat16, "auto")
    assert bf16 / kv_bytes_per_token(big, torch.bfloat16, "int4") == 4 / (1 + 2 * 4 / 64)  # 4-bit K, V; fp16 pairs
    assert bf16 / kv_bytes_per_token(big, torch.bfloat16, "int2") == 4 / (0.5 + 2 * 4 / 64)  # per 64 slots / chans
    model = make_model("orthros", window=W).to(torch.bfloat16)
    gib = 64 / 2**10
    dense = Engine(model, EngineConfig(kv_cache_gib=gib, max_model_len="auto", block_size=64))
    low = Engine(model, EngineConfig(kv_cache_gib=gib, max_model_len="auto", block_size=64, kv_dtype="int4",
                                     max_num_seqs=4))
    assert low.max_model_len == low.capacity_tokens > 2.5 * dense.max_model_len
    assert low.pool.memory_bytes <= gib * 2**30 < 1.1 * low.pool.memory_bytes + 64 * 2**10


def test_what_a_lowbit_pool_cannot_serve_is_a_clear_error():
    with pytest.raises(ValueError, match="needs an Orthros model.*attention is 'full'"):
        _engine(make_model("full"), "int4")
    with pytest.raises(ValueError, match="block size must be a multiple of 64, got 16"):
        _engine(make_model("orthros", window=W), "int2", block_size=16)
    with pytest.raises(ValueError, match="block size must be at least sink_tokens=70, got 64"):
        _engine(make_model("orthros", window=W, sink_tokens=70), "int4")


def test_cli_lowbit_flags(capsys):
    """--kv-dtype int4 picks blocks of 64 by default; a non-Orthros model is a one-line error."""
    from orthros.cli import build_parser, main
    from orthros.serve.cli import engine_config

    args = build_parser().parse_args(["serve", "--preset", "tiny", "--kv-dtype", "int4"])
    assert engine_config(args).block_size == 64 and engine_config(args).kv_dtype == "int4"
    args = build_parser().parse_args(["serve", "--preset", "tiny"])
    assert engine_config(args).block_size == 16
    assert main(["serve", "--preset", "tiny", "--attention", "full", "--kv-dtype", "int4", "--device", "cpu",
                 "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs an Orthros model" in err[0], err


def test_twins_are_pinned_while_needed_and_evicted_least_recently_released_first():
    twins = TwinBlocks(4, 10, 16, sinks=4, recent=8, key_group=16, reserved=(9,))
    assert twins.needed([5, 6, 7], 40, 1) == [7, 5]  # bound(41) = 32: block 2, and block 0 (the sinks)
    assert twins.needed([5, 6, 7], 30, 3) == [6, 7, 5]  # bound(31) = 16: blocks 1 and 2 (the new tokens')
    twins.retain([1, 2])
    twins.retain([3])  # 1 and 2 released (filled, evictable), 3 takes the last free twin
    assert {twins.twin_of[b] >= 0 for b in (1, 2, 3)} == {True}
    twins.retain([3, 4])  # no free twin: the least recently released one goes
    assert sum(twins.twin_of[b] >= 0 for b in (1, 2)) == 1 and twins.twin_of[4] >= 0
    with pytest.raises(RuntimeError, match="pinned"):
        twins.retain([3, 4, 5, 6])
    blocks, tw = twins.take_changes()
    assert len(blocks) == len(tw) and not twins.take_changes()[0]


@torch.no_grad()
def test_static_decode_steps_equal_the_static_cache():
    """What a CUDA graph captures, run eagerly on CPU: every decode-only step over the static buffers
    (padded with scratch rows to its bucket; each row re-quantizes its key group every step, no plan
    from the host) gives the tokens of the static low-bit cache."""
    from .conftest import decode_graphs

    model = make_model("orthros", window=W, initializer_range=0.3)
    eng = _engine(model, "int4", max_num_seqs=4, max_model_len=320)
    graphs, eager = decode_graphs(eng), eng.runner.forward
    used = []

    def forward(segments):
        if len(eng.runner.decodes(segments)) < len(segments):
            return eager(segments)
        b = next(x for x in graphs.buckets if x >= len(segments))
        graphs._fill(segments, b)
        used.append(b)
        return graphs._forward(graphs._cache(b))[:len(segments)]

    eng.runner.forward = forward
    prompts = _prompts([100, 60, 3], seed=6)
    for p, g in zip(prompts, _serve(eng, prompts, 70)):
        assert g == _static(model, p, 70, "int4")
    assert 4 in used and len(used) > 50  # three rows padded to 4; most steps decode-only
