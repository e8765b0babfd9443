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
