"""Retrieval samples: the loss sits on the answer, which the haystack holds; training and
evaluation keys never meet."""

import random

import numpy as np
import pytest

from orthros.convert.tiny import tiny_tokenizer
from orthros.data.retrieval import KEY_MOD, KINDS, eval_key, retrieval_rows, sample, train_key


@pytest.fixture(scope="module")
def tok():
    t = tiny_tokenizer(vocab_size=400)
    t.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                       "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return t


def test_the_answer_is_the_target_and_the_haystack_holds_it(tok):
    stream = np.asarray(tok("def f(x):\n    return x + 1\n" * 400)["input_ids"], np.int32)
    rng = np.random.default_rng(0)
    for kind in KINDS:
        ids, mask = sample(tok, stream, 300, kind, rng)
        assert len(ids) == len(mask) and any(mask) and not mask[0]
        first = mask.index(True)
        answer = ids[first : first + sum(mask)]
        if kind == "copy":
            assert answer == ids[-len(answer):] and any(ids[i : i + len(answer)] == answer
                                                        for i in range(first - len(answer)))
        else:
            text = tok.decode(answer, skip_special_tokens=True).strip()
            assert text.isdigit() and int(text) % KEY_MOD == 0
            assert text in tok.decode(ids[:first])  # the question's answer is in the prompt


def test_rows_are_full_and_mask_the_text_after_the_sample(tok):
    stream = np.asarray(tok("some text here. " * 3000)["input_ids"], np.int32)
    rows, mask = retrieval_rows(tok, stream, 6, 512, np.random.default_rng(1), (100, 300))
    assert rows.shape == mask.shape == (6, 512) and mask[:, -1].all()
    assert (rows[:, -100:] != 0).any()


def test_training_and_evaluation_keys_are_disjoint():
    rng, r = np.random.default_rng(0), random.Random(0)
    train = {train_key(rng) for _ in range(2000)}
    evals = {eval_key(r) for _ in range(2000)}
    assert not train & evals and all(len(k) == 5 for k in train | evals)
