"""Checkpoints: a model directory plus the state to continue exactly.

    out_dir/checkpoints/step_00001000/
        config.json, model.safetensors        save_pretrained: loads with from_pretrained
        tokenizer.json, tokenizer_config.json  when the run has an HF tokenizer
        train_state.pt                         optimizer, scheduler, RNG of every rank, data position
        train_config.yaml                      the run's configuration

A checkpoint is written into a temporary directory, flushed to disk, and
renamed into place: a process killed mid-save leaves the previous
checkpoints intact and only a `.tmp-*` directory behind (removed by the next
save). Under FSDP2 the weights and optimizer state are gathered to full
tensors on rank 0, so a checkpoint does not depend on the number of processes.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_optimizer_state_dict)

from . import dist as D

PREFIX = "step_"
# Test hook, "STEP:SECONDS": while saving checkpoint STEP, sleep between the weights and the
# training state (the kill-during-save test SIGKILLs the process there).
PAUSE_ENV = "ORTHROS_SAVE_PAUSE"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (a rename makes a directory complete)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def resolve_resume(resume: str | None, root: Path) -> Path | None:
    """The checkpoint to resume from: None, 'latest', 'auto' or a directory."""
    if resume is None:
        return None
    if resume in ("latest", "auto"):
        ckpts = list_checkpoints(root)
        if not ckpts:
            if resume == "auto":
                return None
            raise FileNotFoundError(f"--resume latest: no checkpoint under {root}")
        return ckpts[-1]
    p = Path(resume)
    if not (p / "train_state.pt").is_file():
        raise FileNotFoundError(f"checkpoint.resume: {resume!r} is not a checkpoint directory (no train_state.pt)")
    return p


def _rng_state() -> dict:
    s = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state()
    return s


def _set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root: Path, step: int, model, optimizer, scheduler, loader, tokenizer, config_yaml: str,
         d: D.Dist, keep: int) -> Path:
    """Write checkpoint `step` atomically; keep the newest `keep`. Collective under FSDP."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=opts) if d.on else None
    optim = get_optimizer_state_dict(model, optimizer, options=opts)
    rng = D.gather_objects(d, _rng_state())
    final = root / f"{PREFIX}{step:08d}"
    if d.main:
        root.mkdir(parents=True, exist_ok=True)
        for old in root.glob(".tmp-*"):  # left by a process killed mid-save
            shutil.rmtree(old, ignore_errors=True)
        tmp = root / f".tmp-{final.name}-{os.getpid()}"
        tmp.mkdir()
        model.save_pretrained(tmp, state_dict=weights)
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
        pause = os.environ.get(PAUSE_ENV, "").split(":")
        if len(pause) == 2 and int(pause[0]) == step:
            time.sleep(float(pause[1]))
        torch.save({"step": step, "optimizer": optim, "scheduler": scheduler.state_dict(), "rng": rng,
                    "data": loader.state_dict(), "world_size": d.world}, tmp / "train_state.pt")
        (tmp / "train_config.yaml").write_text(config_yaml)
        _fsync_tree(tmp)
        if final.exists():  # re-saving a step (e.g. after a resume): move the old one aside first
            stale = root / f".tmp-stale-{final.name}-{os.getpid()}"
            os.rename(final, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.rename(tmp, final)
        _fsync_dir(root)
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    D.barrier(d)
    return final


def load_train_state(ckpt: Path, model, optimizer, scheduler, loader, d: D.Dist) -> int:
    """Restore optimizer, scheduler, RNG and data position from `ckpt`; returns its step.
    The weights were loaded with the model (`from_pretrained(ckpt)`)."""
    state = torch.load(ckpt / "train_state.pt", map_location="cpu", weights_only=False)
    # strict=False: a parameter that never gets a gradient (the last layer's base-stream SO,
    # whose output is never read) has no optimizer state to restore.
    set_optimizer_state_dict(model, optimizer, state["optimizer"],
                             options=StateDictOptions(full_state_dict=True, strict=False))
    scheduler.load_state_dict(state["scheduler"])
    loader.load_state_dict(state["data"])
    rngs = state["rng"]
    _set_rng_state(rngs[d.rank] if d.rank < len(rngs) else rngs[0])
    return int(state["step"])
