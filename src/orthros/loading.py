"""Loading a saved model directory: everything checked first, safetensors only.

    model = load_model("runs/demo")     # config.json + model.safetensors (or shards + index)

Before a weight is read, `config.json` must parse and validate as an Orthros
config, every safetensors header must be intact (no truncation), and the
tensors must be exactly the ones the config implies (names and shapes). So a
damaged, truncated or mismatched checkpoint is one error naming the file,
never a traceback or, worse, a model whose missing layers were silently
initialised at random. Pickle checkpoints (`pytorch_model.bin`, `*.pt`) are
refused without being opened: unpickling a file can run arbitrary code.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .convert.hf import PICKLE_SUFFIXES
from .errors import UserError, one_line, read_json

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SO_NAMES = ("so_alpha", "so_beta", "so_alpha_out", "so_beta_out")  # scale-offset vectors: identity when absent


def model_dir(path: str | Path) -> Path:
    """`path` as a directory holding config.json; UserError otherwise."""
    d = Path(path)
    if not d.exists():
        raise UserError(f"{d}: not a model directory (it does not exist)")
    if not d.is_dir():
        raise UserError(f"{d}: not a model directory (a file; expected a directory with {CONFIG} and {WEIGHTS})")
    if not (d / CONFIG).is_file():
        raise UserError(f"{d}: not a model directory (no {CONFIG})")
    return d


def read_config(path: str | Path):
    """The OrthrosConfig of a model directory; UserError naming config.json for bad JSON or values."""
    from .models import OrthrosConfig

    d = model_dir(path)
    f = d / CONFIG
    raw = read_json(f, "config file")
    if not isinstance(raw, dict):
        raise UserError(f"{f}: must hold a JSON object, got {type(raw).__name__}")
    kind = raw.get("model_type")
    if kind != OrthrosConfig.model_type:
        hint = " (a Hugging Face checkpoint? convert it with `orthros convert`)" if kind in ("llama", "qwen3") else ""
        raise UserError(f"{f}: model_type is {kind!r}, not {OrthrosConfig.model_type!r}{hint}")
    hidden, heads = raw.get("hidden_size"), raw.get("num_attention_heads")
    if (raw.get("head_dim") is None and type(hidden) is int and type(heads) is int and heads > 0
            and hidden % heads):
        raise UserError(f"{f}: hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                        f"(and no head_dim is given)")
    try:
        return OrthrosConfig.from_pretrained(str(d))
    except (ValueError, TypeError, KeyError) as e:  # OrthrosConfig.validate names the field
        raise UserError(f"{f}: {one_line(e)}") from e


def weight_files(d: Path) -> list[Path]:
    """The safetensors files of model directory `d` (one file, or the shards its index lists)."""
    index = d / INDEX
    if index.exists():
        idx = read_json(index, "safetensors index")
        wm = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) for v in wm.values()):
            raise UserError(f"{index}: no 'weight_map' (tensor name -> shard file)")
        files = sorted(set(wm.values()))
        missing = [f for f in files if not (d / f).is_file()]
        if missing:
            raise UserError(f"{index}: lists {len(missing)} shard(s) that do not exist, e.g. {missing[0]}")
        return [d / f for f in files]
    if (d / WEIGHTS).is_file():
        return [d / WEIGHTS]
    names = sorted(p.name for p in d.iterdir() if p.is_file())
    pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise UserError(f"{d / pickles[0]}: a pickle-format checkpoint, refused: orthros loads weights from "
                        f"safetensors only and never unpickles a file (that can run arbitrary code); "
                        f"re-save the model as {WEIGHTS} where you trust it")
    shards = [n for n in names if n.endswith(".safetensors")]
    found = f" (found {', '.join(shards)} but no {INDEX})" if shards else ""
    raise UserError(f"{d}: no {WEIGHTS} (or {INDEX}){found}")


def check_weights(d: Path, config, files: list[Path], new_scale_offset: bool = False) -> None:
    """Every tensor the config implies is in `files` with its shape, and nothing else.

    new_scale_offset: the config was changed on purpose (fine-tuning with
    another attention or without SO), so SO vectors may be absent (initialised
    at identity) or left over (not used)."""
    from .convert.hf import expected_tensors
    from .convert.safetensors_stream import read_header
    from .models.model import unused_checkpoint_tensor

    want = expected_tensors(config)
    have = {}
    for f in files:
        try:
            infos, _ = read_header(f)
        except ValueError as e:  # its message starts with the file
            raise UserError(one_line(e)) from None
        have.update(infos)

    def excused(name):
        return (new_scale_offset and name.rsplit(".", 1)[-1] in SO_NAMES) or (
            name == "lm_head.weight" and config.tie_word_embeddings)

    where = files[0] if len(files) == 1 else d / INDEX
    missing = [n for n in want if n not in have and not excused(n)]
    if missing:
        raise UserError(f"{where}: lacks {len(missing)} tensor(s) that {d / CONFIG} implies, e.g. "
                        f"{', '.join(missing[:3])} (a damaged checkpoint, or a config.json that does not match it)")
    # older checkpoints hold the last layer's base-stream SO, which no forward reads: skipped
    extra = [n for n in have if n not in want and not excused(n) and not unused_checkpoint_tensor(n, config)]
    if extra:
        raise UserError(f"{where}: holds {len(extra)} tensor(s) that {d / CONFIG} does not imply, e.g. "
                        f"{', '.join(extra[:3])} (a config.json that does not match the weights?)")
    for name, info in have.items():
        if name in want and info.shape != want[name]:
            raise UserError(f"{info.file}: tensor {name} has shape {list(info.shape)}, but {d / CONFIG} implies "
                            f"{list(want[name])}")
        if not info.torch_dtype.is_floating_point:
            raise UserError(f"{info.file}: tensor {name} has non-float dtype {info.dtype}")


def check_model_dir(path: str | Path, config=None, new_scale_offset: bool = False):
    """Everything `load_model` checks, without reading a weight; returns the config."""
    d = model_dir(path)
    config = read_config(d) if config is None else config
    check_weights(d, config, weight_files(d), new_scale_offset)
    return config


def load_model(path: str | Path, dtype: torch.dtype | None = None, config=None, new_scale_offset: bool = False):
    """An OrthrosForCausalLM from a checked model directory (safetensors only).

    dtype: None keeps the checkpoint's. config: load under this config instead
    of the directory's own (e.g. a fine-tuning run's changes)."""
    from .models import OrthrosForCausalLM

    d = Path(path)
    config = check_model_dir(d, config, new_scale_offset)
    try:
        model = OrthrosForCausalLM.from_pretrained(str(d), config=config, use_safetensors=True,
                                                   dtype="auto" if dtype is None else dtype)
    except Exception as e:
        if type(e).__name__ == "SafetensorError":  # a damage the header checks cannot see
            raise UserError(f"{d}: damaged safetensors weights ({one_line(e)})") from e
        raise
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            raise UserError(f"{d}: weight {name} holds NaN or infinite values (a damaged checkpoint)")
    return model


def resolve_device(name: str, flag: str = "--device") -> torch.device:
    """A device the user named, checked to exist here."""
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise UserError(f"{flag} {name!r}: not a device (use cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"{flag} {name}: no CUDA device is available on this machine (use --device cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(f"{flag} {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu" and not (dev.type == "mps" and torch.backends.mps.is_available()):
        raise UserError(f"{flag} {name}: not available here (use cpu or cuda)")
    return dev
