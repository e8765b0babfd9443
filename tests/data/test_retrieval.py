"""Retrieval samples: the loss sits on the answer, which the haystack holds (or, for docqa, the
teacher gives); training and evaluation keys never meet."""

import random
import re

import numpy as np
import pytest

from orthros.data.retrieval import (ALL_KINDS, KEY_MOD, KINDS, VARIED_FACTS, VARIED_NOUNS, VARIED_QUESTIONS,
                                    VARIED_UNITS, _no_loop, answer_mask, eval_key, retrieval_rows, sample, train_key)


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


def test_answer_mask_finds_each_sample_s_answers_and_no_filling_text(chat_tok):
    """answer_mask recovers, from a row's target mask alone, exactly the targets `sample` made (its
    answers), the text filling the row after the sample excluded; a row of text has none; a sample
    cut at the row's end keeps its answers."""
    stream = np.asarray(chat_tok("some text here. " * 3000)["input_ids"], np.int32)
    rows, mask = retrieval_rows(chat_tok, stream, 6, 512, np.random.default_rng(1), (100, 300))
    rng = np.random.default_rng(1)  # the draws retrieval_rows made, again
    ans = answer_mask(mask)
    for r in range(6):
        L = int(rng.integers(100, 300 + 1))
        ids, m = sample(chat_tok, stream, L, KINDS[r % len(KINDS)], rng)
        want = np.zeros(512, bool)
        want[: len(m)] = m
        assert (ans[r] == want).all() and want.any()
    assert not answer_mask(np.ones((2, 64), bool)).any()
    cut = np.zeros(64, bool)
    cut[40:50] = cut[60:63] = True  # a sample to the row's last position but one, then the EOS
    assert (answer_mask(cut[None])[0] == cut).all()


@pytest.mark.parametrize("kind", ["passkey", "lookup"])
def test_phrase_answers_are_sentences_the_needle_holds_with_the_same_draws(chat_tok, kind):
    """phrase=True: each answer is "The <noun> is <key>." / "The value of <name> is <v>.", the same
    sentence the text holds, with the same key; a pass key's prompt (the draws) is the bare-key
    sample's (a lookup of several questions leaves room for the longer answers)."""
    stream = np.asarray(chat_tok("some text here. " * 3000)["input_ids"], np.int32)
    bare = sample(chat_tok, stream, 400, kind, np.random.default_rng(5), questions=3)
    said = sample(chat_tok, stream, 400, kind, np.random.default_rng(5), questions=3, phrase=True)
    a_bare, a_said = [chat_tok.decode([t for t, m in zip(ids, mask) if m]) for ids, mask in (bare, said)]
    first = said[1].index(True)
    assert kind == "lookup" or said[0][:first] == bare[0][:first]
    prompt = chat_tok.decode(said[0][:first])
    sentences = re.findall(r"The [a-z ]+ is \d+\.", a_said)
    assert len(sentences) == (1 if kind == "passkey" else 3) and "The" not in a_bare
    for sent in sentences:
        noun, key = re.fullmatch(r"The ([a-z ]+) is (\d+)\.", sent).groups()
        assert key in a_bare and re.search(rf"(?i)the {noun} is {key}", prompt)


def test_varied_pass_keys_are_worded_many_ways_the_answer_held_and_never_the_demo_probe_s(chat_tok):
    """varied=True: a pass key's fact and question in many wordings; the answer is a sentence that names
    what the question names and ends with the key the prompt holds; the demo probe's words (its noun,
    its unit) are in no wording, so the demo stays a test of words no row holds."""
    from orthros.demo.real import FACT, FACT_QUESTION

    words = " ".join(VARIED_NOUNS + VARIED_UNITS + VARIED_FACTS + VARIED_QUESTIONS).lower()
    assert "archive" not in words and "chapter" not in words
    assert "archive code" in FACT and "chapter" in FACT_QUESTION  # (what the line above keeps out)
    stream = np.asarray(chat_tok("some text here. " * 3000)["input_ids"], np.int32)
    rng, seen = np.random.default_rng(3), set()
    for _ in range(40):
        ids, mask = sample(chat_tok, stream, 300, "passkey", rng, varied=True)
        first = mask.index(True)
        prompt, ans = chat_tok.decode(ids[:first]), chat_tok.decode([t for t, m in zip(ids, mask) if m])
        noun, unit, key = re.fullmatch(r"The ([a-z ]+?)(?: of this ([a-z]+))? is (\d+)\.\s*\S*", ans.strip()).groups()
        assert noun in VARIED_NOUNS and int(key) % KEY_MOD == 0 and key in prompt
        assert prompt.lower().count(noun) >= 2 and (unit is None or unit in prompt.rsplit("\n", 1)[-1])
        seen.add((noun, unit))
    assert len(seen) >= 15  # many wordings in 40 draws
    default = sample(chat_tok, stream, 300, "passkey", np.random.default_rng(3), phrase=True)
    again = sample(chat_tok, stream, 300, "passkey", np.random.default_rng(3), phrase=True, varied=False)
    assert default == again  # the fixed needles' rows are drawn as before


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


@pytest.mark.parametrize("phrase", [False, True])
def test_a_compound_fact_is_named_by_two_words_each_shared_with_another_fact(chat_tok, phrase):
    """A compound sample's facts fill a grid of adjectives by places: the asked thing's adjective and its
    place each name another fact too, so one word does not find the answer; every answer is the value
    the text gives the whole name, a training key, in a sentence with `phrase`."""
    from orthros.data.retrieval import ADJECTIVES, PLACES

    stream = np.asarray(chat_tok("def f(x):\n    return x + 1\n" * 400)["input_ids"], np.int32)
    ids, mask = sample(chat_tok, stream, 500, "compound", np.random.default_rng(5), questions=3, phrase=phrase)
    text = chat_tok.decode(ids, skip_special_tokens=True)
    facts = dict((f"{a} {p}", v) for a, p, v in re.findall(
        rf"(?:the|The) ({'|'.join(ADJECTIVES)}) ({'|'.join(PLACES)}),? (?:is described in report|see report) (\d+)", text))
    facts.update((f"{a} {p}", v) for v, a, p in re.findall(
        rf"Report (\d+) is about the ({'|'.join(ADJECTIVES)}) ({'|'.join(PLACES)})", text))
    adjs, places = {t.split()[0] for t in facts}, {t.split()[1] for t in facts}
    assert len(facts) == len(adjs) * len(places) >= 4 and len(adjs) >= 2 and len(places) >= 2
    spans = _spans(mask)
    assert len(spans) == 3
    for a, b in spans:
        answer = chat_tok.decode(ids[a:b], skip_special_tokens=True).strip()
        thing = chat_tok.decode(ids[:a], skip_special_tokens=True).rsplit("Which report is about the ", 1)[1]
        thing = thing.split("?")[0]
        value = answer.rsplit(" ", 1)[-1].rstrip(".") if phrase else answer
        assert value == facts[thing] and int(value) % KEY_MOD == 0
        assert answer.startswith(f"The {thing} is described in report") if phrase else answer.isdigit()
        a_, p_ = thing.split()
        assert sum(t.startswith(a_ + " ") for t in facts) >= 2 and sum(t.endswith(" " + p_) for t in facts) >= 2


CODE = "".join(f"def helper_{i}(x):\n    return x + {i}\n\n" for i in range(60))


def test_docqa_answers_are_the_teachers_and_ask_about_the_text(chat_tok):
    """A docqa sample asks about things defined in its text; the targets are exactly the teacher's
    answers (and their end-of-turn tokens), one turn each; a question the teacher has no answer
    to is dropped."""
    stream = np.asarray(chat_tok(CODE * 4)["input_ids"], np.int32)
    asked, replies = [], iter(["It adds seven to its argument.", None, "It returns x plus three."])

    def answer(prompt_ids):
        asked.append(chat_tok.decode(prompt_ids))
        return next(replies)

    ids, mask = sample(chat_tok, stream, 400, "docqa", np.random.default_rng(0), questions=2, answer=answer)
    assert len(asked) == 3 and len(ids) == len(mask)
    for prompt in asked:
        name = prompt.rsplit("`", 2)[-2]  # What does `helper_N` in the text above do?
        assert name.startswith("helper_") and f"def {name}(" in prompt
    targets = chat_tok.decode([t for t, m in zip(ids, mask) if m])
    assert targets.replace(chat_tok.eos_token, "|") == "It adds seven to its argument.|It returns x plus three.|"
    assert asked[2].count("It adds seven") == 1  # the later turn sees the earlier answer, not the dropped one


def test_docqa_needs_a_teacher_and_kinds_are_checked(chat_tok):
    stream = np.asarray(chat_tok(CODE * 4)["input_ids"], np.int32)
    with pytest.raises(ValueError, match="teacher"):
        sample(chat_tok, stream, 300, "docqa", np.random.default_rng(0))
    with pytest.raises(ValueError, match="teacher"):
        retrieval_rows(chat_tok, stream, len(ALL_KINDS), 512, np.random.default_rng(0), (100, 300), kinds=ALL_KINDS)
    with pytest.raises(ValueError, match="kinds must be among"):
        retrieval_rows(chat_tok, stream, 4, 512, np.random.default_rng(0), (100, 300), kinds=("passkey", "quiz"))
    ids, mask = sample(chat_tok, stream, 300, "docqa", np.random.default_rng(0), answer=lambda p: None)
    assert not any(mask)  # nothing answered: the text stays, without a target
    d = ALL_KINDS.index("docqa")
    rows, rmask = retrieval_rows(chat_tok, stream, d + 1, 512, np.random.default_rng(0), (100, 300), kinds=ALL_KINDS,
                                 answer=lambda p: "A helper that adds a number.")
    end = int(np.flatnonzero(rows[d] == chat_tok.eos_token_id)[-1])  # the EOS after the sample
    first = int(np.flatnonzero(rmask[d])[0])
    assert chat_tok.decode(rows[d, first:end].tolist()) == "A helper that adds a number." + chat_tok.eos_token  # docqa


def test_a_looping_answer_ends_before_its_first_repeat():
    assert _no_loop("The text says:\n\nThe text says:\n\nThe text says:") is None  # too little left
    assert _no_loop("It parses the file.\nIt returns a dict.\nIt parses the file.") == \
        "It parses the file.\nIt returns a dict."


def test_chat_ids_are_the_templates_own_and_mask_each_answer(chat_tok):
    """`_chat` tokenizes each turn's new text alone: the ids are the template's own tokenization of
    the whole conversation, and the targets are each answer and its end-of-turn token."""
    from orthros.data.retrieval import _chat

    turns = [("Some text\nwith lines.\nWhat is the value of x?", "The value of x is 42."),
             ("What is the value of y?", "7"), ("And z?", "The value of z is 1234.")]
    ids, mask = _chat(chat_tok, turns)
    msgs = [{"role": r, "content": c} for u, a in turns for r, c in (("user", u), ("assistant", a))]
    assert ids == list(chat_tok.apply_chat_template(msgs, tokenize=True, return_dict=False))
    spans, i = [], 0
    while i < len(mask):
        if mask[i]:
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            spans.append(chat_tok.decode(ids[i:j]))
            i = j
        else:
            i += 1
    eot = {s[len(a):] for s, (_, a) in zip(spans, turns)}  # what follows each answer: one end-of-turn token
    assert [s[: len(a)] for s, (_, a) in zip(spans, turns)] == [a for _, a in turns]
    assert len(eot) == 1 and len(chat_tok(eot.pop(), add_special_tokens=False)["input_ids"]) == 1
