"""The small-scale paper comparison: recall, retrieval and perplexity.

Trains equal-size `full` (Transformer), `swa`, `orthros` and `orthros`
without scale-offset on the same data for the same steps, then evaluates
each on held-out MQAR at lengths up to >= 16 W, on passkey retrieval and on
stdlib perplexity:

    orthros experiment recall --preset cpu           # <= 10 min on 2 CPU cores
    orthros experiment recall --preset cpu-passkey   # the same, with passkey training (<= 10 min)
    orthros experiment recall --preset cpu-passkey-w4  # the same, passkey loss weighted 4x (<= 10 min)
    orthros experiment recall --preset cpu-mqar      # zoology-style: MQAR only, ~2 min per model
    orthros experiment recall --preset gpu --device cuda

Training data, every step (one loss per task, summed — the passkey's with a weight,
`Preset.passkey_weight` — so no task drowns):
    * MQAR sequences (zoology trains on MQAR directly), loss on the answers
      only — the SFT phase: output positions at the queried keys;
    * Python-source text, loss everywhere — so perplexity means something;
    * passkey samples with a random needle depth, loss on the key's digits (the
      answer and, optionally, the key's second copy inside the needle).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..data.stdlib import stdlib_text
from ..data.tokenizer import ByteTokenizer
from ..eval.mqar import mqar_batch
from ..eval.passkey import passkey_batch
from ..eval.tasks import eval_mqar, eval_passkey, eval_perplexity, heldout_tokens
from ..layers.fused import fused_mode
from ..models import OrthrosForCausalLM
from .jobs import run_jobs
from .presets import ARCHS, DEFAULT_ARCHS, LABELS, PRESETS, Preset
from .report import aggregate, format_table, plot


class TrainData:
    """Endless seeded batches of the three training tasks (byte tokens)."""

    def __init__(self, preset: Preset, seed: int):
        self.p = preset
        self.tok = ByteTokenizer()
        self.text = torch.tensor(self.tok.encode(stdlib_text("train", max_bytes=preset.text_bytes)), dtype=torch.long)
        self.seed = seed

    def batch(self, step: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        p, s = self.p, self.seed * 1_000_003 + step
        if p.passkey_batch and step < p.passkey_first:
            ids, labels, _ = passkey_batch(self.text, self.tok.encode, p.passkey_batch, p.passkey_lengths[0], None,
                                           seed=s, copy_labels=p.passkey_copy_labels)
            return {"passkey": (ids, labels)}
        out = {"mqar": mqar_batch(p.mqar_batch, p.mqar_train, seed=s)}
        if p.text_batch:
            g = torch.Generator().manual_seed(s)
            idx = torch.randint(0, self.text.numel() - p.text_seq_len, (p.text_batch,), generator=g)
            x = self.text[idx[:, None] + torch.arange(p.text_seq_len)]
            out["text"] = (x, x)
        if p.passkey_batch:
            lengths = p.passkey_lengths_late if p.passkey_lengths_late and step >= p.passkey_late_from \
                else p.passkey_lengths
            L = lengths[step % len(lengths)]
            n = max(1, p.passkey_batch * p.passkey_lengths[0] // L)
            ids, labels, _ = passkey_batch(self.text, self.tok.encode, n, L, None, seed=s,
                                           copy_labels=p.passkey_copy_labels)
            out["passkey"] = (ids, labels)
        return out


def train_model(arch: str, preset: Preset, data: TrainData, seed: int = 0, device="cpu", desc: str | None = None,
                seconds: float | None = None, steps: int | None = None, position: int = 0):
    """Train one architecture for `steps` (default the preset's) or for `seconds` of wall time.

    Returns (model in eval mode, {"loss_<task>": smoothed final losses, "seconds", "steps"}).
    """
    torch.manual_seed(seed)
    model = OrthrosForCausalLM(preset.model_config(arch)).to(device)
    decay = [q for q in model.parameters() if q.dim() >= 2]
    other = [q for q in model.parameters() if q.dim() < 2]  # norms and SO vectors: no decay
    fused = {"fused": True} if torch.device(device).type == "cuda" else {}  # one kernel per step on the GPU
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": preset.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=preset.lr, betas=(0.9, 0.95), **fused)
    model.train()
    on_cpu = torch.device(device).type == "cpu"
    total_steps = steps or preset.steps
    avg: dict[str, float] = {}
    start, step = time.time(), 0
    if seconds is not None:
        bar = tqdm(total=round(seconds), desc=desc or arch, unit="s", leave=False, position=position,
                   bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}s {postfix}")
    else:
        bar = tqdm(total=total_steps, desc=desc or arch, unit="step", leave=False, position=position)
    while True:
        elapsed = time.time() - start
        progress = elapsed / seconds if seconds is not None else step / total_steps
        if progress >= 1 and step > 0:
            break
        # warm-up, then cosine to 10% (by time when the budget is time)
        f = min(1.0, (step + 1) / preset.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
        for g in opt.param_groups:
            g["lr"] = preset.lr * f
        for task, (x, y) in data.batch(step).items():
            loss = model(x.to(device), labels=y.to(device), use_cache=False).loss
            (loss * (preset.passkey_weight if task == "passkey" else 1.0)).backward()
            loss = loss.detach()  # smoothed on the device: no host sync per task
            avg[task] = loss if task not in avg else 0.95 * avg[task] + 0.05 * loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if seconds is not None:
            bar.n = min(round(time.time() - start), round(seconds))
        else:
            bar.n = step
        if on_cpu or step % 25 == 1:  # on a GPU the losses reach the host (a sync) every 25 steps
            bar.set_postfix_str(f"step {step} " + " ".join(f"{k} {v.item():.2f}" for k, v in avg.items()))
        bar.refresh()
    bar.close()
    return model.eval(), {**{f"loss_{k}": v.item() for k, v in avg.items()}, "seconds": time.time() - start,
                          "steps": step}


def evaluate(model, preset: Preset, seed: int = 1234, device="cpu") -> dict:
    """Held-out MQAR (every eval length), passkey grid and stdlib perplexity of one model."""
    tok = ByteTokenizer()
    mqar_eval = dataclasses.replace(preset.mqar_train, num_queries=None)  # each key asked once, zoology-style
    res = {}
    if "mqar" in preset.eval_tasks:
        res["mqar"] = eval_mqar(model, preset.mqar_eval_lengths, mqar_eval, preset.mqar_eval_samples, seed,
                                preset.batch_size)
    if "passkey" in preset.eval_tasks:
        hay = torch.tensor(heldout_tokens(tok, 4 * max(preset.passkey.lengths) + 200_000), dtype=torch.long)
        res["passkey"] = eval_passkey(model, tok, preset.passkey, seed, preset.batch_size, haystack=hay)
    if "ppl" in preset.eval_tasks:
        res["ppl"] = eval_perplexity(model, tok, preset.ppl_seq_len, None, preset.ppl_tokens, preset.batch_size)
    return res


def _train_and_evaluate(arch: str, preset: Preset, seed: int, device, desc: str, seconds: float | None = None,
                        position: int = 0, data: TrainData | None = None) -> dict:
    """One architecture trained and evaluated (a worker process's job with `--jobs`)."""
    data = data or TrainData(preset, seed)
    with fused_mode(preset.row_ops):
        model, stats = train_model(arch, preset, data, seed, device, desc, seconds=seconds, position=position)
    ev = evaluate(model, preset, device=device)
    return {"params": sum(p.numel() for p in model.parameters()), "train": stats, "eval": ev}


def _summary(arch: str, r: dict) -> str:
    ev, stats = r["eval"], r["train"]
    return (f"{LABELS[arch]:<20} trained {stats['steps']} steps in {stats['seconds']:.0f}s"
            + ("; MQAR " + " ".join(f"{L}:{100 * a:.0f}%" for L, a in ev["mqar"]["by_length"].items())
               if "mqar" in ev else "")
            + (f"; passkey {100 * ev['passkey']['mean']:.0f}%" if "passkey" in ev else "")
            + (f"; ppl {ev['ppl']['ppl']:.3f}" if "ppl" in ev else ""))


def run_experiment(preset_name: str, archs=DEFAULT_ARCHS, seed: int | list[int] = 0, device: str = "cpu",
                   out: str | Path = "runs/experiment-recall", steps: int | None = None,
                   seconds: float | None = None, jobs: int = 1) -> dict:
    """Train and evaluate every architecture; write results.json, table.md and recall.png to `out`.

    seed: one seed, or several: every architecture is trained once per seed, the
    table shows the mean and the range over seeds, and results.json keeps each run.
    seconds: instead of a step count, train the first architecture for this long
    and every other one for the same number of steps (Orthros, the costliest per
    step, goes first), which bounds the whole run's time (one seed only).
    jobs: runs trained side by side, one process each (a GPU run of these small
    models is bound by the host issuing kernels; see `jobs.py`). Every model
    sees the same seeded batches whatever `jobs` is.
    """
    if preset_name not in PRESETS:
        raise ValueError(f"unknown preset {preset_name!r}; choose from {', '.join(PRESETS)}")
    bad = [a for a in archs if a not in ARCHS]
    if bad:
        raise ValueError(f"unknown architecture(s) {', '.join(bad)}; choose from {', '.join(ARCHS)}")
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    seeds = [seed] if isinstance(seed, int) else list(dict.fromkeys(seed))
    if not seeds:
        raise ValueError("give at least one seed")
    preset = PRESETS[preset_name]
    if steps is not None:
        if steps < 1:
            raise ValueError(f"--steps must be >= 1, got {steps}")
        preset = dataclasses.replace(preset, steps=steps)
    if seconds is not None and seconds <= 0:
        raise ValueError(f"--seconds must be > 0, got {seconds}")
    if seconds is not None and len(seeds) > 1:
        raise ValueError("--seconds takes one seed (it fixes the step count from the first run)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    order = sorted(archs, key=lambda a: a != "orthros") if seconds is not None else list(archs)
    runs = [(a, s) for s in seeds for a in order]
    desc = {(a, s): f"[{i + 1}/{len(runs)}] train {a}" + ("" if len(seeds) == 1 else f" seed {s}")
            for i, (a, s) in enumerate(runs)}
    results = {}
    data = {s: TrainData(preset, s) for s in seeds} if jobs == 1 or seconds is not None else {}
    if seconds is not None:  # the first architecture fixes the step count of the others
        first = runs.pop(0)
        results[first] = _train_and_evaluate(first[0], preset, first[1], device, desc[first], seconds=seconds,
                                             data=data[first[1]])
        print(_summary(first[0], results[first]), flush=True)
        preset = dataclasses.replace(preset, steps=results[first]["train"]["steps"])
    seed_note = (lambda s: "") if len(seeds) == 1 else (lambda s: f" (seed {s})")
    if jobs > 1:  # each worker builds the same data itself
        done = run_jobs(_train_and_evaluate, [(a, preset, s, device, desc[a, s], None, i)
                                              for i, (a, s) in enumerate(runs)], jobs)
        for (a, s), r in zip(runs, done):
            print(_summary(a, r) + seed_note(s), flush=True)
    else:
        done = []
        for a, s in runs:
            done.append(_train_and_evaluate(a, preset, s, device, desc[a, s], data=data[s]))
            print(_summary(a, done[-1]) + seed_note(s), flush=True)
    results.update(zip(runs, done))
    if len(seeds) == 1:
        results = {a: results[a, seeds[0]] for a in archs}  # the table in the order asked for
    else:
        results = {a: aggregate({s: results[a, s] for s in seeds}) for a in archs}
    table = format_table(results, preset)
    meta = {"preset": preset_name, "seed": seeds[0] if len(seeds) == 1 else seeds, "device": str(device),
            "date": time.strftime("%Y-%m-%d %H:%M"), "config": _jsonable(dataclasses.asdict(preset)),
            "torch": torch.__version__}
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    (out / "table.md").write_text(table + "\n")
    plot(results, preset, out / "recall.png")
    return {"meta": meta, "results": results, "table": table}


def _jsonable(x):
    return json.loads(json.dumps(x, default=str))
