"""OrthrosCache: transformers' cache layout and utilities, exact cropping, torch pytrees.

References: a cache built by the shorter call (cropping), transformers' own
DynamicCache filled by the Llama with the same weights (layout), the rows
selected by hand (batch utilities).
"""

import pytest
import torch
import torch.utils._pytree as pytree
from transformers.cache_utils import DynamicLayer

from orthros import OrthrosCache

from ..conftest import DEVICE, llama_twin, make_model


def left_padded(B=2, T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, T), generator=g).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


def filled(model, ids, mask=None, position_ids=None, chunks=(None,)):
    """A cache after running ids [B, T] in the given chunk boundaries (None = one call)."""
    cache = model.new_cache()
    bounds = [0, *[c for c in chunks if c is not None], ids.shape[1]]
    with torch.no_grad():
        for a, b in zip(bounds, bounds[1:]):
            model(ids[:, a:b], attention_mask=None if mask is None else mask[:, :b],
                  position_ids=None if position_ids is None else position_ids[:, a:b], past_key_values=cache,
                  use_cache=True)
    return cache


def assert_same_cache(a: OrthrosCache, b: OrthrosCache, exact=True):
    assert a.get_seq_length() == b.get_seq_length()
    for name in ("key_doc", "key_pos", "next_pos", "last_doc"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for la, lb in zip(a.layers, b.layers):
        if exact:
            assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
        else:
            torch.testing.assert_close(la.keys, lb.keys)
            torch.testing.assert_close(la.values, lb.values)


def next_logits(model, cache, token, mask=None):
    with torch.no_grad():
        return model(token, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1).logits


def test_layers_are_transformers_dynamic_layers_holding_llamas_kv():
    """K/V sit in `cache.layers[i].keys / .values` as [B, Hkv, S, D], equal to what the Llama
    with the same weights puts in its DynamicCache (W >= T, SO at identity)."""
    model = make_model(window=64, perturb_so=False)
    ids = torch.randint(0, 256, (2, 11), device=DEVICE)
    with torch.no_grad():
        ours = model(ids, use_cache=True).past_key_values
        theirs = llama_twin(model)(ids, use_cache=True)
    theirs = theirs.cache if "cache" in theirs else theirs["past_key_values"]
    c = model.config
    assert len(ours.layers) == len(theirs.layers) == c.num_hidden_layers
    for a, b in zip(ours.layers, theirs.layers):
        assert type(a) is DynamicLayer and a.keys.shape == (2, c.num_key_value_heads, 11, c.head_dim)
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)
    assert ours.get_seq_length() == theirs.get_seq_length() == 11
    assert ours.get_mask_sizes(1, 0) == theirs.get_mask_sizes(1, 0)


def test_batch_utilities_select_rows_of_kv_and_state():
    model = make_model(window=3)
    ids, mask = left_padded(B=3)
    cache = filled(model, ids, mask)
    rows = torch.tensor([2, 0, 0], device=DEVICE)
    want = [(layer.keys[rows], layer.values[rows]) for layer in cache.layers]
    state = {n: getattr(cache, n)[rows] for n in ("key_doc", "key_pos", "next_pos", "last_doc")}
    cache.reorder_cache(rows)
    for layer, (k, v) in zip(cache.layers, want):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    for n, t in state.items():
        assert torch.equal(getattr(cache, n), t), n
    cache.batch_repeat_interleave(2)
    assert cache.batch_size == 6 and cache.layers[0].keys.shape[0] == 6
    assert torch.equal(cache.next_pos, state["next_pos"].repeat_interleave(2))
    cache.batch_select_indices(torch.tensor([1, 4], device=DEVICE))
    assert torch.equal(cache.key_doc, state["key_doc"][[0, 2]])
    assert torch.equal(cache.layers[1].keys, want[1][0][[0, 2]])


@pytest.mark.parametrize("attention", ["orthros", "full", "swa"])
def test_crop_equals_the_cache_of_the_shorter_call(attention):
    """Dropping the last k slots leaves exactly the cache of the call without those tokens
    (a base token's K/V depend only on tokens <= t), and decoding continues alike: the
    rows' next RoPE position (left padding) is restored from the remaining slots."""
    model = make_model(attention, window=3)
    ids, mask = left_padded()
    short = filled(model, ids[:, :6], mask[:, :6])
    long = filled(model, ids, mask, chunks=(6,))
    assert long.get_seq_length() == 9 and not torch.equal(long.next_pos, short.next_pos)
    long.crop(-3)
    assert_same_cache(long, short)
    tok = ids[:, 6:7]
    torch.testing.assert_close(next_logits(model, long, tok), next_logits(model, short, tok), rtol=0, atol=0)


def test_crop_inside_one_call_and_across_packed_documents():
    """Slots written by one call, cut inside it; the cut crosses a document boundary
    (packed rows): the current document and position come back from the kept slots."""
    model = make_model(window=3)
    ids = torch.randint(0, 256, (1, 9), device=DEVICE)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]], device=DEVICE)
    long = filled(model, ids, position_ids=pos)
    short = filled(model, ids[:, :5], position_ids=pos[:, :5])
    long.crop(-4)
    assert long.last_doc.tolist() == [1] and long.next_pos.tolist() == [1]
    assert_same_cache(long, short, exact=False)
    tok = ids[:, 5:6]  # continues document 1 at position 1 (no position ids given)
    torch.testing.assert_close(next_logits(model, long, tok), next_logits(model, short, tok))


def test_crop_edge_cases():
    model = make_model(window=3)
    ids, mask = left_padded()
    cache = filled(model, ids, mask)
    before = [layer.keys.clone() for layer in cache.layers]
    cache.crop(0)
    assert cache.get_seq_length() == 9 and all(torch.equal(a.keys, b) for a, b in zip(cache.layers, before))
    with pytest.raises(ValueError, match="negative"):
        cache.crop(2)
    with pytest.raises(ValueError, match="holds 9"):
        cache.crop(-10)
    cache.crop(-9)
    assert cache.get_seq_length() == 0 and not cache.is_initialized
    with torch.no_grad():  # an emptied cache starts over
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    assert_same_cache(cache, filled(model, ids, mask))


def test_pytree_round_trip():
    """An OrthrosCache is a torch pytree (torch.export takes and returns one)."""
    model = make_model(window=3)
    ids, mask = left_padded()
    cache = filled(model, ids, mask)
    leaves, spec = pytree.tree_flatten(cache)
    assert len(leaves) == 2 * model.config.num_hidden_layers + 4
    assert_same_cache(pytree.tree_unflatten(leaves, spec), cache)
    empty = pytree.tree_unflatten(*pytree.tree_flatten(model.new_cache()))
    assert isinstance(empty, OrthrosCache) and empty.get_seq_length() == 0
