"""Low-bit split-KV launches built on the CPU for a given shape, for compile checks and the
resource table (`benchmarks/kernel_resources.py`): a one-layer `LowBitStaticCache` and the
decode pair's queries (a windowed base row and the output row) at a context past the bound."""

from __future__ import annotations

import torch

from ..models import OrthrosConfig
from ..models.lowbit_cache import LowBitStaticCache
from ..ops.splitkv.lowbit import LaunchPlan, launch_plan
from ..ops.splitkv.study import LOOPS, loop_options  # noqa: F401  (the names benchmarks import from here)


def lowbit_launch(kv_dtype: str, heads: int = 32, kv_heads: int = 8, head_dim: int = 128, rotate: bool = True,
                  planar: bool | None = None, dequant_values: bool | None = None,
                  fp16_dequant: bool | None = None, block_n: int = 64,
                  num_warps: int = 4, num_stages: int = 3, dtype=torch.bfloat16, context: int = 1000) -> LaunchPlan:
    cfg = OrthrosConfig.from_name("tiny", num_hidden_layers=1, num_attention_heads=heads,
                                  num_key_value_heads=kv_heads, head_dim=head_dim, window_size=128)
    cache = LowBitStaticCache(cfg, 1, context + 24, "cpu", dtype, kv_dtype, rotate=rotate)
    bound = cache.bound_at(context)
    q = torch.zeros(1, 2, heads, head_dim, dtype=dtype)
    slot = torch.full((1, 2), context - 1)
    return launch_plan(q, *cache.layer(0), slot, torch.zeros(1, 2, dtype=torch.long), cache.doc,
                       torch.tensor([bound]), context, cache.key_bits, cache.value_bits, cache.key_group, window=128,
                       window_rows=1, rotation=cache.rotation, num_splits=4, block_n=block_n, num_warps=num_warps,
                       num_stages=num_stages, planar=planar, dequant_values=dequant_values,
                       fp16_dequant=fp16_dequant)


def gluon_packed_launch(kv_dtype: str, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                        dtype=torch.bfloat16, context: int = 4096, splits: int = 64, maxnreg=None, pipe=None):
    """The Gluon packed kernel's launch (`ops.splitkv.lowbit.gluon_launch`) for a decode pair over a
    one-layer cache on the CPU: (kernel, grid, args, meta), for compile checks (nothing runs)."""
    from ..ops.splitkv.lowbit import gluon_launch, packed_rows

    cfg = OrthrosConfig.from_name("tiny", num_hidden_layers=1, num_attention_heads=heads,
                                  num_key_value_heads=kv_heads, head_dim=head_dim, window_size=128)
    cache = LowBitStaticCache(cfg, 1, context, "cpu", dtype, kv_dtype)
    q = torch.zeros(1, 2, heads, head_dim, dtype=dtype)
    o = torch.empty(1, 1 + splits, 2, heads, 2, head_dim)
    lse = torch.empty(1, 1 + splits, 2, heads)
    return gluon_launch(q, *cache.layer(0)[2:8], torch.zeros(1, 2, dtype=torch.long), cache.doc,
                        torch.tensor([cache.bound_at(context)]), o, lse, cache.sinks, context, cache.key_bits,
                        cache.value_bits, cache.key_group, None, packed_rows(2, 128, 1), splits, maxnreg, pipe)
