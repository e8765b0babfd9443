"""The long-range probes read their text through a fast-path cache (kv_dtype, or a cache
built by the caller): the same losses as the cache-less forward for a bf16 cache, other
losses for a quantized one."""

import torch

from orthros.eval.longrange import copy_probe, token_losses
from orthros.models.lowbit_cache import LowBitStaticCache

from ..conftest import DEVICE, make_model, rel_err


def lowbit(rotate: bool):
    def new(model, B, T):  # key groups of 16: these short rows do reach the packed storage
        return LowBitStaticCache(model.config, B, T, DEVICE, next(model.parameters()).dtype, "int2", key_group=16,
                                 value_group=16, rotate=rotate)
    return new


def test_probes_through_a_cache():
    torch.manual_seed(0)
    model = make_model(window=8)
    stream = torch.randint(0, 256, (600,))
    kw = dict(gaps=[60], samples=2, seg_len=16, prefix=8, batch_size=2, chunk=24)
    second = lambda **extra: copy_probe(model, stream, **kw, **extra)["by_gap"]["60"]["second"]
    plain, bf16 = second(), second(kv_dtype="bf16")
    assert abs(bf16 - plain) < 1e-2 * plain  # bf16 rounding of K/V only
    rotated, unrotated = second(new_cache=lowbit(True)), second(new_cache=lowbit(False))
    assert abs(rotated - plain) > 1e-4 and abs(unrotated - plain) > 1e-4 and rotated != unrotated
    rows = stream[:100].view(2, 50)
    ref = token_losses(model, rows)
    assert rel_err(token_losses(model, rows, kv_dtype="bf16", chunk=16), ref) < 1e-2
