import sys
from pathlib import Path

import pytest
import torch

from orthros.train.config import build_config

ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tiny_overrides(out_dir, **kw) -> dict[str, str]:
    """A seconds-long run: tiny model (1 layer), byte tokens, 64-token rows, stdlib text."""
    o = {
        "out_dir": str(out_dir),
        "model.name": "tiny",
        "model.overrides": "{num_hidden_layers: 2, window_size: 8}",
        "data.train": "stdlib",
        "data.tokenizer": "bytes",
        "data.max_bytes": "60000",
        "data.seq_len": "32",
        "data.prefetch": "2",
        "optim.lr": "3e-3",
        "optim.warmup_steps": "2",
        "train.steps": "6",
        "train.batch_size": "2",
        "train.log_every": "1",
        "train.eval_every": "3",
        "train.eval_batches": "1",
        "train.device": DEVICE,
        "checkpoint.every": "3",
        "log.progress": "false",
        "log.plot": "false",
    }
    o.update({k.replace("__", "."): str(v) for k, v in kw.items()})
    return o


@pytest.fixture
def tiny_cfg(tmp_path):
    def make(out="run", **kw):
        return build_config(None, tiny_overrides(tmp_path / out, **kw))

    return make


def cli_args(overrides: dict[str, str]) -> list[str]:
    args = []
    for k, v in overrides.items():
        args += [f"--{k}", v]
    return args


PY = sys.executable
