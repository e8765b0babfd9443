"""The paper's conversion result at small scale: a real model, converted, continued-pretrained.

    orthros experiment cpt --preset smollm2-h200 --device cuda --jobs 8
    orthros experiment cpt --preset smollm2-cpu-smoke            # the whole pipeline in minutes on a CPU

The source is SmolLM2-135M-Instruct (`orthros download`); every arm starts from
its weights and, where it trains, sees the same token rows in the same order
under the same schedule:

    source          the source model, untouched (the same-code full attention)
    orthros-0shot   converted to Orthros (window W), no training
    orthros-cpt     Orthros after CPT (every weight)
    full-cpt        the source architecture after the same CPT (the paper's control)
    swa-cpt         sliding window only after the same CPT (no output stream)
    orthros-noso    Orthros without scale-offset after the same CPT
    orthros-so      light CPT: SO vectors + norms only (an adapter of ~0.1M parameters)
    orthros-lora    light CPT: LoRA (peft) on every projection + SO + norms

Each arm is evaluated on held-out code and prose (`cpt_data`): perplexity at
2K and 8K tokens, the loss by position, the long-range copy probe and pass-key
retrieval through the chat template (`eval.longrange`). Light arms save their
adapter (`models.adapter`). Results: results.json, table.md, plots in --out.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .jobs import run_jobs

ARMS = {  # name -> (label, config changes, trainable mode or None)
    "source": ("Source model (full attention)", dict(attention="full"), None),
    "orthros-0shot": ("Orthros, zero-shot", dict(attention="orthros"), None),
    "orthros-cpt": ("Orthros + CPT", dict(attention="orthros"), "all"),
    "full-cpt": ("Source arch. + CPT", dict(attention="full"), "all"),
    "swa-cpt": ("SWA + CPT", dict(attention="swa"), "all"),
    "orthros-noso": ("Orthros w/o SO + CPT", dict(attention="orthros", scale_offset=False), "all"),
    "orthros-so": ("Orthros + light CPT (SO + norms)", dict(attention="orthros"), "so+norms"),
    "orthros-lora": ("Orthros + light CPT (LoRA + SO)", dict(attention="orthros"), "lora+so"),
}


@dataclass
class CPTPreset:
    window: int = 128
    seq_len: int = 8192
    batch_size: int = 2
    steps: int = 200
    lr: float = 1e-4
    """peak learning rate of full CPT"""
    light_lr: float = 2e-3
    """peak learning rate of SO / norm vectors in light CPT"""
    lora_lr: float = 1e-3
    lora_rank: int = 8
    warmup: int = 20
    weight_decay: float = 0.1
    gradient_checkpointing: bool = True
    eval_rows: int = 16
    """held-out rows per domain at seq_len (the 2K rows are cut from the same documents)"""
    short_len: int = 2048
    copy_gaps: list[int] = field(default_factory=lambda: [512, 2048, 6144])
    copy_samples: int = 32
    passkey_lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 7680])
    passkey_depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    passkey_samples: int = 4
    eval_batch: int = 2
    lm_eval_tasks: list[str] = field(default_factory=lambda: ["python_docs_cloze"])
    """local lm-evaluation-harness tasks (configs/lm_eval; run from the repository root)"""
    lm_eval_limit: int | None = None

    @property
    def train_tokens(self) -> int:
        return self.steps * self.batch_size * self.seq_len


PRESETS = {
    # One H200, all arms side by side (--jobs 8): 16K tokens a step.
    "smollm2-h200": CPTPreset(),
    # The whole pipeline on a CPU in a few minutes: a short window, short rows, a few steps.
    "smollm2-cpu-smoke": CPTPreset(window=16, seq_len=256, batch_size=2, steps=3, warmup=1, eval_rows=2,
                                   short_len=128, copy_gaps=[64], copy_samples=2, passkey_lengths=[160],
                                   passkey_depths=[0.5], passkey_samples=1, gradient_checkpointing=False,
                                   lm_eval_limit=4),
}


# ------------------------------------------------------------------ models
def load_arm(orthros_dir: str | Path, arm: str, window: int, device, dtype=torch.float32):
    """The converted model with an arm's attention; SO tensors dropped where the arm has none."""
    from safetensors.torch import load_file

    from ..models import OrthrosConfig, OrthrosForCausalLM

    _, changes, _ = ARMS[arm]
    cfg = OrthrosConfig.from_pretrained(str(orthros_dir))
    cfg.window_size = window
    for k, v in changes.items():
        setattr(cfg, k, v)
    cfg.validate()
    model = OrthrosForCausalLM(cfg)  # initialised, then every weight overwritten
    state = {}
    for f in sorted(Path(orthros_dir).glob("*.safetensors")):
        state.update(load_file(str(f)))
    want = model.state_dict()
    state = {k: v for k, v in state.items() if k in want}  # no SO tensors for full / swa / w/o SO
    missing = set(want) - set(state) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    if missing:
        raise ValueError(f"{orthros_dir}: lacks {sorted(missing)[:3]} for arm {arm}")
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model.to(device=device, dtype=dtype)


# ------------------------------------------------------------------ training
def lr_factor(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))


def train_arm(model, mode: str, preset: CPTPreset, rows: np.ndarray, device, desc: str, position: int = 0):
    """CPT of one arm on `rows` [steps * batch, seq_len] (the same rows, in order, for every arm)."""
    from ..models.adapter import make_trainable
    from ..models.compat import set_checkpointing

    model = make_trainable(model, mode, rank=preset.lora_rank)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if preset.gradient_checkpointing:
        set_checkpointing(base, True)
    groups = {"decay": [], "vec": [], "lora": []}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups["lora" if "lora_" in name else ("decay" if p.dim() >= 2 else "vec")].append(p)
    lr_vec = preset.lr if mode == "all" else preset.light_lr
    spec = [("decay", preset.lr, preset.weight_decay), ("vec", lr_vec, 0.0), ("lora", preset.lora_lr, 0.0)]
    param_groups = [{"params": groups[g], "lr": lr, "weight_decay": wd, "peak": lr} for g, lr, wd in spec if groups[g]]
    cuda = torch.device(device).type == "cuda"
    opt = torch.optim.AdamW(param_groups, betas=(0.9, 0.95), **({"fused": True} if cuda else {}))
    model.train()
    losses, synced, t0 = [], [], time.time()
    bar = tqdm(total=preset.steps, desc=desc, unit="step", leave=False, position=position)
    B = preset.batch_size
    for step in range(preset.steps):
        f = lr_factor(step, preset.warmup, preset.steps)
        for g in opt.param_groups:
            g["lr"] = g["peak"] * f
        x = torch.from_numpy(rows[step * B : (step + 1) * B].astype(np.int64)).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in param_groups for p in g["params"]], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        bar.update(1)
        if step % 10 == 0 or not cuda:  # .item() syncs: the times below are exact there
            bar.set_postfix_str(f"loss {loss.item():.3f}")
            synced.append((step + 1, time.time() - t0))
    bar.close()
    if preset.gradient_checkpointing:
        set_checkpointing(base, False)
    curve = torch.stack(losses).float().cpu().tolist() if losses else []
    return model.eval(), {"steps": preset.steps, "tokens": preset.train_tokens, "seconds": time.time() - t0,
                          "loss_curve": curve, "synced": synced,
                          "trainable": sum(p.numel() for g in param_groups for p in g["params"])}


# ---------------------------------------------------------------- evaluation
def evaluate_arm(model, tok, preset: CPTPreset, heldout: dict, stream: torch.Tensor) -> dict:
    from ..eval.longrange import chat_passkey, copy_probe, loss_summary, token_losses

    out = {}
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=next(model.parameters()).is_cuda):
        for dom, rows in heldout.items():
            rows = torch.from_numpy(rows.astype(np.int64))
            long = token_losses(model, rows, preset.eval_batch)
            short_rows = rows[:, : preset.short_len]
            short = token_losses(model, short_rows, preset.eval_batch)
            out[dom] = {"long": loss_summary(long), "short": loss_summary(short)}
        out["copy"] = copy_probe(model, stream, preset.copy_gaps, preset.copy_samples, batch_size=preset.eval_batch)
        out["passkey"] = chat_passkey(model, tok, preset.passkey_lengths, preset.passkey_depths,
                                      preset.passkey_samples, batch_size=preset.eval_batch * 2)
        if preset.lm_eval_tasks:
            out["lm_eval"] = lm_eval_scores(model, tok, preset)
    return out


def lm_eval_scores(model, tok, preset: CPTPreset) -> dict:
    """Accuracy on the local lm-eval tasks ({"error": ...} where lm-eval is not installed)."""
    try:
        from ..eval.lm_eval_adapter import evaluate_model
    except ImportError as e:
        return {"error": f"lm-eval not available: {e}"}
    try:
        res = evaluate_model(model, tok, preset.lm_eval_tasks, include_path="configs/lm_eval", batch_size=8,
                             limit=preset.lm_eval_limit)
    except Exception as e:  # one evaluation failing must not lose an arm's other results
        return {"error": f"{type(e).__name__}: {e}"}
    return {t: res["results"][t].get("acc,none") for t in preset.lm_eval_tasks}


def run_arm(arm: str, orthros_dir: str, work: str, preset: CPTPreset, device: str, position: int = 0) -> dict:
    """One arm: load, train (if it trains), save its adapter, evaluate. A worker's job."""
    from ..data.tokenizer import load_tokenizer
    from ..models.adapter import save_adapter

    torch.manual_seed(0)
    work = Path(work)
    tok = load_tokenizer(orthros_dir)
    label, _, mode = ARMS[arm]
    model = load_arm(orthros_dir, arm, preset.window, device)
    stats = None
    saved = work / "adapters" / arm
    if mode not in (None, "all") and (saved / "adapter.json").exists():  # trained by an earlier, cut run
        from ..models.adapter import apply_adapter

        apply_adapter(model, saved)
        info = json.loads((saved / "adapter.json").read_text())
        stats = info.get("train") or {"trainable": info["parameters"], "tokens": info.get("tokens"),
                                      "steps": None, "seconds": None, "loss_curve": []}
        mode = None
    if mode is not None:
        rows = np.load(work / "train_rows.npy", mmap_mode="r")
        model, stats = train_arm(model, mode, preset, rows, device, f"{arm}", position)
        if mode != "all":
            save_adapter(model, saved, {"arm": arm, "mode": mode, "window": preset.window,
                                        "tokens": preset.train_tokens,
                                        "train": {k: v for k, v in stats.items() if k != "synced"}})
            if hasattr(model, "merge_and_unload"):
                model = model.merge_and_unload()
    heldout = {k: np.load(work / f"heldout_{k}.npy") for k in ("code", "prose")}
    stream = torch.from_numpy(np.load(work / "copy_stream.npy").astype(np.int64))
    t = time.time()
    ev = evaluate_arm(model, tok, preset, heldout, stream)
    res = {"arm": arm, "label": label, "train": stats, "eval": ev, "eval_seconds": time.time() - t}
    (work / f"arm-{arm}.json").write_text(json.dumps(res, indent=2))
    return res


# ------------------------------------------------------------------ the run
def prepare(source: str | Path, work: Path, preset: CPTPreset) -> Path:
    """Source (a HF dir or a GGUF) -> the converted Orthros dir; tokenized data under `work`."""
    from ..convert.hf import convert_checkpoint
    from ..data.tokenizer import load_tokenizer
    from .cpt_data import heldout_sets, train_stream

    work.mkdir(parents=True, exist_ok=True)
    conv = work / "orthros"
    if not (conv / "config.json").exists():
        convert_checkpoint(source, conv, window_size=preset.window, dtype="fp32", progress=False)
    tok = load_tokenizer(conv)
    n = preset.steps * preset.batch_size
    if not (work / "train_rows.npy").exists():
        stream = train_stream(tok, n * preset.seq_len, work / "cache")
        if len(stream) < n * preset.seq_len:
            raise ValueError(f"only {len(stream):,} training tokens on this machine; the preset needs "
                             f"{n * preset.seq_len:,}")
        np.save(work / "train_rows.npy", stream.reshape(n, preset.seq_len).astype(np.int32))
    held = heldout_sets(tok, preset.seq_len, preset.eval_rows, work / "cache")
    for k, v in held.items():
        np.save(work / f"heldout_{k}.npy", v)
    # copy-probe text: held-out prose and code beyond the rows above
    extra = heldout_sets(tok, preset.seq_len, 2 * preset.eval_rows, work / "cache")
    stream = np.concatenate([extra["prose"][preset.eval_rows:].ravel(), extra["code"][preset.eval_rows:].ravel()])
    if len(stream) < max(preset.copy_gaps) + 1000:
        stream = np.concatenate([stream, held["prose"].ravel()])
    np.save(work / "copy_stream.npy", stream)
    return conv


def run_cpt(preset_name: str, source: str | Path, out: str | Path, arms=tuple(ARMS), device: str = "cpu",
            jobs: int = 1, steps: int | None = None, lm_eval_limit: int | None = None) -> dict:
    if preset_name not in PRESETS:
        raise ValueError(f"unknown preset {preset_name!r}; choose from {', '.join(PRESETS)}")
    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise ValueError(f"unknown arm(s) {', '.join(bad)}; choose from {', '.join(ARMS)}")
    preset = PRESETS[preset_name]
    if steps is not None:
        preset = dataclasses.replace(preset, steps=steps)
    if lm_eval_limit is not None:
        preset = dataclasses.replace(preset, lm_eval_limit=lm_eval_limit)
    out = Path(out)
    t0 = time.time()
    conv = prepare(source, out, preset)
    print(f"prepared {conv} and data in {time.time() - t0:.0f}s", flush=True)
    done = run_jobs(run_arm, [(a, str(conv), str(out), preset, device, i) for i, a in enumerate(arms)], jobs)
    results = {r["arm"]: r for r in done}
    meta = {"preset": preset_name, "config": dataclasses.asdict(preset), "train_tokens": preset.train_tokens,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": device,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__, "seed": 0, "seconds": time.time() - t0}
    return write_report(results, preset, meta, out)


def write_report(results: dict, preset: CPTPreset, meta: dict, out: str | Path, name: str = "results.json") -> dict:
    """results.json, table.md, cpt.png and cpt-train.png under `out`; arms in ARMS order."""
    from .cpt_report import format_table, plot_all

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results = {a: results[a] for a in ARMS if a in results}
    (out / name).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    table = format_table(results, preset)
    (out / "table.md").write_text(table + "\n")
    plot_all(results, preset, out)
    return {"meta": meta, "results": results, "table": table}


def merge_runs(files: list[str | Path], out: str | Path, name: str = "results.json") -> dict:
    """One report from several runs' results.json / arm-*.json files (a later file's arm wins)."""
    results, metas = {}, []
    for f in files:
        d = json.loads(Path(f).read_text())
        if "results" in d:
            results.update(d["results"])
            metas.append(d["meta"])
        else:
            results[d["arm"]] = d
    if not metas:
        raise ValueError("--from-json needs at least one results.json (it carries the preset)")
    meta = dict(metas[-1], merged_from=[str(f) for f in files], runs=[m.get("date") for m in metas])
    cfg = dict(meta["config"])
    preset = CPTPreset(**cfg)
    return write_report(results, preset, meta, out, name)
