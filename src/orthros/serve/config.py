"""The engine's settings (`orthros serve`'s engine flags map onto these fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: from kv_cache_gib
    kv_cache_gib: float | None = None  # None: CUDA 90% of free memory after warm-up, CPU 1 GiB
    max_num_batched_tokens: int = 2048  # the per-step token budget
    max_num_seqs: int = 64
    max_queue: int = 256  # waiting requests before `submit` raises QueueFull
    # prompt + output limit of a request. None: the model's max_position_embeddings; "auto": what
    # the KV pool holds (one request may fill it), whatever the model's trained length
    max_model_len: int | str | None = None
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
    # A prompt chunk cut short by the budget is rounded down to a multiple of this (beside another
    # prompt's chunk, of a quarter of its power of two too): compiled attention kernels then see
    # few distinct chunk lengths. None: 128 on CUDA, 1 (no rounding) elsewhere.
    chunk_align: int | None = None
    # A JSON-lines file with one record per step (what it ran, how long it took: on CUDA timed by
    # events, without synchronizing the device; `serve/step_log.py`): to find which steps are slow.
    step_log: str | None = None
