"""Captured CUDA graphs for the engine's decode-only steps (run by `serve.runner`).

A step whose segments are all single decode tokens has static shapes once the
batch is padded to a bucket (1, 2, 4, ... up to `max_num_seqs`): the model
runs over `PagedStepCache.static_decode` buffers (token, position, block
slot, block table per row), and the attention kernel's grid is fixed by the
longest possible sequence. Each bucket is captured the first time it is
needed (its first run is eager and produces that step's result; the
capture writes the same K/V again, so it changes nothing) and replayed after
that: one graph launch instead of hundreds of kernel launches per step.

Inside a graph a kernel's launch costs no host time, only its few microseconds
on the GPU, so the layers' elementwise work runs as the fused Triton kernels
(`layers/fused.py`, mode "triton": one kernel for a norm, SO + head norm +
RoPE, or SwiGLU's gate) at any batch size, where eager decoding keeps small
inputs unfused. Outside attention and the cache writes, an Orthros step runs
~1.5x the eager ops of a full-attention one (two streams, SO; counted on CPU,
4 layers: 283 against 188), 75 against 60 with the fusion. The bucket's first
(eager) run uses the same kernels as its capture. fp32 models keep the eager ops.

Padded rows decode token 0 at position 0 into a scratch block that no
request owns (the pool's last block), so they read and write nothing real.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from ..layers.fused import fused_mode
from ..models.paged_cache import PagedKVPool, PagedStepCache, Segment


class DecodeGraphs:
    def __init__(self, model, pool: PagedKVPool, scratch_block: int, max_model_len: int, max_num_seqs: int):
        """Graphs of `model` decoding over `pool` (whose block `scratch_block` no request owns),
        for up to `max_num_seqs` rows of up to `max_model_len` tokens."""
        self.model = model
        self.pool = pool
        self.scratch = scratch_block
        bs = pool.block_size
        self.max_blocks = -(-max_model_len // bs)
        self.max_len = self.max_blocks * bs
        n = max_num_seqs
        self.buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b < n] + [n]
        dev = pool.device
        B = self.buckets[-1]
        self.input_ids = torch.zeros(1, B, dtype=torch.long, device=dev)
        self.pos = torch.zeros(B, dtype=torch.long, device=dev)
        self.slots = torch.zeros(B, dtype=torch.long, device=dev)
        self.table = torch.full((B, self.max_blocks), self.scratch, dtype=torch.int32, device=dev)
        # What row i of `table` holds: (the block list it was copied from, how many entries), so
        # that a step copies only the blocks appended since (a 128K sequence has 8K of them)
        self._rows: list[tuple[list[int], int] | None] = [None] * B
        # bucket -> (graph, its output, the cache it was captured over: the tensors that cache
        # made outside the graph (row indices, masks) are read by every replay and must stay alive)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, PagedStepCache]] = {}
        self.mempool = None
        self.disabled = False
        # the Triton elementwise kernels at any size (see above); fp32 models (tests, references)
        # keep the eager ops, so that their greedy tokens stay exactly those of the eager paths
        self.fuse = dev.type == "cuda" and self.model.dtype in (torch.bfloat16, torch.float16)

    def _cache(self, b: int) -> PagedStepCache:
        return PagedStepCache.static_decode(self.pool, self.input_ids[:, :b], self.pos[:b], self.slots[:b],
                                            self.table[:b], self.max_len, self.model.config.sink_tokens)

    def _forward(self, cache: PagedStepCache) -> torch.Tensor:
        m = self.model
        with fused_mode("triton") if self.fuse else contextlib.nullcontext():
            h = m.model.forward_streams(m.model.embed_tokens(cache.input_ids), cache.layout, cache)
        return m.lm_head(h)[0].float()

    def _fill(self, segments: list[Segment], b: int) -> None:
        bs = self.pool.block_size
        ids = torch.zeros(b, dtype=torch.long)
        pos = torch.zeros(b, dtype=torch.long)
        slots = torch.full((b,), self.scratch * bs, dtype=torch.long)
        for i, s in enumerate(segments):
            ids[i], pos[i] = s.tokens[0], s.start
            slots[i] = s.blocks[s.start // bs] * bs + s.start % bs
            self._fill_row(i, s.blocks)
        for i in range(len(segments), b):  # padded rows: the scratch block
            self._fill_row(i, None)
        self.input_ids[0, :b].copy_(ids, non_blocking=True)
        self.pos[:b].copy_(pos, non_blocking=True)
        self.slots[:b].copy_(slots, non_blocking=True)

    def _fill_row(self, i: int, blocks: list[int] | None) -> None:
        """Row i of the static block table := `blocks` (None: all scratch), copying only what
        changed. A request's block list only grows while it holds it (a release makes a new
        list), so the same list object with more entries needs only its new ones."""
        held = self._rows[i]
        if blocks is None:
            if held is not None:
                self.table[i].fill_(self.scratch)
            self._rows[i] = None
            return
        if held is not None and held[0] is blocks and held[1] <= len(blocks):
            a = held[1]
        else:
            a = 0
            if held is not None and held[1] > len(blocks):  # the old row was longer: clear its tail
                self.table[i, len(blocks):held[1]].fill_(self.scratch)
        if a < len(blocks):
            self.table[i, a:len(blocks)].copy_(torch.tensor(blocks[a:], dtype=torch.int32), non_blocking=True)
        self._rows[i] = (blocks, len(blocks))

    def capture_all(self) -> None:
        """Capture every bucket now, every row on the scratch block (before any request)."""
        for b in reversed(self.buckets):  # largest first: the others reuse its memory
            if self.disabled:
                return
            self._fill([], b)
            self._forward(self._cache(b))  # eager first: kernels compiled, memory warmed
            self._capture(b, self._cache(b))

    def fits(self, segments: list[Segment]) -> bool:
        """Whether `run` can take these decodes: graphs on, a bucket for their number, every
        sequence within the captured block table."""
        return (not self.disabled and len(segments) <= self.buckets[-1]
                and all(len(s.blocks) <= self.max_blocks for s in segments))

    def run(self, segments: list[Segment]) -> torch.Tensor | None:
        """Logits [len(segments), V] of a decode-only step, or None (run it eagerly) if it
        does not fit a bucket or capturing failed."""
        n = len(segments)
        if not self.fits(segments):
            return None
        b = next(x for x in self.buckets if x >= n)
        self._fill(segments, b)
        if b not in self.graphs:
            cache = self._cache(b)
            logits = self._forward(cache)  # eager: this step's result, and the kernels compiled
            self._capture(b, cache)
            return logits[:n].clone()
        graph, out, _ = self.graphs[b]
        graph.replay()
        return out[:n].clone()

    def _capture(self, b: int, cache: PagedStepCache) -> None:
        """Capture bucket `b`; on failure, say so once and run decode steps eagerly from now on."""
        try:
            self._capture_graph(b, cache)
        except Exception as e:  # noqa: BLE001 - eager decoding still works
            self.disabled = True
            self.graphs.clear()
            print(f"orthros serve: capturing the decode step failed ({type(e).__name__}: {e}); "
                  "decoding eagerly", file=sys.stderr, flush=True)

    def _capture_graph(self, b: int, cache: PagedStepCache) -> None:
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(cache)
        torch.cuda.current_stream().wait_stream(side)
        if self.mempool is None:
            self.mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            out = self._forward(cache)
        torch.cuda.synchronize()
        self.graphs[b] = (graph, out, cache)
