"""transformers integration: Auto classes, save/load, and transformers' own generate().

transformers' `generate()` must give what `orthros.generate.generate()` gives:
both run a linear-time prefill (one output position) and then one
(base, output) pair per step on an OrthrosCache.
"""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from orthros import OrthrosCache, OrthrosForCausalLM
from orthros.generate import generate as _generate
from orthros.models.compat import GENERATE_CACHE_KEY

from ..conftest import DEVICE, make_model


def lively_model(attention="orthros", window=3, **kw):
    """A tiny model with large weights, so greedy decoding does not collapse into repeats."""
    model = make_model(attention, window=window, initializer_range=0.5, **kw)
    return model


def left_padded(B=3, T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, T), generator=g)
    mask = torch.ones_like(ids)
    for b in range(1, B):
        mask[b, : 2 * b] = 0  # rows of different lengths, padded on the left
    ids = ids.masked_fill(mask == 0, 0)
    return ids.to(DEVICE), mask.to(DEVICE)


def generate(model, *args, **kw):
    """orthros.generate on the same OrthrosCache path transformers uses (not the static-cache fast path)."""
    return _generate(model, *args, fast=False, **kw)


def hf_generate(model, ids, mask, **kw):
    return model.generate(ids, attention_mask=mask, pad_token_id=0, **kw)


def test_auto_classes_load_what_save_pretrained_writes(tmp_path):
    for tie in (True, False):
        model = make_model(tie_word_embeddings=tie)
        model.save_pretrained(tmp_path / str(tie))
        files = sorted(p.name for p in (tmp_path / str(tie)).iterdir())
        assert "config.json" in files and "model.safetensors" in files
        assert AutoConfig.from_pretrained(tmp_path / str(tie)).model_type == "orthros"
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / str(tie)).to(DEVICE).eval()
        assert type(loaded) is OrthrosForCausalLM
        assert loaded.config.tie_word_embeddings == tie
        ids, mask = left_padded()
        with torch.no_grad():
            a = model(ids, attention_mask=mask).logits
            b = loaded(ids, attention_mask=mask).logits
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("attention", ["orthros", "full", "swa"])
def test_hf_greedy_equals_orthros_generate_batched_left_padded(attention):
    model = lively_model(attention)
    ids, mask = left_padded()
    ours = generate(model, ids, attention_mask=mask, max_new_tokens=10)
    theirs = hf_generate(model, ids, mask, max_new_tokens=10, do_sample=False)
    assert len(set(ours[:, -10:].flatten().tolist())) > 5, "degenerate continuation: test would not discriminate"
    assert theirs.tolist() == ours.tolist()


def test_hf_greedy_equals_the_argmax_of_a_teacher_forced_forward():
    """Regression: on transformers 5.24 generate() passed the cache as `cache=`, which the
    model ignored, so each step ran without the past and greedy tokens were wrong."""
    model = lively_model()
    ids, mask = left_padded()
    seq = hf_generate(model, ids, mask, max_new_tokens=8, do_sample=False)
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], 8)], 1)
    with torch.no_grad():
        logits = model(seq, attention_mask=full_mask).logits
    T = ids.shape[1]
    assert seq[:, T:].tolist() == logits[:, T - 1:-1].argmax(-1).tolist()


def test_hf_sampling_equals_orthros_sampling_with_the_same_seed():
    """Both draw with torch.multinomial from softmax(logits / T) after the same top-k
    filter; transformers uses the global generator, orthros a private one seeded alike."""
    model = lively_model()
    ids, mask = left_padded()
    kw = dict(max_new_tokens=12, temperature=0.9, top_k=40)
    ours = generate(model, ids, attention_mask=mask, seed=123, **kw)
    torch.manual_seed(123)
    theirs = hf_generate(model, ids, mask, do_sample=True, **kw)
    assert theirs.tolist() == ours.tolist()
    torch.manual_seed(124)
    other = hf_generate(model, ids, mask, do_sample=True, **kw)
    assert other.tolist() != ours.tolist()


def test_hf_top_p_sampling_is_reproducible():
    model = lively_model()
    ids, mask = left_padded()
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(hf_generate(model, ids, mask, do_sample=True, top_p=0.9, top_k=None, max_new_tokens=8).tolist())
    assert runs[0] == runs[1]


def test_hf_generate_stops_at_eos_like_orthros_generate():
    model = lively_model()
    ids, mask = left_padded(B=2)
    free = generate(model, ids, attention_mask=mask, max_new_tokens=10)
    eos = int(free[0, -10 + 3])  # row 0's 4th new token
    ours = generate(model, ids, attention_mask=mask, max_new_tokens=10, stop_tokens=[eos], pad_token_id=0)
    theirs = hf_generate(model, ids, mask, max_new_tokens=10, do_sample=False, eos_token_id=eos)
    assert theirs.tolist() == ours.tolist()


def test_four_tokens_at_once_equal_three_then_one_from_the_returned_cache():
    model = lively_model()
    ids, mask = left_padded()
    four = hf_generate(model, ids, mask, max_new_tokens=4, do_sample=False)
    out = hf_generate(model, ids, mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    cache = out[GENERATE_CACHE_KEY]
    assert isinstance(cache, OrthrosCache)
    assert cache.get_seq_length() == ids.shape[1] + 2  # the last new token is not in the cache yet
    mask3 = torch.cat([mask, mask.new_ones(mask.shape[0], 3)], dim=1)
    more = hf_generate(model, out.sequences, mask3, max_new_tokens=1, do_sample=False, **{GENERATE_CACHE_KEY: cache})
    assert more.tolist() == four.tolist()
    assert cache.get_seq_length() == ids.shape[1] + 3


def test_hf_generate_prefill_has_one_output_position():
    """transformers passes logits_to_keep=1: the prefill computes one output token (linear time)."""
    model = lively_model()
    ids, mask = left_padded()
    seen = []
    handle = model.register_forward_hook(lambda m, args, kwargs, out: seen.append(
        (kwargs["input_ids"].shape[1], out.output_positions.shape[1])), with_kwargs=True)
    try:
        hf_generate(model, ids, mask, max_new_tokens=3, do_sample=False)
    finally:
        handle.remove()
    assert seen == [(ids.shape[1], 1), (1, 1), (1, 1)]


def test_the_cache_under_both_of_transformers_names():
    """forward() takes the cache as `past_key_values` (transformers 5.17) or `cache` (later
    releases) and its output answers to both names."""
    model = lively_model()
    ids, mask = left_padded()
    with torch.no_grad():
        a = model(ids, attention_mask=mask, past_key_values=model.new_cache(), use_cache=True)
        b = model(ids, attention_mask=mask, cache=model.new_cache(), use_cache=True)
    assert a.cache is a.past_key_values and b.cache.get_seq_length() == ids.shape[1]
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="once"):
        model(ids, cache=model.new_cache(), past_key_values=model.new_cache())


def test_foreign_caches():
    model = make_model()
    ids = torch.randint(0, 256, (1, 5), device=DEVICE)
    out = model(ids, past_key_values=DynamicCache(), use_cache=True)  # empty: replaced
    assert isinstance(out.cache, OrthrosCache) and out.cache.get_seq_length() == 5
    filled = DynamicCache()
    filled.update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), 0)
    with pytest.raises(ValueError, match="OrthrosCache"):
        model(ids, past_key_values=filled)
    with pytest.raises(ValueError, match="cache_implementation='static' is not supported.*fast=True"):
        model.generate(ids, max_new_tokens=2, cache_implementation="static")


def test_cache_follows_beam_reordering_and_batch_selection():
    model = make_model()
    ids, mask = left_padded()
    cache = model.new_cache()
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    alone = model.new_cache()
    with torch.no_grad():
        model(ids[2:3], attention_mask=mask[2:3], past_key_values=alone, use_cache=True)
    cache.reorder_cache(torch.tensor([2, 2, 0], device=DEVICE))
    assert cache.batch_size == 3 and len(cache) == model.config.num_hidden_layers
    torch.testing.assert_close(cache.layers[0].keys[0], alone.layers[0].keys[0])
    torch.testing.assert_close(cache.next_pos[:2], alone.next_pos.expand(2))
    cache.batch_repeat_interleave(2)
    assert cache.batch_size == 6 and cache.key_doc.shape == (6, ids.shape[1])
    assert cache.is_croppable and not cache.is_compileable and cache.is_sliding == [False] * 2
