"""The continued-pre-training recipe: configs/cpt-*.yaml parse, match the paper's
token budgets, and a converted checkpoint really trains from them."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from orthros.convert import convert_checkpoint
from orthros.convert.tiny import make_tiny_checkpoint
from orthros.train.config import build_config
from orthros.train.trainer import train

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name, seq_len, tokens", [("cpt-8b-32k", 32768, 80e9), ("cpt-8b-128k", 131072, 20e9)])
def test_paper_scale_configs(name, seq_len, tokens):
    cfg = build_config(CONFIGS / f"{name}.yaml")
    assert cfg.data.seq_len == seq_len and cfg.model.init_from and cfg.data.tokenizer == "auto"
    gpus = 64  # as the files' comments assume
    total = cfg.train.steps * cfg.train.batch_size * cfg.train.grad_accum * gpus * seq_len
    assert 1.0 <= total / tokens < 1.1
    assert 0 < cfg.optim.min_lr_ratio < 1  # cosine to a floor


def test_tiny_recipe_trains_a_converted_llama(tmp_path):
    src, conv = tmp_path / "llama", tmp_path / "orthros"
    make_tiny_checkpoint(src, "llama")
    convert_checkpoint(src, conv, window_size=16, dtype="fp32", progress=False)
    for name in ("cpt-tiny", "cpt-tiny-long"):
        build_config(CONFIGS / f"{name}.yaml")  # both stages parse
    cfg = build_config(CONFIGS / "cpt-tiny.yaml", {
        "model.init_from": str(conv), "out_dir": str(tmp_path / "run"), "train.steps": "4",
        "train.eval_every": "4", "data.max_bytes": "200000", "data.seq_len": "128", "log.progress": "false",
        "log.plot": "false"})
    summary = train(cfg)
    ckpt = Path(summary["checkpoint"])
    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    base = AutoModelForCausalLM.from_pretrained(conv).eval()
    assert model.config.window_size == 16 and model.config.attention == "orthros"
    so = dict(model.named_parameters())["model.layers.0.self_attn.so_alpha_out"]
    assert not torch.equal(so, dict(base.named_parameters())["model.layers.0.self_attn.so_alpha_out"])  # SO learns
    ids = torch.randint(0, model.config.vocab_size, (1, 20))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
