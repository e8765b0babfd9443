"""SPEC §2's invariants for a model with attention sinks (`sink_tokens`), on every cache that keeps them."""

import pytest
import torch

from orthros.generate import decode_one_token, decode_one_token_fast, generate, left_pad, new_static_cache, prefill

from ..conftest import DEVICE, make_model, rel_err

TOL = 1e-5


def ids_for(T, B=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, T), generator=g).to(DEVICE)


@pytest.mark.parametrize("attention", ["orthros", "swa"])
def test_sinks_change_the_windowed_model_and_phases_agree(attention):
    model = make_model(attention, window=4, sink_tokens=2)
    plain = make_model(attention, window=4)
    ids = ids_for(40, seed=1)
    ref = model(ids).logits[0]
    assert rel_err(ref, plain(ids).logits[0]) > 1e-3  # the sinks are read
    assert rel_err(ref[:4], plain(ids).logits[0, :4]) < TOL  # ... only once the window has left them (t >= W)
    # SFT-like subset, chunked prefill, then token-by-token decode on the dynamic cache
    idx = torch.tensor([3, 17, 31], device=DEVICE)
    assert rel_err(model(ids, logits_to_keep=idx).logits[0], ref[idx]) < TOL
    logits, cache = prefill(model, ids[:, :20], chunk_size=7)
    assert rel_err(logits[0], ref[19]) < TOL
    for t in range(20, 40):
        logits = decode_one_token(model, ids[0, t:t + 1], None, cache)
        assert rel_err(logits[0], ref[t]) < TOL, t


def test_sinks_with_padding_and_packing():
    model = make_model(window=3, sink_tokens=2)
    seqs = [ids_for(n, seed=n)[0] for n in (13, 6, 1)]
    T = 13
    ids = torch.zeros(3, T, dtype=torch.long, device=DEVICE)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):  # left padding: each row's first real token is its sink
        ids[i, T - len(s):], mask[i, T - len(s):] = s, 1
    batched = model(ids, attention_mask=mask).logits
    for i, s in enumerate(seqs):
        assert rel_err(batched[i][mask[i].bool()], model(s[None]).logits[0]) < TOL, i
    packed = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None].to(DEVICE)
    out, start = model(packed, position_ids=pos).logits[0], 0
    for s in seqs:  # every document has its own sinks
        assert rel_err(out[start:start + len(s)], model(s[None]).logits[0]) < TOL
        start += len(s)


def test_window_and_sinks_covering_the_sequence_is_the_full_model():
    T = 30
    full = make_model("full", window=4)
    for w, s in ((4, T), (T, 3)):
        model = make_model("orthros", window=w, sink_tokens=s, perturb_so=False)
        model.load_state_dict(full.state_dict(), strict=False)
        ids = ids_for(T, B=2)
        assert rel_err(model(ids).logits, full(ids).logits) < TOL


def test_generate_on_both_dense_caches():
    model = make_model(window=4, sink_tokens=2)
    ids = ids_for(12, seed=3)
    ref = ids
    for _ in range(5):  # greedy from full forwards
        ref = torch.cat([ref, model(ref).logits[:, -1].argmax(-1, keepdim=True)], 1)
    for fast in (False, True):  # the dynamic cache; the static cache and its decode step (custom op)
        out = generate(model, ids, max_new_tokens=5, temperature=0.0, fast=fast, compile=False,
                       prefill_chunk_size=5)
        assert torch.equal(out, ref), fast


@pytest.mark.parametrize("kv_dtype", ["int4", "int2"])
def test_low_bit_cache_keeps_sinks(kv_dtype):
    """The low-bit cache's base stream reads the sinks from its bf16 sink slots (a prefill chunk's
    window gets them before its keys; a decode step's low-bit read takes them): logits do not depend
    on chunking or decoding, stay as close to the bf16 cache's as without sinks, and are far from a
    model that ignores the sinks; a left-padded batch is refused."""
    from ..generation.test_lowbit_cache import REL_ERR, chunked_logits, lowbit_cache

    model = make_model(window=8, sink_tokens=2)
    plain = make_model(window=8)
    plain.load_state_dict(model.state_dict())
    ids = ids_for(90, seed=1)
    ref = chunked_logits(model, ids, None, lowbit_cache(model, 1, 90, kv_dtype), 90)
    for chunk in (16, 37):
        assert rel_err(chunked_logits(model, ids, None, lowbit_cache(model, 1, 90, kv_dtype), chunk), ref) < 1e-4
    quantization = rel_err(ref, chunked_logits(model, ids, None, new_static_cache(model, 1, 90, "bf16"), 90))
    assert 1e-4 < quantization < REL_ERR[kv_dtype]
    no_sinks = rel_err(chunked_logits(plain, ids, None, lowbit_cache(plain, 1, 90, kv_dtype), 90), ref)
    assert no_sinks > 3 * quantization, (no_sinks, quantization)  # the sinks are read
    cache = lowbit_cache(model, 1, 90, kv_dtype)
    logits, _ = prefill(model, ids[:, :40], None, cache=cache, chunk_size=13)
    steps = [logits]
    for t in range(40, 89):
        steps.append(decode_one_token_fast(model, ids[:, t], cache))
    assert rel_err(torch.stack(steps, 1), ref[:, 39:89]) < 0.2 * quantization
    out = generate(model, ids[:, :30], max_new_tokens=4, temperature=0.0, fast=True, compile=False, kv_dtype=kv_dtype)
    assert out.shape == (1, 34)
    ids2, mask = left_pad([ids[0, :20].tolist(), ids[0, :30].tolist()], 0, DEVICE)
    with pytest.raises(NotImplementedError, match="LowBitStaticCache keeps attention sinks.*left-padded"):
        generate(model, ids2, mask, max_new_tokens=2, fast=True, compile=False, kv_dtype=kv_dtype)


def test_sink_tokens_is_validated():
    from orthros.models.config import OrthrosConfig

    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="OrthrosConfig.sink_tokens"):
            OrthrosConfig.from_name("tiny", sink_tokens=bad)
    cfg = OrthrosConfig.from_name("tiny", sink_tokens=4)
    assert OrthrosConfig.from_dict(cfg.to_dict()).sink_tokens == 4
    assert OrthrosConfig.from_name("tiny").sink_tokens == 0
