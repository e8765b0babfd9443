"""User mistakes end in one clear error naming the problem; a diverging run keeps its last good checkpoint."""

import pytest
import torch

import orthros.models.model as modeling
from orthros import OrthrosForCausalLM
from orthros.cli import main
from orthros.train import train
from orthros.train.checkpoint import list_checkpoints

from .train_helpers import cli_args, tiny_overrides


def test_missing_file(tiny_cfg, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train(tiny_cfg(data__train=str(tmp_path / "nope.txt")))


def test_empty_file_and_empty_directory(tiny_cfg, tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="empty.txt' is empty"):
        train(tiny_cfg(data__train=str(tmp_path / "empty.txt")))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.bin").write_bytes(b"\0")
    with pytest.raises(FileNotFoundError, match="holds no files ending in"):
        train(tiny_cfg(data__train=str(tmp_path / "d")))


def test_corpus_too_small_for_one_batch(tiny_cfg, tmp_path):
    (tmp_path / "small.txt").write_text("x" * 40)  # one 32-token row; a batch needs 2
    with pytest.raises(ValueError, match="fewer than one global batch"):
        train(tiny_cfg(data__train=str(tmp_path / "small.txt"), data__heldout="[]"))


def test_seq_len_above_max_position_embeddings(tiny_cfg):
    with pytest.raises(ValueError, match="data.seq_len=128 exceeds the model's max_position_embeddings=64"):
        train(tiny_cfg(model__overrides="{max_position_embeddings: 64}", data__seq_len=128))


def test_bad_jsonl(tiny_cfg, tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: an SFT record needs"):
        train(tiny_cfg(data__train=str(f), data__format="sft"))
    f.write_text('{"text": "abc"}\nnot json\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: not valid JSON"):
        train(tiny_cfg(data__train=str(f)))


def test_resume_without_checkpoint(tiny_cfg):
    with pytest.raises(FileNotFoundError, match="no checkpoint under"):
        train(tiny_cfg(checkpoint__resume="latest"))


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    real, calls = modeling.lm_loss, {"n": 0}

    def poisoned(logits, target, num_items=None):
        calls["n"] += 1
        loss = real(logits, target, num_items)
        return loss * float("nan") if calls["n"] == 3 else loss  # the 3rd training step diverges

    monkeypatch.setattr(modeling, "lm_loss", poisoned)
    o = tiny_overrides(tmp_path / "run", checkpoint__every=2, train__eval_every=100, train__device="cpu")
    assert main(["train", *cli_args(o)]) == 3
    err = capsys.readouterr().err
    assert "loss nan" in err and "at step 3" in err and "step_00000002" in err
    ckpts = list_checkpoints(tmp_path / "run/checkpoints")
    assert [c.name for c in ckpts] == ["step_00000002"]
    m = OrthrosForCausalLM.from_pretrained(str(ckpts[0]))
    assert all(torch.isfinite(p).all() for p in m.parameters())
