"""generate(): greedy equals the argmax chain of full forwards; batching, sampling, stops."""

import pytest
import torch

from orthros.generate import SamplingConfig, generate, sample

from ..conftest import DEVICE, make_model


def greedy_by_full_forward(model, prompt, n):
    seq = prompt.clone()
    for _ in range(n):
        nxt = model(seq[None]).logits[0, -1].argmax()
        seq = torch.cat([seq, nxt[None]])
    return seq


@pytest.mark.parametrize("attention", ["orthros", "full", "swa"])
def test_greedy_matches_recomputation(attention):
    model = make_model(attention, window=3)
    prompt = torch.randint(0, 256, (11,), device=DEVICE)
    out = generate(model, prompt[None], max_new_tokens=9)
    assert out[0].tolist() == greedy_by_full_forward(model, prompt, 9).tolist()
    chunked = generate(model, prompt[None], max_new_tokens=9, prefill_chunk_size=4)
    assert chunked.tolist() == out.tolist()


def test_batched_prompts_of_different_lengths_equal_each_alone():
    model = make_model(window=3)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (5, 12, 1)]
    batched = generate(model, prompts, max_new_tokens=6)
    T = max(len(p) for p in prompts)
    for i, p in enumerate(prompts):
        alone = generate(model, [p], max_new_tokens=6)
        assert batched[i, T - len(p):].tolist() == alone[0].tolist()


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    model = make_model(window=3)
    p = [[1, 2, 3, 4]]
    kw = dict(max_new_tokens=20, temperature=1.0, top_p=0.95)
    a = generate(model, p, seed=1, **kw)
    b = generate(model, p, seed=1, **kw)
    c = generate(model, p, seed=2, **kw)
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()


def test_top_k_one_is_greedy():
    model = make_model(window=3)
    p = [[5, 6, 7]]
    assert generate(model, p, max_new_tokens=8, temperature=1.3, top_k=1, seed=0).tolist() == \
        generate(model, p, max_new_tokens=8).tolist()


def test_stop_tokens_and_padding_after_stop():
    model = make_model(window=3)
    p = [[9, 8, 7]]
    free = generate(model, p, max_new_tokens=10)[0, 3:].tolist()
    stop = free[2]
    out = generate(model, p, max_new_tokens=10, stop_tokens=[stop], pad_token_id=255)[0, 3:].tolist()
    first = free.index(stop)
    assert out[: first + 1] == free[: first + 1]
    assert len(out) == first + 1  # the only row stopped, so generation ended
    two = generate(model, [[9, 8, 7], [1, 2, 3]], max_new_tokens=10, stop_tokens=[stop], pad_token_id=255)
    row = two[0, 3:].tolist()
    assert row[: first + 1] == free[: first + 1] and all(t == 255 for t in row[first + 1:])


def test_max_new_tokens_zero_returns_prompt():
    model = make_model()
    x = torch.randint(0, 256, (1, 5), device=DEVICE)
    assert generate(model, x, max_new_tokens=0).tolist() == x.tolist()


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, SamplingConfig(1.0, None, 0.7), g)) for _ in range(200)}
    assert draws == {0, 1}


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-1.0), "temperature"), (dict(top_k=0), "top_k"), (dict(top_p=1.5), "top_p"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
])
def test_bad_generation_arguments(kw, match):
    model = make_model()
    with pytest.raises(ValueError, match=match):
        generate(model, [[1, 2]], **kw)


def test_empty_prompt_is_an_error():
    with pytest.raises(ValueError, match="at least one token"):
        generate(make_model(), [[1, 2], []])
