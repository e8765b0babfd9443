"""The training loop: exact resume, accumulation, checkpointing, baselines, outputs."""

import pytest
import torch
from safetensors.torch import load_file

from orthros import OrthrosForCausalLM
from orthros.train import train
from orthros.train.checkpoint import list_checkpoints
from orthros.train.metrics import read_metrics


def losses(out_dir):
    return [r["loss"] for r in read_metrics(out_dir / "metrics.jsonl") if "loss" in r]


def weights(ckpt):
    return load_file(str(ckpt / "model.safetensors"))


def test_resume_is_exact(tiny_cfg, tmp_path):
    """N steps straight == N/2 steps, stop, --resume for the rest: same losses, bit-identical weights."""
    kw = dict(train__grad_accum=2, checkpoint__every=100, train__device="cpu")
    train(tiny_cfg("straight", **kw))
    train(tiny_cfg("split", train__stop_at=3, **kw))
    assert [c.name for c in list_checkpoints(tmp_path / "split/checkpoints")] == ["step_00000003"]
    summary = train(tiny_cfg("split", checkpoint__resume="latest", **kw))
    assert summary["steps"] == 6
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "split")
    assert len(a) == len(b) == 6 and a == b
    wa = weights(list_checkpoints(tmp_path / "straight/checkpoints")[-1])
    wb = weights(list_checkpoints(tmp_path / "split/checkpoints")[-1])
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_grad_accum_matches_one_big_batch(tiny_cfg, tmp_path):
    """2 micro-batches of 2 rows == 1 batch of 4 rows (losses normalised over the whole step)."""
    train(tiny_cfg("big", train__batch_size=4, train__steps=3))
    train(tiny_cfg("acc", train__batch_size=2, train__grad_accum=2, train__steps=3))
    # GPU kernels reduce in a batch-shape-dependent order; Adam amplifies that to ~1e-4 in two steps.
    rel = 1e-5 if not torch.cuda.is_available() else 3e-4
    assert losses(tmp_path / "big") == pytest.approx(losses(tmp_path / "acc"), rel=rel, abs=1e-6)


def test_gradient_checkpointing_changes_nothing(tiny_cfg, tmp_path):
    train(tiny_cfg("plain", train__steps=3))
    train(tiny_cfg("ckpt", train__steps=3, train__gradient_checkpointing="true"))
    assert losses(tmp_path / "plain") == pytest.approx(losses(tmp_path / "ckpt"), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("attention", ["full", "swa"])
def test_baselines_train_with_the_same_command(tiny_cfg, tmp_path, attention):
    s = train(tiny_cfg(attention, model__attention=attention, train__steps=3))
    model = OrthrosForCausalLM.from_pretrained(s["checkpoint"])
    assert model.config.attention == attention
    assert s["eval_loss"] is not None and s["loss"] < 5.6  # below uniform over 256 bytes (5.55) + noise


def test_outputs_checkpoints_and_plot(tiny_cfg, tmp_path):
    s = train(tiny_cfg("run", checkpoint__every=2, checkpoint__keep=2, log__plot="true"))
    run = tmp_path / "run"
    assert [c.name for c in list_checkpoints(run / "checkpoints")] == ["step_00000004", "step_00000006"]
    assert not list((run / "checkpoints").glob(".tmp-*"))
    recs = read_metrics(run / "metrics.jsonl")
    train_recs = [r for r in recs if "loss" in r]
    assert [r["step"] for r in train_recs] == [1, 2, 3, 4, 5, 6]
    assert all(r["tok_per_s"] > 0 and 0 <= r["data_wait_frac"] <= 1 and r["lr"] > 0 for r in train_recs)
    assert [r["step"] for r in recs if "eval_loss" in r] == [3, 6]
    assert (run / "loss.png").stat().st_size > 1000
    # a checkpoint is a model directory: from_pretrained gives the trained weights
    m = OrthrosForCausalLM.from_pretrained(s["checkpoint"])
    w = weights(list_checkpoints(run / "checkpoints")[-1])
    assert torch.equal(m.model.embed_tokens.weight, w["model.embed_tokens.weight"])


def test_tensorboard_is_optional(tmp_path, capsys):
    from orthros.train.metrics import MetricsLog

    log = MetricsLog(tmp_path, tensorboard=True)
    log.write({"step": 1, "loss": 2.0})
    log.close()
    try:
        import torch.utils.tensorboard  # noqa: F401

        assert list((tmp_path / "tensorboard").glob("events.*"))
    except ImportError:
        assert "tensorboard is not installed" in capsys.readouterr().err
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 2.0}]


def test_compare_runs_both_models_on_the_same_schedule(tmp_path):
    """The paired driver: Orthros, then the baseline stopped at the same step of the same schedule; one plot."""
    import json

    from orthros.train.compare import main

    from .train_helpers import ROOT, tiny_overrides

    o = tiny_overrides(tmp_path / "unused", train__steps=5, train__stop_at=3, train__device="cpu",
                       data__tokenizer="bpe", data__vocab_size=300)
    o.pop("out_dir")
    args = [str(ROOT / "configs/pretrain-tiny.yaml"), "--out", str(tmp_path / "cmp")]
    for k, v in o.items():
        args += ["--set", k, v]
    assert main(args) == 0
    s = json.loads((tmp_path / "cmp/curves.json").read_text())
    assert s["steps"] == 3 and s["full"]["steps"] == 3
    assert [st for st, _ in s["curves"]["orthros"]["train"]] == [st for st, _ in s["curves"]["full"]["train"]]
    assert (tmp_path / "cmp/loss.png").is_file()
    assert (tmp_path / "cmp/full/checkpoints/step_00000003/tokenizer.json").is_file()


def test_compiled_blocks_match_eager(tiny_cfg, tmp_path):
    """train.compile (each block through torch.compile) computes the same losses as eager."""
    kw = dict(model__overrides="{num_hidden_layers: 1, window_size: 8}", train__steps=2, train__eval_batches=0)
    train(tiny_cfg("eager", **kw))
    train(tiny_cfg("compiled", train__compile="true", **kw))
    assert losses(tmp_path / "compiled") == pytest.approx(losses(tmp_path / "eager"), rel=1e-4, abs=1e-5)
