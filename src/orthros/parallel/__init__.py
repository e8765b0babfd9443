"""Context parallelism: one prompt sharded over the processes of a group.

    from orthros.parallel import cp_prefill, cp_decode_one_token, init_from_env
    cp, device = init_from_env()               # under torchrun
    logits, cache = cp_prefill(model, ids)     # ids: the whole prompt on every rank
    logits = cp_decode_one_token(model, tok, cache)

See docs/long_context.md.
"""

from ..ops.lse import lse_merge, partial_attention
from .comm import CPGroup, balanced_bounds, gather_merge, halo_exchange, init_from_env, shard_bounds, spawn
from .context import ShardedCache, cp_decode_one_token, cp_generate, cp_prefill

__all__ = [
    "CPGroup", "ShardedCache", "balanced_bounds", "cp_decode_one_token", "cp_generate", "cp_prefill",
    "gather_merge", "halo_exchange", "init_from_env", "lse_merge", "partial_attention", "shard_bounds", "spawn",
]
