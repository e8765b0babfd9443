"""Config files, --section.field overrides, and their errors."""

import pytest

from orthros.cli import build_parser, main
from orthros.train.config import build_config, field_docs, options, TrainArgs


def test_yaml_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("out_dir: x\nmodel: {name: small, attention: full}\ntrain: {steps: 7}\noptim: {lr: 1e-3}\n")
    cfg = build_config(f, {"train.steps": "9", "data.train": "[a.txt, b.txt]", "data.heldout": "null",
                           "model.overrides": "{num_hidden_layers: 1}"})
    assert cfg.out_dir == "x" and cfg.model.name == "small" and cfg.model.attention == "full"
    assert cfg.train.steps == 9 and cfg.optim.lr == 1e-3
    assert cfg.data.train == ["a.txt", "b.txt"] and cfg.data.heldout is None
    assert cfg.model.overrides == {"num_hidden_layers": 1}


def test_shipped_configs_parse():
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
    assert len(files) >= 3
    for f in files:
        build_config(f)


@pytest.mark.parametrize("text, match", [
    ("trian: {steps: 3}\n", "unknown config key 'trian'"),
    ("train: {stepz: 3}\n", "unknown config key 'train.stepz'"),
    ("train: {steps: three}\n", "train.steps must be int"),
    ("train: {steps: 0}\n", "train.steps must be >= 1"),
    ("model: {attention: linear}\n", "model.attention"),
    ("- a\n- b\n", "mapping"),
    ("optim: {lora_b_ratio: 0}\n", "optim.lora_b_ratio must be > 0"),
])
def test_bad_config_file(tmp_path, text, match):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ValueError, match=match):
        build_config(f)


def test_bad_overrides():
    with pytest.raises(ValueError, match="unknown option --train.stepz"):
        build_config(None, {"train.stepz": "3"})
    with pytest.raises(ValueError, match="optim.lr must be float"):
        build_config(None, {"optim.lr": "fast"})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_config("no/such.yaml")


def test_help_comes_from_docstrings(capsys):
    docs = field_docs(TrainArgs)
    assert "micro-batches per optimizer step" in docs["grad_accum"]
    assert {name for name, *_ in options()} >= {"train.steps", "model.attention", "checkpoint.resume"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    out = capsys.readouterr().out
    assert "--train.grad_accum" in out and "micro-batches per optimizer step" in out


def test_cli_reports_user_errors_in_one_line(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_text("train: {bogus: 1}\n")
    assert main(["train", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown config key 'train.bogus'" in err[0]


@pytest.mark.parametrize("ratio", [1.0, 16.0])
def test_lora_plus_gives_the_b_factors_their_own_rate(ratio):
    """optim.lora_b_ratio: the B factors at lora_lr x ratio (LoRA+); at 1, one LoRA group as before
    (an optimizer state saved with one group resumes)."""
    from orthros.models.adapter import make_trainable
    from orthros.train.config import OptimArgs
    from orthros.train.trainer import param_groups

    from ..conftest import make_model

    model = make_trainable(make_model(window=3), "lora+so", rank=2)
    named = {id(p): n for n, p in model.named_parameters()}
    groups = param_groups(model, OptimArgs(lr=1e-4, vector_lr=2e-3, lora_lr=1e-3, lora_b_ratio=ratio))
    rates = {}
    for g in groups:
        for p in g["params"]:
            kind = "A" if named[id(p)].endswith(".lora_A") else "B" if named[id(p)].endswith(".lora_B") else "other"
            rates.setdefault(kind, set()).add(g["lr"])
    assert rates["A"] == {1e-3} and rates["B"] == {1e-3 * ratio} and rates["other"] == {2e-3}
    assert len(groups) == (2 if ratio == 1.0 else 3)
    assert sum(len(g["params"]) for g in groups) == sum(p.requires_grad for p in model.parameters())
