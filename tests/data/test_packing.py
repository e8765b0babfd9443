"""Packing: the flattening convention (position 0 starts a document), targets, static output shapes."""

import numpy as np
import pytest
import torch

from orthros import OrthrosConfig, OrthrosForCausalLM
from orthros.data.packing import IGNORE_INDEX, output_index, pack_documents, pack_examples

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_pack_documents_layout():
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]
    rows = pack_documents(docs, seq_len=4, eos_id=0)  # stream: 1 2 3 0 | 4 5 0 6 | 7 8 9 10 | 0 (dropped)
    assert rows.ids.tolist() == [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 10]]
    assert rows.pos.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 2, 3]]
    # a document's first token is never a target (it would be predicted from the previous document)
    assert rows.target.tolist() == [[False, True, True, True], [False, True, True, False], [True, True, True, True]]
    b = rows.batch(np.array([1]))
    assert b["labels"].tolist() == [[IGNORE_INDEX, 5, 0, IGNORE_INDEX]] and "attention_mask" not in b


def test_packed_row_equals_documents_alone():
    """No attention across documents: a packed row's logits == each document run on its own."""
    torch.manual_seed(0)
    model = OrthrosForCausalLM(OrthrosConfig.from_name("tiny", window_size=3)).to(DEVICE).eval()
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 9, 7)]
    rows = pack_documents(docs, seq_len=21)
    batch = {k: v.to(DEVICE) for k, v in rows.batch(np.array([0])).items()}
    packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
    o = 0
    for d in docs:
        alone = model(torch.tensor([d], device=DEVICE)).logits[0]
        torch.testing.assert_close(packed[o : o + len(d)], alone, rtol=1e-4, atol=1e-5)
        o += len(d)


def test_pack_examples():
    exs = [([1, 2, 3, 4], [False, False, True, True]), ([5, 6, 7], [False, True, True]),
           ([8] * 10, [False] * 5 + [True] * 5), ([9, 9], [False, False])]
    rows, cut = pack_examples(exs, seq_len=8, pad_id=0)
    assert cut == 1  # the 10-token example is cut to 8; the one without targets is dropped
    assert rows.ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 0], [8] * 8]
    assert rows.pos.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0], list(range(8))]
    assert rows.valid.tolist() == [[True] * 7 + [False], [True] * 8]
    assert rows.target.tolist()[0] == [False, False, True, True, False, True, True, False]
    assert rows.batch(np.array([0, 1]))["attention_mask"].tolist()[0] == [1] * 7 + [0]


@pytest.mark.parametrize("multiple", [1, 4, 128])
def test_output_index(multiple):
    labels = torch.full((3, 10), IGNORE_INDEX)
    labels[0, 3:6] = 1
    labels[1, 1:] = 2
    idx = output_index(labels, multiple)
    want = [[2, 3, 4], list(range(9)), []]
    n = min(10, -(-9 // multiple) * multiple)
    assert idx.shape == (3, n)
    for r in range(3):
        assert idx[r][idx[r] >= 0].tolist() == want[r] and (idx[r][len(want[r]):] == -1).all()
