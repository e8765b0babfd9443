"""Recall generators are well-posed and deterministic; scoring and perplexity match a plain full forward."""

import math

import pytest
import torch
import torch.nn.functional as F

from orthros.eval.mqar import MQARConfig, key_distances, mqar_batch
from orthros.eval.passkey import NEEDLE, QUESTION, passkey_batch
from orthros.eval.perplexity import perplexity
from orthros.eval.scoring import answer_hits
from orthros.data.tokenizer import ByteTokenizer
from ..conftest import DEVICE, make_model


@pytest.mark.parametrize("cfg", [MQARConfig(seq_len=64, num_kv_pairs=4, vocab_size=32),
                                 MQARConfig(seq_len=100, num_kv_pairs=8, vocab_size=256, power_a=1.0, min_gap=3),
                                 MQARConfig(seq_len=64, num_kv_pairs=4, vocab_size=32, num_queries=28),
                                 MQARConfig(seq_len=64, num_kv_pairs=4, vocab_size=32, random_filler=False)])
def test_mqar_is_well_posed(cfg):
    ids, labels = mqar_batch(16, cfg, seed=3)
    P, half = cfg.num_kv_pairs, cfg.vocab_size // 2
    assert ids.shape == labels.shape == (16, cfg.seq_len)
    assert torch.equal(ids, mqar_batch(16, cfg, seed=3)[0]) and not torch.equal(ids, mqar_batch(16, cfg, seed=4)[0])
    assert ids.min() >= (1 if cfg.random_filler else 0) and ids.max() < cfg.vocab_size
    ctx_k, ctx_v = ids[:, : 2 * P : 2], ids[:, 1 : 2 * P : 2]
    assert (ctx_k < half).all() and (ctx_v >= half).all()
    for row in range(16):
        assert len(set(ctx_k[row].tolist())) == P  # distinct keys
        answers = (labels[row] != -100).nonzero().flatten()
        assert len(answers) == (cfg.num_queries or P)
        assert (answers >= 2 * P + 2 * cfg.min_gap + 1).all()
        for t in answers.tolist():
            key = ids[row, t - 1].item()
            j = ctx_k[row].tolist().index(key)
            assert labels[row, t] == ids[row, t] == ctx_v[row, j]  # the value of that key
        # a key appears only in the context and where it is asked
        keys_after = [i for i in range(2 * P, cfg.seq_len) if 0 < ids[row, i] < half]
        if not cfg.random_filler:
            assert (ids[row] == 0).sum() == cfg.seq_len - 2 * P - 2 * len(answers)
        assert sorted(keys_after) == sorted((answers - 1).tolist())
    d = key_distances(ids, labels, P)
    t = (labels[0] != -100).nonzero().flatten()[0].item()
    j = ctx_k[0].tolist().index(ids[0, t - 1].item())
    assert d[0, t] == t - 1 - 2 * j and d[labels == -100].eq(0).all()


def test_mqar_errors_name_the_field():
    with pytest.raises(ValueError, match="num_kv_pairs"):
        mqar_batch(1, MQARConfig(num_kv_pairs=0))
    with pytest.raises(ValueError, match="vocab_size"):
        mqar_batch(1, MQARConfig(num_kv_pairs=8, vocab_size=16))
    with pytest.raises(ValueError, match="seq_len"):
        mqar_batch(1, MQARConfig(seq_len=20, num_kv_pairs=8))
    with pytest.raises(ValueError, match="num_queries"):
        mqar_batch(1, MQARConfig(seq_len=64, num_kv_pairs=4, vocab_size=32, num_queries=100))


def test_passkey_sample_layout():
    tok = ByteTokenizer()
    hay = tok.encode("def f(x):\n    return x + 1\n" * 50)
    for depth in (0.0, 0.5, 1.0):
        ids, labels, keys = passkey_batch(hay, tok.encode, 3, 300, depth, digits=5, seed=1)
        assert ids.shape == (3, 300)
        for r in range(3):
            text = tok.decode(ids[r].tolist())
            needle = NEEDLE.format(key=keys[r])
            assert text.endswith(QUESTION + " " + keys[r]) and needle in text
            where = text.index(needle) / (300 - len(needle) - len(QUESTION) - 6)
            assert abs(where - depth) < 0.02
            ans = labels[r][labels[r] != -100]
            assert tok.decode(ans.tolist()) == " " + keys[r]
    with pytest.raises(ValueError, match="shorter than"):
        passkey_batch(hay, tok.encode, 1, 40, 0.5)


def test_passkey_copy_labels_add_the_needles_second_key_only():
    """Training labels: the answer as in evaluation, plus the key's second copy in the needle."""
    tok = ByteTokenizer()
    hay = tok.encode("x = [1, 2, 3]\n" * 40)
    ids, labels, keys = passkey_batch(hay, tok.encode, 4, 200, None, seed=2)
    ids2, labels2, keys2 = passkey_batch(hay, tok.encode, 4, 200, None, seed=2, copy_labels=True)
    assert torch.equal(ids, ids2) and keys == keys2
    extra = (labels2 != -100) & (labels == -100)
    assert torch.equal(labels2[labels != -100], labels[labels != -100])
    for r in range(4):
        text = tok.decode(ids[r].tolist())
        needle = NEEDLE.format(key=keys[r])
        start = text.index(needle) + needle.index(". Remember it.") + len(". Remember it.")
        assert text[start : start + 6] == " " + keys[r]
        assert extra[r].nonzero().flatten().tolist() == list(range(start, start + 6))
        assert tok.decode(labels2[r][extra[r]].tolist()) == " " + keys[r]


@pytest.mark.parametrize("attention", ["orthros", "full", "swa"])
def test_answer_hits_equal_full_forward_argmax(attention):
    """Scoring with output positions at the answers only (SFT phase) = argmax of a pre-training forward."""
    model = make_model(attention, window=4)
    ids, labels = mqar_batch(5, MQARConfig(seq_len=40, num_kv_pairs=4, vocab_size=64), seed=0)
    # a random model is rarely right: make hits likely by scoring its own greedy predictions
    with torch.no_grad():
        pred = model(ids.to(DEVICE), logits_to_keep=0).logits.argmax(-1).cpu()
    mask = labels != -100
    labels = torch.where(mask, torch.cat([ids[:, :1], pred[:, :-1]], 1), -100)
    labels[:, 20:] = torch.where(mask[:, 20:], (labels[:, 20:] + 1) % 64, -100)  # wrong on the second half
    hits = answer_hits(model, ids, labels, batch_size=2)
    want = mask.clone()
    want[:, 20:] = False
    assert torch.equal(hits, want)


@pytest.mark.parametrize("attention", ["orthros", "full", "swa"])
@pytest.mark.parametrize("chunk", [None, 7])
def test_perplexity_equals_one_full_forward(attention, chunk):
    model = make_model(attention, window=5)
    tokens = torch.randint(0, 256, (3 * 33 + 5,))
    res = perplexity(model, tokens, seq_len=33, chunk_size=chunk, batch_size=2)
    rows = tokens[: 3 * 33].view(3, 33).to(DEVICE)
    with torch.no_grad():
        logits = model(rows, logits_to_keep=0).logits[:, :-1]
    ref = F.cross_entropy(logits.flatten(0, 1).double(), rows[:, 1:].flatten()).item()
    assert res["tokens"] == 3 * 32 and res["rows"] == 3
    assert abs(res["nll"] - ref) < 1e-4 and abs(res["ppl"] - math.exp(ref)) < 1e-3 * math.exp(ref)
    with pytest.raises(ValueError, match="seq_len"):
        perplexity(model, tokens[:10], seq_len=33)
