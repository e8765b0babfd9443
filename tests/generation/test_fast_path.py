"""The fast generation path (static cache, sync-free decode step, compiled step) against
the reference path (growing `OrthrosCache`, `model.forward` every step)."""

import pytest
import torch

from orthros.generate import (compiled_decode_step, decode_one_token, decode_one_token_fast, fast_decode_step,
                              generate, left_pad, new_static_cache, prefill)
from orthros.models.static_cache import FP8_MAX, StaticOrthrosCache

from ..conftest import DEVICE, make_model, rel_err

ATTENTIONS = ["orthros", "full", "swa"]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def prompts(lengths=(5, 13, 1), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def reference_logits(model, ids, mask, tokens):
    """Prefill + teacher-forced decode on the plain path: [steps + 1, B, V]."""
    logits, cache = prefill(model, ids, mask)
    out = [logits]
    for tok in tokens:
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        out.append(decode_one_token(model, tok, mask, cache))
    return torch.stack(out)


def fast_logits(model, ids, mask, tokens, step=fast_decode_step, kv_dtype="auto", chunk=None):
    cache = new_static_cache(model, ids.shape[0], ids.shape[1] + len(tokens), kv_dtype)
    logits, cache = prefill(model, ids, mask, cache=cache, chunk_size=chunk)
    out = [logits]
    for tok in tokens:
        out.append(decode_one_token_fast(model, tok, cache, step))
    assert cache.length == ids.shape[1] + len(tokens)
    return torch.stack(out)


def compiled_step():
    """The compiled step the device runs (CUDA graphs); on CPU, the same trace without inductor."""
    if DEVICE.type == "cuda":
        return compiled_decode_step()
    return compiled_decode_step("aot_eager", None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_prefill_and_every_decode_step_match_reference(attention, dtype):
    model = make_model(attention, window=4).to(dtype)
    ids, mask = left_pad(prompts(), 0, DEVICE)
    tokens = list(torch.randint(0, 256, (9, 3), device=DEVICE))
    ref = reference_logits(model, ids, mask, tokens)
    for chunk in (None, 4):  # one prefill call, and chunks that split the padding
        fast = fast_logits(model, ids, mask, tokens, chunk=chunk)
        for t in range(len(ref)):
            assert rel_err(fast[t], ref[t]) < TOL[dtype], (chunk, t)


@pytest.mark.parametrize("attention", ["orthros", "full"])
def test_compiled_step_matches_reference(attention):
    """The step traced whole (fullgraph: no graph break, hence no host sync in it)."""
    model = make_model(attention, window=4)
    ids, mask = left_pad(prompts((7, 3)), 0, DEVICE)
    tokens = list(torch.randint(0, 256, (5, 2), device=DEVICE))
    ref = reference_logits(model, ids, mask, tokens)
    fast = fast_logits(model, ids, mask, tokens, step=compiled_step())
    tol = 1e-5 if DEVICE.type == "cpu" else 2e-3  # TF32 / fused kernels on the GPU
    assert rel_err(fast, ref) < tol


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_generate_fast_equals_plain(attention):
    model = make_model(attention, window=3)
    p = prompts((5, 12, 1), seed=1)
    plain = generate(model, p, max_new_tokens=10, fast=False)
    assert generate(model, p, max_new_tokens=10, fast=True, compile=False).tolist() == plain.tolist()
    assert generate(model, p, max_new_tokens=10, fast=True, compile=False, prefill_chunk_size=3).tolist() \
        == plain.tolist()


def test_generate_fast_stops_and_samples_like_plain():
    model = make_model(window=3)
    p = [[9, 8, 7], [1, 2, 3]]
    free = generate(model, p, max_new_tokens=10, fast=False)[0, 3:].tolist()
    kw = dict(max_new_tokens=10, stop_tokens=[free[2]], pad_token_id=255)
    assert generate(model, p, fast=True, **kw).tolist() == generate(model, p, fast=False, **kw).tolist()
    kw = dict(max_new_tokens=12, temperature=1.0, top_k=20, seed=3)
    assert generate(model, p, fast=True, **kw).tolist() == generate(model, p, fast=False, **kw).tolist()


# fp8 e4m3 has 3 mantissa bits (relative rounding <= 1/16 per element); on these
# tiny random models the logits move by a few percent and the argmax rarely flips.
FP8_LOGIT_REL_ERR = 0.08
FP8_TOP1_AGREEMENT = 0.9


@pytest.mark.parametrize("attention", ["orthros", "full"])
def test_fp8_cache_agrees_with_full_precision_cache(attention):
    torch.manual_seed(0)
    model = make_model(attention, window=8)
    ids, mask = left_pad(prompts((40, 64, 17), seed=2), 0, DEVICE)
    tokens = list(torch.randint(0, 256, (24, 3), device=DEVICE))
    ref = fast_logits(model, ids, mask, tokens)
    fp8 = fast_logits(model, ids, mask, tokens, kv_dtype="fp8", chunk=16)
    assert torch.isfinite(fp8).all()
    assert rel_err(fp8, ref) < FP8_LOGIT_REL_ERR
    agree = (fp8.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= FP8_TOP1_AGREEMENT
    assert rel_err(fp8, ref) > 0  # the cache really is quantized


def test_fp8_storage_scales_and_saturation():
    model = make_model(window=4)
    cache = new_static_cache(model, 1, 8, "fp8")
    assert cache.k[0].dtype == torch.float8_e4m3fn and cache.k[0].element_size() == 1
    L, Hkv, D = model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim
    k = torch.randn(1, 2, Hkv, D, device=DEVICE)
    cache.append_tokens(torch.zeros(1, 2, dtype=torch.long, device=DEVICE), torch.tensor([2], device=DEVICE),
                        torch.tensor([0], device=DEVICE))
    kb, _ = cache.update(0, k, k)
    s = cache.k_scale[0]
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))  # powers of two
    deq = kb.float() * s[:, None]
    assert (deq - k).abs().max() <= k.abs().max() / 8
    cache.decoding = True  # a later token 1000x larger saturates instead of turning into NaN
    cache.slot.fill_(2)
    kb, _ = cache.update(0, 1000 * k[:, :1], k[:, :1])
    assert torch.isfinite(kb.float()).all() and kb[0, 2].float().abs().max() == FP8_MAX


def test_user_errors():
    model = make_model()
    with pytest.raises(ValueError, match="kv_dtype"):
        generate(model, [[1, 2]], kv_dtype="int3", fast=True)
    with pytest.raises(ValueError, match="fast=True"):
        generate(model, [[1, 2]], kv_dtype="fp8", fast=False)
    cache = new_static_cache(model, 1, 3)
    ids = torch.tensor([[1, 2, 3]], device=DEVICE)
    logits, _ = prefill(model, ids, cache=cache)
    with pytest.raises(ValueError, match="cache is full"):
        decode_one_token_fast(model, logits.argmax(-1), cache)
    with pytest.raises(ValueError, match="holds 3 slots"):
        prefill(model, ids, cache=cache)
    assert isinstance(cache, StaticOrthrosCache) and cache.get_max_length() == 3


def test_the_compiled_step_is_made_with_triton_settled(monkeypatch):
    """Whether Triton imports is settled before the decode step is traced: a global first set inside
    the graph (the low-bit write asks it on CUDA) is a guard that fails on the next call (one more build)."""
    from orthros.ops.splitkv import common

    monkeypatch.setattr(common, "_TRITON", None)
    compiled_decode_step.cache_clear()
    try:
        compiled_decode_step("aot_eager", None)
        assert common._TRITON is not None
    finally:
        compiled_decode_step.cache_clear()
