"""Retrieval samples: the loss sits on the answer, which the haystack holds; training and
evaluation keys never meet."""

import random

import numpy as np

from orthros.data.retrieval import KEY_MOD, KINDS, eval_key, retrieval_rows, sample, train_key


def test_the_answer_is_the_target_and_the_haystack_holds_it(chat_tok):
    stream = np.asarray(chat_tok("def f(x):\n    return x + 1\n" * 400)["input_ids"], np.int32)
    rng = np.random.default_rng(0)
    for kind in KINDS:
        ids, mask = sample(chat_tok, stream, 300, kind, rng)
        assert len(ids) == len(mask) and any(mask) and not mask[0]
        first = mask.index(True)
        answer = ids[first : first + sum(mask)]
        if kind == "copy":
            assert answer == ids[-len(answer):] and any(ids[i : i + len(answer)] == answer
                                                        for i in range(first - len(answer)))
        else:
            text = chat_tok.decode(answer, skip_special_tokens=True).strip()
            assert text.isdigit() and int(text) % KEY_MOD == 0
            assert text in chat_tok.decode(ids[:first])  # the question's answer is in the prompt


def test_rows_are_full_and_mask_the_text_after_the_sample(chat_tok):
    stream = np.asarray(chat_tok("some text here. " * 3000)["input_ids"], np.int32)
    rows, mask = retrieval_rows(chat_tok, stream, 6, 512, np.random.default_rng(1), (100, 300))
    assert rows.shape == mask.shape == (6, 512) and mask[:, -1].all()
    assert (rows[:, -100:] != 0).any()


def test_training_and_evaluation_keys_are_disjoint():
    rng, r = np.random.default_rng(0), random.Random(0)
    train = {train_key(rng) for _ in range(2000)}
    evals = {eval_key(r) for _ in range(2000)}
    assert not train & evals and all(len(k) == 5 for k in train | evals)


def _spans(mask: list[bool]) -> list[tuple[int, int]]:
    """[start, stop) of each run of True"""
    edges = np.flatnonzero(np.diff(np.r_[0, np.asarray(mask, np.int8), 0]))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def test_a_lookup_asks_several_facts_in_turn(chat_tok):
    """questions=N: up to N facts asked one chat turn each; every answer (and only the answers,
    with their end-of-turn tokens) is a target, and each is the value the text gives its name."""
    stream = np.asarray(chat_tok("def f(x):\n    return x + 1\n" * 400)["input_ids"], np.int32)
    rng = np.random.default_rng(3)
    one, m1 = sample(chat_tok, stream, 400, "lookup", np.random.default_rng(3))
    ids, mask = sample(chat_tok, stream, 400, "lookup", rng, questions=3)
    spans = _spans(mask)
    assert len(spans) == 3 and len(_spans(m1)) == 1
    text = chat_tok.decode(ids, skip_special_tokens=True)
    asked = []
    for a, b in spans:
        value = chat_tok.decode(ids[a:b], skip_special_tokens=True).strip()
        before = chat_tok.decode(ids[:a], skip_special_tokens=True)
        name = before.rsplit("What is the value of ", 1)[1].split("?")[0]
        assert value.isdigit() and f"The value of {name} is {value}. " in text
        asked.append(name)
    assert len(set(asked)) == 3
    assert sum(m1) < sum(mask) and len(one) < len(ids)  # one question: one answer, a shorter conversation
