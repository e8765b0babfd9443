"""Light continued pre-training: train a small delta, ship it as an adapter file.

A converted model differs from its source only by the scale-offset (SO)
vectors; continued pre-training of the whole model is what the paper does,
but a small trained delta on top of the public weights may recover most of
the quality:

    so          the SO vectors only (4 x hidden per layer)
    so+norms    SO and the RMSNorm weights
    lora+so     LoRA (peft) on every projection, plus SO and norms

    model = OrthrosForCausalLM.from_pretrained("runs/smollm2-orthros")
    model = make_trainable(model, "lora+so", rank=8)    # a peft model for "lora+so"
    ... train ...
    save_adapter(model, "adapters/smollm2-w128")         # adapter.safetensors + adapter.json
    apply_adapter(base, "adapters/smollm2-w128")         # LoRA merged into the weights, SO / norms set

The adapter file holds the trained tensors' values (SO, norms) and the LoRA
factors; applying it needs no peft.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

MODES = ("all", "so", "so+norms", "lora+so")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SO_NAMES = ("so_alpha", "so_beta", "so_alpha_out", "so_beta_out")


def _is_so(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in SO_NAMES


def _is_norm(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and "norm" in parts[-2]


def make_trainable(model, mode: str, rank: int = 8, alpha: float | None = None, dropout: float = 0.0):
    """Freeze all but the `mode`'s parameters; for "lora+so" return a peft model."""
    if mode not in MODES:
        raise ValueError(f"trainable mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "all":
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    if not getattr(model.config, "scale_offset", False) or model.config.attention != "orthros":
        raise ValueError(f"trainable mode {mode!r} needs an Orthros model with scale-offset")
    if mode == "lora+so":
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise ValueError("LoRA training needs peft: pip install peft") from None
        cfg = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, lora_dropout=dropout,
                         target_modules=list(LORA_TARGETS), bias="none")
        model = get_peft_model(model, cfg)
    for name, p in model.named_parameters():
        if "lora_" in name:
            continue  # peft set these trainable
        p.requires_grad_(_is_so(name) or (mode != "so" and _is_norm(name)))
    return model


def _clean(name: str) -> str:
    """A peft parameter name -> the base model's (base_model.model.X.base_layer.weight -> X.weight)."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def save_adapter(model, out: str | Path, meta: dict | None = None, lora_dtype=torch.bfloat16) -> Path:
    """Write the trained delta: adapter.safetensors (+ adapter.json), atomically.

    SO / norm vectors are kept in fp32 (they are small); LoRA factors in `lora_dtype`
    (bf16 halves the file; the merged weights are fp32 or bf16 anyway)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors, lora = {}, {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if "lora_" in name:  # ...q_proj.lora_A.default.weight -> q_proj.lora_A
            mod, kind = name.split(".lora_")
            key = f"{_clean(mod)}.lora_{kind.split('.')[0]}"
            tensors[key] = p.detach().to(lora_dtype).cpu().contiguous()
            lora[_clean(mod)] = True
        else:
            tensors[_clean(name)] = p.detach().float().cpu().contiguous()
    if not tensors:
        raise ValueError("the model has no trainable parameters to save as an adapter")
    info = {"format": "orthros-adapter", "version": 1, "tensors": len(tensors),
            "parameters": sum(t.numel() for t in tensors.values()), **(meta or {})}
    peft_cfg = getattr(model, "peft_config", None)
    if peft_cfg:
        c = next(iter(peft_cfg.values()))
        info["lora"] = {"rank": c.r, "alpha": c.lora_alpha, "modules": sorted(lora)}
    _write(out, tensors, info)
    return out


def _write(out: Path, tensors: dict, info: dict) -> None:
    tmp = out / f".adapter.{os.getpid()}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "adapter.safetensors")
    tmp = out / f".adapter.{os.getpid()}.json.tmp"
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp, out / "adapter.json")


def recast_adapter(src: str | Path, dst: str | Path, lora_dtype=torch.bfloat16) -> Path:
    """Copy an adapter with its LoRA factors cast to `lora_dtype` (vectors stay as they are)."""
    src, dst = Path(src), Path(dst)
    tensors = load_file(str(src / "adapter.safetensors"))
    tensors = {k: v.to(lora_dtype).contiguous() if ".lora_" in k else v for k, v in tensors.items()}
    dst.mkdir(parents=True, exist_ok=True)
    _write(dst, tensors, json.loads((src / "adapter.json").read_text()))
    return dst


@torch.no_grad()
def apply_adapter(model, path: str | Path):
    """Add a saved adapter to a base model in place (LoRA merged: W += B A * alpha / r)."""
    path = Path(path)
    f = path / "adapter.safetensors" if path.is_dir() else path
    meta_path = f.with_name("adapter.json")
    if not f.is_file() or not meta_path.is_file():
        raise FileNotFoundError(f"{path}: no adapter.safetensors + adapter.json")
    try:
        info = json.loads(meta_path.read_text())
        tensors = load_file(str(f))
    except Exception as e:
        raise ValueError(f"{f}: damaged adapter ({type(e).__name__}: {e})") from None
    params = dict(model.named_parameters())
    lora = info.get("lora")
    scale = lora["alpha"] / lora["rank"] if lora else None
    for name, t in tensors.items():
        if name.endswith(".lora_A"):
            mod = name[: -len(".lora_A")]
            w = params.get(f"{mod}.weight")
            b = tensors.get(f"{mod}.lora_B")
            if w is None or b is None:
                raise ValueError(f"{f}: LoRA factors for {mod!r} do not fit this model")
            w += (b.float() @ t.float() * scale).to(w.device, w.dtype)  # the file loads on the CPU
        elif name.endswith(".lora_B"):
            continue
        else:
            p = params.get(name)
            if p is None or p.shape != t.shape:
                raise ValueError(f"{f}: tensor {name!r} {tuple(t.shape)} does not fit this model")
            p.copy_(t.to(p.dtype))
    return model
