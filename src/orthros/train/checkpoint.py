"""Checkpoints: a model directory plus the state to continue exactly.

    out_dir/checkpoints/step_00001000/
        config.json, model.safetensors        save_pretrained: loads with from_pretrained
        tokenizer.json, tokenizer_config.json  when the run has an HF tokenizer
        train_state.json                       scheduler, RNG of every rank, data position, optimizer settings
        train_state.safetensors                the optimizer's tensors (and the torch RNG states)
        train_config.yaml                      the run's configuration

The training state is JSON plus safetensors, never a pickle: resuming a
checkpoint someone sent you cannot run code. (A `train_state.pt` written by
an older version is refused with a message; its weights still load with
`model.init_from`.)

A checkpoint is written into a temporary directory, flushed to disk, and
renamed into place: a process killed mid-save leaves the previous
checkpoints intact and only a `.tmp-*` directory behind (removed by the next
save). Under FSDP2 the weights and optimizer state are gathered to full
tensors on rank 0, so a checkpoint does not depend on the number of processes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_optimizer_state_dict)

from ..errors import UserError, one_line, read_json
from . import dist as D

PREFIX = "step_"
# Test hook, "STEP:SECONDS": while saving checkpoint STEP, sleep between the weights and the
# training state (the kill-during-save test SIGKILLs the process there).
PAUSE_ENV = "ORTHROS_SAVE_PAUSE"
STATE_JSON, STATE_TENSORS = "train_state.json", "train_state.safetensors"
LEGACY_STATE = "train_state.pt"  # a pickle: refused


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
        return check_resumable(ckpts[-1])
    p = Path(resume)
    if not p.is_dir():
        raise FileNotFoundError(f"checkpoint.resume: {resume!r} is not a checkpoint directory (it does not exist)")
    return check_resumable(p)


def check_resumable(p: Path) -> Path:
    """`p` holds a training state this version reads (JSON + safetensors, not a pickle)."""
    if not (p / STATE_JSON).is_file():
        if (p / LEGACY_STATE).exists():
            raise UserError(f"{p / LEGACY_STATE}: a pickle-format training state (from an older version), refused: "
                            f"orthros never unpickles a file (that can run arbitrary code); start from its weights "
                            f"with --model.init_from {p} instead of resuming")
        raise FileNotFoundError(f"checkpoint.resume: {str(p)!r} is not a checkpoint directory (no {STATE_JSON})")
    if not (p / STATE_TENSORS).is_file():
        raise UserError(f"{p}: incomplete checkpoint ({STATE_JSON} without {STATE_TENSORS})")
    from ..convert.safetensors_stream import read_header

    read_json(p / STATE_JSON, "training state")  # cheap checks now, before the model and data are built
    try:
        read_header(p / STATE_TENSORS)
    except ValueError as e:
        raise UserError(one_line(e)) from None
    return p


def _rng_state() -> dict:
    """Every generator's state as JSON-ready values and tensors."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    s = {"python": [version, list(internal), gauss],
         "numpy": [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
         "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state()
    return s


def _set_rng_state(s: dict) -> None:
    version, internal, gauss = s["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = s["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
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
        save_weights(model, tmp, weights)
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
        pause = os.environ.get(PAUSE_ENV, "").split(":")
        if len(pause) == 2 and int(pause[0]) == step:
            time.sleep(float(pause[1]))
        write_state(tmp, {"step": step, "optimizer": optim, "scheduler": scheduler.state_dict(), "rng": rng,
                          "data": loader.state_dict(), "world_size": d.world})
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


def save_weights(model, out: Path, weights: dict | None) -> None:
    """The model as `save_pretrained` writes it; a model training a light delta (frozen
    parameters: SO, norms, LoRA) is written merged, with the delta unmerged beside it in
    adapter.safetensors (what a resume restores exactly). `weights`: gathered full tensors."""
    from ..models.adapter import lora_modules, merged_state_dict, save_adapter

    if all(p.requires_grad for p in model.parameters()):
        model.save_pretrained(out, state_dict=weights)
        return
    full = model.state_dict() if weights is None else weights
    merged = merged_state_dict(model, full) if lora_modules(model) else dict(full)
    model.save_pretrained(out, state_dict=merged)  # transformers empties the dict it is given
    save_adapter(model, out, {"window": model.config.window_size}, lora_dtype=torch.float32, state=full)


def load_train_state(ckpt: Path, model, optimizer, scheduler, loader, d: D.Dist) -> int:
    """Restore optimizer, scheduler, RNG and data position from `ckpt`; returns its step.
    The weights were loaded with the model (`from_pretrained(ckpt)`)."""
    state = read_state(ckpt)
    # strict=False: the optimizer state of a checkpoint written by an earlier version names the
    # last layer's base-stream SO, which no forward read (it had no state) and this model lacks.
    set_optimizer_state_dict(model, optimizer, state["optimizer"],
                             options=StateDictOptions(full_state_dict=True, strict=False))
    scheduler.load_state_dict(state["scheduler"])
    loader.load_state_dict(state["data"])
    rngs = state["rng"]
    _set_rng_state(rngs[d.rank] if d.rank < len(rngs) else rngs[0])
    return int(state["step"])


# ------------------------------------------------------ state as JSON + safetensors
def _split(obj, tensors: dict):
    """`obj` with each tensor replaced by {"__tensor__": key}, the tensor stored in `tensors[key]`."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError(f"training state: dict keys must be strings, got {list(obj)[:3]}")
        return {k: _split(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_split(v, tensors) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"training state: cannot store a {type(obj).__name__}")


def _join(obj, tensors: dict, where: Path):
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            if obj["__tensor__"] not in tensors:
                raise UserError(f"{where / STATE_TENSORS}: lacks tensor {obj['__tensor__']!r} that {STATE_JSON} "
                                f"refers to (a damaged checkpoint)")
            return tensors[obj["__tensor__"]]
        return {k: _join(v, tensors, where) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join(v, tensors, where) for v in obj]
    return obj


def write_state(ckpt: Path, state: dict) -> None:
    """`state` (nested dicts / lists of tensors and plain values) as train_state.json + .safetensors."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _split(state, tensors)
    save_file(tensors, str(ckpt / STATE_TENSORS), metadata={"format": "pt"})
    (ckpt / STATE_JSON).write_text(json.dumps(tree) + "\n")


def read_state(ckpt: Path) -> dict:
    """What `write_state` wrote; UserError naming the file for a damaged one."""
    from ..convert.safetensors_stream import read_header

    tree = read_json(ckpt / STATE_JSON, "training state")
    try:
        read_header(ckpt / STATE_TENSORS)  # truncation named before safetensors' own, vaguer error
        tensors = load_file(str(ckpt / STATE_TENSORS))
    except ValueError as e:  # read_header's message names the file
        raise UserError(one_line(e)) from None
    except Exception as e:
        if type(e).__name__ == "SafetensorError":
            raise UserError(f"{ckpt / STATE_TENSORS}: damaged ({one_line(e)})") from None
        raise
    state = _join(tree, tensors, ckpt)
    need = ("step", "optimizer", "scheduler", "rng", "data")
    if not isinstance(state, dict) or any(k not in state for k in need):
        raise UserError(f"{ckpt / STATE_JSON}: not a training state (needs {', '.join(need)})")
    return state
