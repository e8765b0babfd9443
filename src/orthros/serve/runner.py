"""The model runner: the model, its paged KV pool, the decode graphs and the warm-up.

It runs a step's segments (`models.paged_cache.Segment`: tokens, start,
blocks, whether an output position) and returns the logits at their output
positions; which segments those are is the scheduler's business. On CUDA the
decodes of a step run through captured graphs (`serve.graphs`), and a step
that also holds prompt chunks runs them in a second, eager forward
(`ModelRunner.forward_parts`).
"""

from __future__ import annotations

import torch

from ..models.lowbit_cache import KEY_GROUP
from ..models.paged_cache import PagedKVPool, PagedStepCache, Segment, kv_bytes_per_token
from ..models.paged_lowbit import PagedLowBitPool, check_lowbit_pool, twin_bytes_per_block
from ..models.static_cache import LOWBIT_KV_DTYPES
from .config import EngineConfig
from .kv_blocks import BlockPool, BlockTable
from .kv_twins import TwinBlocks, twins_for


def blocks_from_memory(model, device: torch.device, dtype: torch.dtype, cfg: EngineConfig, fixed: int = 0) -> int:
    """KV blocks that fit `cfg.kv_cache_gib` (None: on CUDA 90% of the free memory, less the
    activations of a full token budget and 2 GiB; elsewhere 1 GiB), less the scratch block and
    `fixed` bytes (a low-bit pool's bf16 twin blocks)."""
    per_block = kv_bytes_per_token(model.config, dtype, cfg.kv_dtype) * cfg.block_size
    gib = cfg.kv_cache_gib
    if gib is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            # headroom for the activations of a full token budget (MLP rows dominate)
            mc = model.config
            act = cfg.max_num_batched_tokens * (3 * mc.intermediate_size + 8 * mc.hidden_size) * 4
            act += cfg.max_num_batched_tokens * mc.vocab_size * 4 // 8
            budget = 0.9 * free - act - (2 << 30)
        else:
            budget = 1 << 30
    else:
        budget = gib * 2**30
    n = int((budget - fixed) // per_block) - 1
    if n < 2:
        extra = f", {fixed / 2**30:.2f} GiB of it for the bf16 twin blocks" if fixed else ""
        raise ValueError(f"no memory for the KV cache ({budget / 2**30:.2f} GiB for blocks of {per_block:.0f} bytes"
                         f"{extra})")
    return n


class ModelRunner:
    def __init__(self, model, config: EngineConfig, max_model_len: int | str):
        self.model = model.eval()
        cfg = config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        mc = model.config
        lowbit = cfg.kv_dtype in LOWBIT_KV_DTYPES
        twins = 0
        if lowbit:  # packed blocks, and bf16 twins for what the running requests read in bf16 (`kv_twins`)
            check_lowbit_pool(mc, cfg.kv_dtype, cfg.block_size)
            twins = twins_for(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.block_size, mc.window_size, KEY_GROUP)
        fixed = twins * twin_bytes_per_block(mc, self.dtype, cfg.block_size)
        self.num_blocks = cfg.num_blocks or blocks_from_memory(model, self.device, self.dtype, cfg, fixed)
        if max_model_len == "auto":  # one request may hold the whole pool
            max_model_len = self.num_blocks * cfg.block_size
        self.max_model_len = max_model_len
        # one block more than the block manager hands out: a scratch block for padded rows
        self.scratch_block = self.num_blocks
        self.twins = None
        if lowbit:
            self.pool = PagedLowBitPool(mc, self.num_blocks + 1, cfg.block_size, self.device, self.dtype,
                                        cfg.kv_dtype, twins)
            self.twins = TwinBlocks(twins, self.num_blocks + 1, cfg.block_size, self.pool.sinks, mc.window_size,
                                    KEY_GROUP,
                                    reserved=(self.scratch_block,))
            self.sync_twins()
        else:
            self.pool = PagedKVPool(mc, self.num_blocks + 1, cfg.block_size, self.device, self.dtype, cfg.kv_dtype)
        self.cfg = cfg  # the engine's settings, read where used (a benchmark may change them between steps)
        self.used_graph = False  # whether the last `forward` replayed a graph (for the step log)
        self.graphs = None
        if cfg.cuda_graphs and self.device.type == "cuda":
            from .graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, self.pool, self.scratch_block, max_model_len, cfg.max_num_seqs)

    def sync_twins(self) -> None:
        """A low-bit pool: copy the twin blocks the scheduler changed into the device's map (before a step)."""
        if self.twins is not None:
            self.pool.set_twins(*self.twins.take_changes())

    # ------------------------------------------------------------ forwards
    def forward_parts(self, segments: list[Segment]):
        """The step's forward, in parts: (the indices of the output segments, their logits [n, V]).

        One part, `forward`'s, unless the step mixes decodes and prompt chunks and graphs are on
        (`EngineConfig.split_mixed_steps`): then the decodes replay their graph, the first part,
        and the chunks run eagerly as a second forward, launched only when the caller asks for
        the second part. Run eagerly beside the chunks, a decode row would cost the whole model's
        per-layer kernel launches on the host (hundreds of small kernels for a few rows), which
        running streams would wait for beside every chunk; and a caller that reads the decodes'
        tokens before asking sends them a chunk's time earlier (`Engine.step`)."""
        self.used_graph = False
        dec = self.decodes(segments) if self.graphs is not None and self.cfg.split_mixed_steps else []
        decodes = [segments[i] for i in dec]
        if dec and len(dec) < len(segments) and self.graphs.fits(decodes):
            picked = set(dec)
            # the chunks' cache first: its inputs are built and queued for the device before the
            # graph, so the host's work for the chunks is done before the decodes' tokens are read
            cache = PagedStepCache(self.pool, self.model.config, [s for i, s in enumerate(segments) if i not in picked])
            rest = [i for i, s in enumerate(segments) if i not in picked and s.output]
            out = self.graphs.run(decodes)
            if out is not None:
                self.used_graph = True
                yield dec, out
                yield rest, self.run(cache)
                return
        yield [i for i, s in enumerate(segments) if s.output], self.forward(segments)

    def forward(self, segments: list[Segment]) -> torch.Tensor:
        """The step's logits [N, V] at the segments' output positions, in their order, from one
        forward: a decode-only step replays a captured graph where graphs are on, anything else
        runs eagerly."""
        self.used_graph = False
        if self.graphs is not None and len(self.decodes(segments)) == len(segments) and self.graphs.fits(segments):
            out = self.graphs.run(segments)
            if out is not None:
                self.used_graph = True
                return out
        return self.eager_forward(segments)

    @staticmethod
    def decodes(segments: list[Segment]) -> list[int]:
        """Indices of the segments a decode graph can run: one token, an output position."""
        return [i for i, s in enumerate(segments) if len(s.tokens) == 1 and s.output]

    def eager_forward(self, segments: list[Segment]) -> torch.Tensor:
        return self.run(PagedStepCache(self.pool, self.model.config, segments))

    @torch.inference_mode()
    def run(self, cache: PagedStepCache) -> torch.Tensor:
        """One eager forward through `cache`: logits [N, V] (fp32) at its output positions (no
        autograd, whoever calls: the warm-up may run outside `Engine.start`)."""
        m = self.model
        h = m.model.forward_streams(m.model.embed_tokens(cache.input_ids), cache.layout, cache)
        return m.lm_head(h)[0].float()

    # ------------------------------------------------------------- warm-up
    def warm_up(self, blocks: BlockPool, chunk_lengths: list[int]) -> None:
        """On CUDA, before serving, so that no step of a running stream waits for a compilation:
        compile the windowed-chunk attention for every budget-cut chunk length (`chunk_lengths`,
        first chunk and later ones; other lengths run the blocked op, `PagedKVPool.compiled_chunks`),
        then run one mixed step (a prompt's last chunk beside a decode, both with an output
        position: the eager path's kernels, which the captured decode graphs do not compile).
        The writes go to blocks of `blocks` that are free again afterwards."""
        if self.device.type == "cuda":
            if self.model.config.attention != "full":
                self.compile_chunks(blocks, chunk_lengths)
            self.warm_mixed_step(blocks)
            torch.cuda.synchronize(self.device)

    def capture_graphs(self) -> None:
        """Capture every decode bucket now (an fp8 pool's scales come from the first prefill:
        its graphs are captured when first needed)."""
        if self.graphs is not None and not self.pool.fp8:
            self.graphs.capture_all()

    def compile_chunks(self, blocks: BlockPool, chunk_lengths: list[int]) -> None:
        lengths = [n for n in chunk_lengths if n >= 128]
        self.pool.compiled_chunks = frozenset(lengths)
        c = self.model.config
        for n in lengths:  # a first chunk; a later one, whose keys begin with the sinks below its window
            for start in (0, c.window_size + c.sink_tokens):
                self._warm_forward(blocks, [(n, start, False)])

    def warm_mixed_step(self, blocks: BlockPool) -> None:
        W = self.model.config.window_size or 16
        self._warm_forward(blocks, [(W + 3, W, True), (1, W + 1, True)])

    def _warm_forward(self, blocks: BlockPool, parts: list[tuple[int, int, bool]]) -> None:
        """One forward over fake sequences [(tokens, start, output)] in blocks freed afterwards
        (skipped if the pool has too few free); it chooses no fp8 scales."""
        need = [blocks.blocks_for(start + n) for n, start, _ in parts]
        if sum(need) > blocks.num_free:
            return
        tables = [blocks.allocate(k) for k in need]
        try:
            if self.twins is not None:  # (before serving: no request holds a twin)
                self.twins.retain(x for (n, start, _), b in zip(parts, tables) for x in self.twins.needed(b, start, n))
                self.sync_twins()
            # eager: the graphs are captured from real steps (an fp8 pool's scales come later)
            self.eager_forward([Segment([0] * n, start, b, out) for (n, start, out), b in zip(parts, tables)])
        finally:
            for b in tables:
                blocks.release(BlockTable(blocks=b))
            if self.twins is not None:
                self.twins.retain(())
        if self.pool.fp8:  # the warm-up's tokens must not choose the scales
            self.pool.scaled = [False] * self.pool.num_layers
            self.pool.k_scale.fill_(1.0)
            self.pool.v_scale.fill_(1.0)
