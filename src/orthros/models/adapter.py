"""Light continued pre-training: train a small delta, ship it as an adapter file.

A converted model differs from its source only by the scale-offset (SO)
vectors; continued pre-training of the whole model is what the paper does,
but a small trained delta on top of the public weights may recover most of
the quality:

    so-out      the output stream's SO vectors only (2 x hidden per layer): the base
                stream, and so every layer's K/V cache, stays the conversion's (to
                rounding on CUDA); only how the output rows query the cache is learnt
    so          the SO vectors only (4 x hidden per layer, 2 in the last)
    so+norms    SO and the RMSNorm weights
    lora+so     LoRA on every projection, plus SO and norms

    model = OrthrosForCausalLM.from_pretrained("runs/smollm2-orthros")
    model = make_trainable(model, "lora+so", rank=8)    # projections wrapped in LoRALinear
    ... train ...
    save_adapter(model, "adapters/smollm2-w128")         # adapter.safetensors + adapter.json
    apply_adapter(base, "adapters/smollm2-w128")         # LoRA merged into the weights, SO / norms set

The adapter file holds the trained tensors' values (SO, norms) and the LoRA
factors (`q_proj.lora_A` [r, in], `q_proj.lora_B` [out, r], scale alpha / r).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

SHIPPED = Path(__file__).resolve().parents[3] / "adapters"
"""the adapters this project ships (a source checkout's adapters/)"""

MODES = ("all", "so-out", "so", "so+norms", "lora+so")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HEAD = "lm_head"
"""a LoRA target beside the projections: the LM head. A tied head gets a delta of its own (the input
embedding stays the source's); merged, the head is untied (`tie_word_embeddings` False)."""
LORA_KNOWN = (*LORA_TARGETS, HEAD)
"""every name `make_trainable`'s LoRA targets may hold"""
SO_NAMES = ("so_alpha", "so_beta", "so_alpha_out", "so_beta_out")
SO_OUT_NAMES = ("so_alpha_out", "so_beta_out")


def _is_so(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in SO_NAMES


def _is_norm(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and "norm" in parts[-2]


class LoRALinear(nn.Module):
    """`nn.Linear` plus a trainable low-rank delta: y = x W^T + (x A^T) B^T * alpha / r.

    Keeps the wrapped layer's `weight` / `bias` under their own names, so a state dict
    holds `q_proj.weight` beside `q_proj.lora_A` [r, in] and `q_proj.lora_B` [out, r]:
    the names an adapter file uses. B starts at zero (the model is unchanged at step 0).

    `dora`: weight-decomposed LoRA (DoRA, Liu et al. 2024): V = W + B A * alpha / r and each output
    row rescaled to a trained length, W' = m * V / ||V|| (`lora_magnitude` [out], fp32, starting
    at ||W||'s rows). As in the paper, ||V|| is a constant to the backward pass (no gradient flows
    through it), which keeps the step's memory that of LoRA's."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dora: bool = False):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_A, a=5 ** 0.5)  # as nn.Linear initialises a weight
        self.lora_magnitude = nn.Parameter(base.weight.detach().float().norm(dim=1)) if dora else None

    def forward(self, x):
        delta = F.linear(F.linear(x, self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype)) * self.scale
        if self.lora_magnitude is None:
            return F.linear(x, self.weight, self.bias) + delta
        y = (F.linear(x, self.weight) + delta) * (self.lora_magnitude / self.row_norms()).to(x.dtype)
        return y if self.bias is None else y + self.bias

    @torch.no_grad()
    def row_norms(self) -> torch.Tensor:
        """||W + B A * alpha / r|| of each output row [out], fp32 (DoRA's denominator)."""
        return lora_sum(self.weight, self.lora_A, self.lora_B, self.scale).norm(dim=1)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        return merge_delta(self.weight, self.lora_A, self.lora_B, self.scale, self.lora_magnitude)


def lora_sum(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + B A * scale in fp32 (on W's device)."""
    return w.float() + (b.float() @ a.float()).to(w.device) * scale


def merge_delta(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
                magnitude: torch.Tensor | None = None) -> torch.Tensor:
    """The merged weight of W and its LoRA factors (with DoRA's row lengths where given), in W's dtype."""
    v = lora_sum(w, a, b, scale)
    if magnitude is not None:
        v = v * (magnitude.float().to(v.device) / v.norm(dim=1))[:, None]
    return v.to(w.dtype)


def lora_modules(model) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def make_trainable(model, mode: str, rank: int = 8, alpha: float | None = None, targets=LORA_TARGETS,
                   dora: bool = False):
    """Freeze all but the `mode`'s parameters (in place; returns the model).

    "lora+so" wraps each projection named in `targets` (default every one, `LORA_TARGETS`) in a
    `LoRALinear` first (`dora`: weight-decomposed); the wrapped model's forward is the merged model's."""
    if mode not in MODES:
        raise ValueError(f"trainable mode must be one of {', '.join(MODES)}, got {mode!r}")
    if not targets or set(targets) - set(LORA_KNOWN):
        raise ValueError(f"LoRA targets must be some of {', '.join(LORA_KNOWN)}, got {tuple(targets)}")
    if mode == "all":
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    if not getattr(model.config, "scale_offset", False) or model.config.attention != "orthros":
        raise ValueError(f"trainable mode {mode!r} needs an Orthros model with scale-offset")
    if mode == "lora+so":
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        alpha = float(alpha if alpha is not None else 2 * rank)
        for name, mod in list(model.named_modules()):
            for child, sub in list(mod.named_children()):
                if child in targets and isinstance(sub, nn.Linear):
                    setattr(mod, child, LoRALinear(sub, rank, alpha, dora))
    for name, p in model.named_parameters():
        if mode == "so-out":
            p.requires_grad_(name.rsplit(".", 1)[-1] in SO_OUT_NAMES)
        else:
            p.requires_grad_(".lora_" in name or _is_so(name) or (mode != "so" and _is_norm(name)))
    return model


def merged_state_dict(model, state: dict | None = None) -> dict:
    """The plain model's state dict: every LoRA delta merged into its weight, no lora_* keys.
    `state`: a full state dict to merge (e.g. gathered from FSDP shards); default the model's."""
    state = dict(model.state_dict() if state is None else state)
    mods = lora_modules(model)
    for name, m in mods.items():
        a, b = state.pop(f"{name}.lora_A"), state.pop(f"{name}.lora_B")
        state[f"{name}.weight"] = merge_delta(state[f"{name}.weight"], a, b, m.scale,
                                              state.pop(f"{name}.lora_magnitude", None))
    if HEAD in mods:
        _untie(model.config)
    return state


def _untie(config) -> None:
    """A merged LM-head delta makes the head a matrix of its own: say so in the config (and its
    text config, where the model has one), so that loading the merged weights does not tie them back."""
    for c in (config, getattr(config, "text_config", None)):
        if c is not None and getattr(c, "tie_word_embeddings", False):
            c.tie_word_embeddings = False


@torch.no_grad()
def merge_lora(model):
    """Replace every `LoRALinear` by a plain `nn.Linear` holding the merged weight (in place)."""
    mods = lora_modules(model)
    if HEAD in mods:
        _untie(model.config)
    for name, m in mods.items():
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device=m.weight.device,
                        dtype=m.weight.dtype)
        lin.weight.copy_(m.merged_weight())
        if m.bias is not None:
            lin.bias.copy_(m.bias)
        lin.weight.requires_grad_(m.weight.requires_grad)
        setattr(parent, name.rsplit(".", 1)[-1], lin)
    return model


def _is_factor(name: str) -> bool:
    """A LoRA factor (lora_A / lora_B), stored in the adapter's LoRA dtype; vectors stay fp32."""
    return name.endswith((".lora_A", ".lora_B"))


def adapter_tensors(model, lora_dtype=torch.float32, state: dict | None = None) -> dict:
    """The trainable delta as {name: tensor}: SO / norm vectors in fp32, LoRA factors in
    `lora_dtype`. `state`: full tensors (e.g. gathered from FSDP shards); default the model's."""
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    state = model.state_dict() if state is None else state
    out = {}
    for name in sorted(trainable):
        t = state[name].detach()
        out[name] = (t.to(lora_dtype) if _is_factor(name) else t.float()).cpu().contiguous()
    return out


def save_adapter(model, out: str | Path, meta: dict | None = None, lora_dtype=torch.bfloat16,
                 state: dict | None = None) -> Path:
    """Write the trained delta: adapter.safetensors (+ adapter.json), atomically.

    SO / norm vectors (and DoRA's row lengths) are kept in fp32 (they are small); LoRA factors in
    `lora_dtype` (bf16 halves the file; the merged weights are fp32 or bf16 anyway)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = adapter_tensors(model, lora_dtype, state)
    if not tensors:
        raise ValueError("the model has no trainable parameters to save as an adapter")
    info = {"format": "orthros-adapter", "version": 1, "tensors": len(tensors),
            "parameters": sum(t.numel() for t in tensors.values()), **(meta or {})}
    mods = lora_modules(model)
    if mods:
        m = next(iter(mods.values()))
        info["lora"] = {"rank": m.rank, "alpha": m.alpha, "modules": sorted(mods),
                        **({"dora": True} if m.lora_magnitude is not None else {})}
    _write(out, tensors, info)
    return out


@torch.no_grad()
def load_trainable(model, path: str | Path) -> None:
    """Set a `make_trainable` model's trainable tensors from a saved adapter, unmerged
    (exact resume: LoRA factors stay factors). Every trainable tensor must be in the file."""
    f = Path(path) / "adapter.safetensors" if Path(path).is_dir() else Path(path)
    tensors = _known(load_file(str(f)), model)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(tensors) != set(params):
        missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
        raise ValueError(f"{f}: does not hold this model's trainable tensors (missing {missing[:3]}, "
                         f"unexpected {extra[:3]})")
    for n, p in params.items():
        p.copy_(tensors[n].to(p.device, p.dtype))


def _known(tensors: dict, model) -> dict:
    """An adapter's tensors without those earlier versions saved and this model has no place for
    (the last layer's base-stream SO, which no forward reads: `models.model.unused_tensor_pattern`)."""
    from .model import unused_checkpoint_tensor

    return {n: t for n, t in tensors.items() if not unused_checkpoint_tensor(n, model.config)}


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
    tensors = {k: v.to(lora_dtype).contiguous() if _is_factor(k) else v for k, v in tensors.items()}
    dst.mkdir(parents=True, exist_ok=True)
    _write(dst, tensors, json.loads((src / "adapter.json").read_text()))
    return dst


@torch.no_grad()
def extract_adapter(trained, base, out: str | Path, rank: int = 16, lora_dtype=torch.bfloat16,
                    meta: dict | None = None) -> dict:
    """A full-weight fine-tune of `base` written as an adapter of it: every changed 2-D weight as its
    best rank-`rank` approximation (truncated SVD, split as LoRA factors B [out, r] = U sqrt(S) and
    A [r, in] = sqrt(S) V^T, alpha = rank: `apply_adapter` adds B A), every other changed tensor
    (SO, norms) as its trained value; unchanged tensors are left out, a tied LM head too. How much
    of the change a rank keeps is recorded per weight (relative Frobenius error of the delta, in
    adapter.json); what it keeps of the model's quality is the caller's to measure. Returns the
    adapter's info."""
    tsd, bsd = trained.state_dict(), base.state_dict()
    if set(tsd) != set(bsd) or any(tsd[k].shape != bsd[k].shape for k in tsd):
        diff = sorted(set(tsd) ^ set(bsd)) or [k for k in tsd if tsd[k].shape != bsd[k].shape]
        raise ValueError(f"the trained model and its base differ in their tensors ({diff[:3]}): an adapter "
                         "holds a change of one model, not of its shape")
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    skip = {"lm_head.weight"} if getattr(trained.config, "tie_word_embeddings", False) else set()
    tensors, errors = {}, {}
    for name in sorted(tsd):
        t = tsd[name]
        if name in skip or not t.is_floating_point():
            continue
        d = t.detach().float().cpu() - bsd[name].detach().float().cpu()
        if not d.any():
            continue
        if d.ndim == 2 and name.endswith(".weight"):
            U, S, Vh = torch.linalg.svd(d, full_matrices=False)
            r = min(rank, S.numel())
            root = S[:r].sqrt()
            mod = name[: -len(".weight")]
            tensors[f"{mod}.lora_A"] = (root[:, None] * Vh[:r]).to(lora_dtype).contiguous()
            tensors[f"{mod}.lora_B"] = (U[:, :r] * root).to(lora_dtype).contiguous()
            errors[mod] = float(S[r:].square().sum().sqrt() / S.square().sum().sqrt())
        else:
            tensors[name] = t.detach().float().cpu().contiguous()
    if not tensors:
        raise ValueError("the trained model equals its base: nothing to extract")
    info = {"format": "orthros-adapter", "version": 1, "tensors": len(tensors),
            "parameters": sum(x.numel() for x in tensors.values()), "mode": "extracted",
            "window": trained.config.window_size, "sink_tokens": trained.config.sink_tokens, **(meta or {}),
            "lora": {"rank": rank, "alpha": rank, "modules": sorted(errors)},
            "relative_error": {k: round(v, 5) for k, v in errors.items()}}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _write(out, tensors, info)
    return info


def adapter_mismatch(info: dict, window: int, sinks: int) -> str | None:
    """Why an adapter (its adapter.json `info`) does not fit a model of this window and sink count,
    or None: it was trained at one window (None: not recorded) and with one number of sinks."""
    if info.get("window") not in (None, window) or info.get("sink_tokens", 0) != sinks:
        return (f"trained at W={info.get('window')} with {info.get('sink_tokens', 0)} sink tokens, "
                f"not W={window} with {sinks}")
    return None


@torch.no_grad()
def apply_adapter(model, path: str | Path):
    """Add a saved adapter to a base model in place (LoRA merged: W += B A * alpha / r, with DoRA's row
    lengths where the adapter has them). An adapter
    trained at another window or sink count than the model's is refused (`adapter_mismatch`)."""
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
    cfg = model.config
    why = adapter_mismatch(info, getattr(cfg, "window_size", None), getattr(cfg, "sink_tokens", 0))
    if why:
        raise ValueError(f"{path}: {why}")
    tensors = _known(tensors, model)
    params = dict(model.named_parameters())
    lora = info.get("lora")
    scale = lora["alpha"] / lora["rank"] if lora else None
    for name, t in tensors.items():
        if name.endswith(".lora_A"):
            mod = name[: -len(".lora_A")]
            w = params.get(f"{mod}.weight")
            if w is None and mod == HEAD and getattr(model, HEAD, None) is not None:  # tied: the head's own copy
                head = getattr(model, HEAD)
                head.weight = w = nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
                _untie(cfg)
            b = tensors.get(f"{mod}.lora_B")
            if w is None or b is None:
                raise ValueError(f"{f}: LoRA factors for {mod!r} do not fit this model")
            w.copy_(merge_delta(w, t, b, scale, tensors.get(f"{mod}.lora_magnitude")))  # the file is on the CPU
        elif name.endswith((".lora_B", ".lora_magnitude")):
            continue
        else:
            p = params.get(name)
            if p is None or p.shape != t.shape:
                raise ValueError(f"{f}: tensor {name!r} {tuple(t.shape)} does not fit this model")
            p.copy_(t.to(p.dtype))
    return model
