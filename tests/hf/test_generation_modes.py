"""transformers' other decoding modes on Orthros: assisted generation and prompt lookup.

Both draft tokens, verify k of them with one k+1-output-position forward, and
crop the rejected ones from the OrthrosCache. The reference is greedy decoding
of the same model: with greedy verification the output must be identical.
(Beam search against transformers' Llama: tests/convert/test_convert.py.)
"""

import copy

import pytest
import torch

from orthros import OrthrosCache

from .test_hf import lively_model


@pytest.fixture
def spy(monkeypatch):
    """Records the output positions of every target-model forward and every crop."""
    seen = {"outputs": [], "crops": []}
    crop = OrthrosCache.crop

    def recording_crop(self, n):
        seen["crops"].append(n)
        return crop(self, n)

    monkeypatch.setattr(OrthrosCache, "crop", recording_crop)
    return seen


def watch(model, seen):
    return model.register_forward_hook(lambda m, a, kw, out: seen["outputs"].append(out.output_positions.shape[1]),
                                       with_kwargs=True)


def greedy(model, ids, n, **kw):
    return model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)


@pytest.mark.parametrize("attention", ["orthros", "full"])
def test_assisted_generation_equals_greedy(attention, spy):
    """A different draft model: some drafts accepted, some rejected and cropped."""
    model = lively_model(attention, window=3)
    draft = lively_model(attention, window=2, seed=1)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0)).to(model.device)
    want = greedy(model, ids, 16)
    handle = watch(model, spy)
    try:
        got = greedy(model, ids, 16, assistant_model=draft)
    finally:
        handle.remove()
    assert got.tolist() == want.tolist()
    assert max(spy["outputs"]) >= 3, "no multi-token verification happened"
    assert any(n < 0 for n in spy["crops"]), "no rejected draft was cropped"


def test_the_model_as_its_own_assistant_accepts_every_draft(spy):
    model = lively_model(window=3)
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(2)).to(model.device)
    want = greedy(model, ids, 12)
    twin = copy.deepcopy(model)
    handle = watch(model, spy)
    try:
        got = greedy(model, ids, 12, assistant_model=twin)
    finally:
        handle.remove()
    assert got.tolist() == want.tolist()
    # One target forward per round (the first with the prompt), verifying k drafts with k + 1
    # output positions; every draft is accepted, so each round adds k + 1 tokens, no crop.
    assert sum(spy["outputs"]) == 12 and len(spy["outputs"]) < 6 and max(spy["outputs"]) >= 3
    assert all(int(n) == 0 for n in spy["crops"])


def test_prompt_lookup_decoding_equals_greedy(spy):
    """Drafts copied from the prompt's n-grams; a repetitive prompt makes many."""
    model = lively_model(window=3)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10] * 3 + [5, 6]], device=model.device)
    want = greedy(model, ids, 14)
    handle = watch(model, spy)
    try:
        got = greedy(model, ids, 14, prompt_lookup_num_tokens=3)
    finally:
        handle.remove()
    assert got.tolist() == want.tolist()
    assert max(spy["outputs"]) == 4 and any(n < 0 for n in spy["crops"])
