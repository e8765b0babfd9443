"""The CPT experiment's prepared rows follow the preset: retrieval rows made again when the
retrieval settings change, found again (not remade) when they do not."""

import dataclasses
import json
import re

import numpy as np
import pytest

from orthros.experiments.cpt import prepare_data
from orthros.experiments.cpt_arms import PRESETS


def test_retrieval_rows_follow_the_preset(tmp_path, chat_tok):
    p = dataclasses.replace(PRESETS["smollm2-cpu-smoke"], steps=6, retrieval_share=0.5, seq_len=1024,
                            retrieval_lengths=(600, 900))
    prepare_data(chat_tok, tmp_path, p)
    made = (tmp_path / "retrieval_rows.npy").stat().st_mtime_ns
    assert json.loads((tmp_path / "retrieval.json").read_text()) == {"rows": 6, "lengths": [600, 900], "questions": 1}
    one = np.load(tmp_path / "retrieval_mask.npy")
    prepare_data(chat_tok, tmp_path, p)  # nothing changed: found again
    assert (tmp_path / "retrieval_rows.npy").stat().st_mtime_ns == made

    prepare_data(chat_tok, tmp_path, dataclasses.replace(p, retrieval_questions=4))
    assert json.loads((tmp_path / "retrieval.json").read_text())["questions"] == 4
    several = np.load(tmp_path / "retrieval_mask.npy")
    # the lookups (every third row, from the second) now answer several questions: more answer
    # spans before the row's text (which keeps its own target run)
    starts = lambda m: int((np.diff(m.astype(np.int8)) == 1).sum())  # noqa: E731
    assert starts(one[1]) == 2 and starts(several[1]) == 5
    assert several[:, -1].all()  # the conversation fits: the row ends in text

    prepare_data(chat_tok, tmp_path, dataclasses.replace(p, retrieval_questions=4, retrieval_phrase=True))
    assert json.loads((tmp_path / "retrieval.json").read_text())["phrase"] is True  # made again
    rows, said = np.load(tmp_path / "retrieval_rows.npy"), np.load(tmp_path / "retrieval_mask.npy")
    first = int(np.flatnonzero(said[0])[0])  # row 0 is a pass key: answered in the needle's sentence
    assert re.match(r"The (pass key|secret code|access number) is \d{5}\.", chat_tok.decode(rows[0, first:].tolist()))

    prepare_data(chat_tok, tmp_path, dataclasses.replace(p, retrieval_questions=4, retrieval_phrase=True,
                                                         retrieval_varied=True))
    assert json.loads((tmp_path / "retrieval.json").read_text())["varied"] is True  # made again, in many wordings
    rows, said = np.load(tmp_path / "retrieval_rows.npy"), np.load(tmp_path / "retrieval_mask.npy")
    answers = [chat_tok.decode(rows[r, int(np.flatnonzero(said[r])[0]):][:20].tolist()) for r in (0, 3)]
    assert all(re.match(r"The [a-z ]+ is \d{5}\.", a) for a in answers)


def test_docqa_rows_call_the_teacher_only_when_made(tmp_path, chat_tok):
    p = dataclasses.replace(PRESETS["smollm2-cpu-smoke"], steps=4, retrieval_share=1.0, seq_len=1024,
                            retrieval_lengths=(600, 900), retrieval_kinds=("docqa", "passkey"))
    with pytest.raises(ValueError, match="teacher"):
        prepare_data(chat_tok, tmp_path, p)
    calls = []

    def teacher():
        calls.append(1)
        return lambda prompt_ids: "It explains how the text is laid out."

    prepare_data(chat_tok, tmp_path, p, teacher=teacher)
    assert calls == [1] and json.loads((tmp_path / "retrieval.json").read_text())["kinds"] == ["docqa", "passkey"]
    rows, mask = np.load(tmp_path / "retrieval_rows.npy"), np.load(tmp_path / "retrieval_mask.npy")
    first = int(np.flatnonzero(mask[0])[0])
    assert chat_tok.decode(rows[0, first : first + 40].tolist()).startswith("It explains how the text is laid out.")
    prepare_data(chat_tok, tmp_path, p, teacher=teacher)  # found again: the teacher is not loaded
    assert calls == [1]


def test_train_stream_reads_a_small_corpus_once(tmp_path, chat_tok, monkeypatch):
    """A corpus smaller than asked for is read and tokenized once (no doubling of the characters
    asked for over text that is all read already), and all of it comes back."""
    from orthros.experiments import cpt_data

    docs = ["def f(x):\n    return x + 1\n" * 20, "The with statement is used to wrap a block.\n" * 20]
    calls = []

    def read(max_chars):
        calls.append(max_chars)
        return list(docs)

    monkeypatch.setattr(cpt_data, "read_train_documents", read)
    got = cpt_data.train_stream(chat_tok, 10**6, tmp_path)
    assert calls == [4 * 10**6]
    want = cpt_data.encode_docs(chat_tok, docs, chat_tok.eos_token_id)
    assert np.array_equal(got, want)
    assert np.array_equal(cpt_data.train_stream(chat_tok, 10, tmp_path / "b"), want[:10])


@pytest.mark.parametrize("haystack_rows", [4.0, 1.0])
def test_haystack_text_asked_follows_the_preset(tmp_path, chat_tok, monkeypatch, haystack_rows):
    from orthros.experiments import cpt_data

    asked = []

    def stream(tok, tokens, cache):
        asked.append(tokens)
        return np.zeros(5, np.int32)

    monkeypatch.setattr(cpt_data, "train_stream", stream)
    p = dataclasses.replace(PRESETS["smollm2-cpu-smoke"], steps=6, retrieval_share=0.5, seq_len=1024,
                            haystack_rows=haystack_rows)
    with pytest.raises(ValueError, match="only 5 training tokens on this machine; the preset needs"):
        prepare_data(chat_tok, tmp_path, p)
    n = 6 * p.batch_size
    assert asked == [n * 1024 + round(haystack_rows * (n // 2) * 1024)]
    assert PRESETS["smollm2-kd-h200-rqp-curve"].haystack_rows == 1.0


def test_held_out_sets_include_a_novel_no_training_file_holds(tmp_path, chat_tok, monkeypatch):
    """The fourth held-out domain is English about no software (a novel carried with the project):
    consecutive rows of its tokens; the training corpus holds none of its text."""
    from orthros.experiments import cpt_data

    text = cpt_data.novel_text()
    assert text.startswith("CHAPTER 1. Loomings.\n\nCall me Ishmael.")
    assert re.findall(r"^CHAPTER (\d+)\.", text, re.M) == [str(i) for i in range(1, 68)]
    held = cpt_data.heldout_sets(chat_tok, 512, 3, tmp_path)
    assert list(held) == list(cpt_data.DOMAINS) == ["code", "prose", "docs", "novel"]
    ids = chat_tok(text[:20000], add_special_tokens=False)["input_ids"]
    assert held["novel"].shape == (3, 512) and held["novel"].ravel().tolist() == ids[: 3 * 512]
    # no training document quotes the novel (checked on this machine's corpus, as a run would read it)
    docs = cpt_data.read_train_documents(3_000_000)
    assert docs and not any("Call me Ishmael. Some years ago" in d for d in docs)
