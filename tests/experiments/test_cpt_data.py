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
