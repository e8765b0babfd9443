"""SFT: loss only on responses, packed rows, output positions only where a response token is predicted."""

import json
import random

import torch

from orthros import OrthrosForCausalLM
from orthros.data.packing import pack_examples
from orthros.data.sft import render_example
from orthros.data.tokenizer import ByteTokenizer
from orthros.train import train
from orthros.train.checkpoint import list_checkpoints

from .train_helpers import DEVICE


def write_sft(path, n=60, chat=False, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            q, r = f"What is {a} plus {b}?", f"{a + b}."
            rec = ({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q},
                                 {"role": "assistant", "content": r}]} if chat else {"prompt": q + "\n", "response": r})
            f.write(json.dumps(rec) + "\n")
    return path


def test_packed_sft_rows_equal_examples_run_alone():
    """Logits at response positions of a packed SFT row == each example run on its own (no cross-example
    attention), and the output positions are exactly the predicted response tokens (N < T)."""
    torch.manual_seed(0)
    from orthros import OrthrosConfig

    model = OrthrosForCausalLM(OrthrosConfig.from_name("tiny", window_size=4)).to(DEVICE).eval()
    tok = ByteTokenizer()
    exs = [{"prompt": f"Q{i}: " + "x" * (3 * i), "response": f"answer {i}"} for i in range(1, 5)]
    rendered = [render_example(e, tok) for e in exs]
    rows, cut = pack_examples(rendered, seq_len=64)
    assert cut == 0 and len(rows) == 2
    batch = {k: v.to(DEVICE) for k, v in rows.batch([0, 1]).items()}
    out = model(**batch)
    n_targets = int((batch["labels"][:, 1:] != -100).sum())
    assert int((out.output_positions >= 0).sum()) == n_targets < batch["labels"].numel() // 2
    r = 0
    offset = 0
    for ids, mask in rendered:
        if offset + len(ids) > 64:
            r, offset = r + 1, 0
        alone = model(torch.tensor([ids], device=DEVICE)).logits[0]  # every position an output
        for j in range(len(ids) - 1):
            if mask[j + 1]:  # position j predicts a response token
                k = (out.output_positions[r] == offset + j).nonzero()
                assert len(k) == 1
                torch.testing.assert_close(out.logits[r, k[0, 0]], alone[j], rtol=1e-4, atol=1e-5)
        offset += len(ids)


def test_targets_are_the_responses():
    tok = ByteTokenizer()
    ids, mask = render_example({"prompt": "Q?\n", "response": "yes"}, tok)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "yes"
    ids, mask = render_example({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "A1"},
                                             {"role": "user", "content": "again"},
                                             {"role": "assistant", "content": "A2"}]}, tok)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "A1\nA2\n"
    assert tok.decode(ids) == "### user\nhi\n### assistant\nA1\n### user\nagain\n### assistant\nA2\n"


def test_sft_after_pretraining(tiny_cfg, tmp_path):
    """Pre-train (BPE trained on the corpus), then SFT on chat messages with that checkpoint's tokenizer and
    ChatML template; loss falls and the model and tokenizer reload from the SFT checkpoint."""
    pre = train(tiny_cfg("pre", data__tokenizer="bpe", data__vocab_size=400, train__steps=2, data__seq_len=64))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pre["checkpoint"])
    assert tok.chat_template and len(tok) == 400
    data = write_sft(tmp_path / "chat.jsonl", chat=True)
    held = write_sft(tmp_path / "held.jsonl", n=8, chat=True, seed=1)
    s = train(tiny_cfg("sft", model__init_from=pre["checkpoint"], data__tokenizer="auto", data__train=str(data),
                       data__heldout=str(held),
                       data__seq_len=128, train__steps=8, train__eval_every=100, optim__lr="1e-2"))
    from orthros.train.metrics import read_metrics

    losses = [r["loss"] for r in read_metrics(tmp_path / "sft/metrics.jsonl") if "loss" in r]
    assert losses[-1] < losses[0] and s["eval_loss"] is not None
    ck = list_checkpoints(tmp_path / "sft/checkpoints")[-1]
    assert AutoTokenizer.from_pretrained(str(ck)).get_vocab() == tok.get_vocab()
    OrthrosForCausalLM.from_pretrained(str(ck))


def test_sft_prompt_response_from_scratch_bytes(tiny_cfg, tmp_path):
    data = write_sft(tmp_path / "qa.jsonl")
    s = train(tiny_cfg("qa", data__train=str(data), data__heldout="[]", data__seq_len=64, train__steps=3))
    assert s["steps"] == 3 and s["eval_loss"] is None
