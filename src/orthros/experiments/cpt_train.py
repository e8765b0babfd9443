"""One CPT arm's training: every weight, the light sets (SO + norms, LoRA + SO) or a distilled
student, on the rows every arm shares, in order, under one schedule (`lr_factor`: warm-up, then a
cosine to a tenth), resumable from its own checkpoints (`train.checkpoint`)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .cpt_arms import CPTPreset


def lr_factor(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))


class _History:
    """What a resumed arm needs beside weights and optimizer: its curves and its time so far
    (the `data` entry of a training checkpoint)."""

    def __init__(self):
        self.losses, self.parts, self.synced, self.seconds = [], [], [], 0.0

    def state_dict(self) -> dict:
        return {"losses": self.losses, "parts": self.parts, "synced": self.synced, "seconds": self.seconds}

    def load_state_dict(self, s: dict) -> None:
        self.losses, self.parts, self.synced, self.seconds = s["losses"], s["parts"], s["synced"], s["seconds"]


class _NoScheduler:  # the learning rate is a function of the step (lr_factor)
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, s: dict) -> None:
        pass


def train_arm(model, mode: str, preset: CPTPreset, rows: np.ndarray, device, desc: str, position: int = 0,
              mask: np.ndarray | None = None, teacher=None, on_step=None, ckpt_dir: Path | None = None,
              token_weights: np.ndarray | None = None):
    """Training of one arm on `rows` [steps * batch, seq_len] (the same rows, in order, for every
    arm) with target masks `mask` (default: every token). With a `teacher`, the loss is
    `train.distill`'s (KL, the K/V alignment in the first align_frac of the steps, CE) on the
    same output positions the CE would use. `on_step(step)` runs after each step (a profiler's
    schedule, say). `token_weights` [rows, seq_len] (like the labels), if given, multiply each
    target's loss (`long_weights`: the tokens that need the far context), with the answers' weight
    (or, with `preset.long_weight_answers` off, the text's only).

    `ckpt_dir`: every `preset.checkpoint_every` steps the trainable weights, the optimizer, the
    RNG and the curves so far are written there (`train.checkpoint`: atomic, safetensors), and a
    later call with the same directory continues from the newest one exactly: an arm longer than
    one sitting runs in several."""
    from ..models.adapter import load_trainable, make_trainable
    from ..models.compat import set_checkpointing
    from ..train import checkpoint as C
    from ..train.config import OptimArgs
    from ..train.dist import Dist
    from ..train.distill import LossWeights, distill_loss, weighted_ce_loss
    from ..train.trainer import param_groups as optim_groups

    model = make_trainable(model, mode, rank=preset.lora_rank, targets=preset.lora_targets, dora=preset.lora_dora)
    frozen = 0
    for n, p in model.named_parameters():
        if p.requires_grad and any(f in n for f in preset.freeze):
            p.requires_grad_(False)
            frozen += 1
    if preset.freeze and not frozen:
        raise ValueError(f"freeze={preset.freeze}: no trainable parameter's name contains any of them")
    if preset.gradient_checkpointing:
        set_checkpointing(model, True)
    if preset.compile:
        from ..train.trainer import compile_blocks

        compile_blocks(model)
        if teacher is not None:
            compile_blocks(teacher)
    lr_vec = preset.lr if mode == "all" else preset.light_lr
    param_groups = optim_groups(model, OptimArgs(lr=preset.lr, weight_decay=preset.weight_decay, vector_lr=lr_vec,
                                                 lora_lr=preset.lora_lr, lora_b_ratio=preset.lora_b_ratio))
    for g in param_groups:
        g["peak"] = g["lr"]
    cuda = torch.device(device).type == "cuda"
    if cuda:  # the arm's peak, reported: how many jobs of this preset a card holds
        torch.cuda.reset_peak_memory_stats(device)
    opt = torch.optim.AdamW(param_groups, betas=(0.9, 0.95), **({"fused": True} if cuda else {}))
    weights = LossWeights(preset.ce, preset.kl, preset.temperature, preset.align, preset.align_on)
    answers = None  # the retrieval samples' answers, weighed answer_weight times a text token
    if preset.answer_weight != 1.0:
        from ..data.retrieval import answer_mask

        answers = answer_mask(mask) if mask is not None else None
        if answers is None or not answers.any():
            raise ValueError(f"answer_weight={preset.answer_weight}: the arm's rows hold no retrieval answers "
                             "(an arm with retrieval data, retrieval_share > 0)")
    align_steps = round(preset.align_frac * preset.steps)
    hist, sched, start = _History(), _NoScheduler(), 0
    resume = C.resolve_resume("auto", Path(ckpt_dir)) if ckpt_dir is not None else None
    if resume is not None:
        if mode == "all":
            from ..loading import load_model

            model.load_state_dict(load_model(resume, dtype=torch.float32).state_dict())
        else:
            load_trainable(model, resume / "adapter.safetensors")
        start = C.load_train_state(resume, model, opt, sched, hist, Dist())
    model.train()
    losses = list(hist.losses)  # floats from a checkpoint, then this run's loss tensors
    parts_log, synced, t0 = list(hist.parts), [tuple(x) for x in hist.synced], time.time() - hist.seconds
    bar = tqdm(total=preset.steps, initial=start, desc=desc, unit="step", leave=False, position=position)
    B = preset.batch_size
    for step in range(start, preset.steps):
        f = lr_factor(step, preset.warmup, preset.steps)
        for g in opt.param_groups:
            g["lr"] = g["peak"] * f
        x = torch.from_numpy(rows[step * B : (step + 1) * B].astype(np.int64)).to(device)
        rows_mask = None if mask is None else torch.from_numpy(mask[step * B : (step + 1) * B]).to(device)
        labels = x if mask is None else torch.where(rows_mask, x, -100)
        n = int((labels[:, 1:] != -100).sum())
        w = None
        if answers is not None:
            a = torch.from_numpy(answers[step * B : (step + 1) * B]).to(device)
            w = 1 + (preset.answer_weight - 1) * a.float()
        if token_weights is not None:
            lw = torch.from_numpy(token_weights[step * B : (step + 1) * B].astype(np.float32)).to(device)
            if w is None:
                w = lw
            else:  # the answers' weight times theirs, or the answers' alone
                w = w * lw if preset.long_weight_answers else torch.where(a, w, lw)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            if teacher is None:
                loss = (model(input_ids=x, labels=labels, use_cache=False).loss if w is None
                        else weighted_ce_loss(model, {"input_ids": x, "labels": labels}, n, w))
                parts = {}
            else:
                loss, parts = distill_loss(model, teacher, {"input_ids": x, "labels": labels}, n, weights,
                                           align=step < align_steps, weights=w)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in param_groups for p in g["params"]], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        parts_log.append(parts)
        bar.update(1)
        if step % 10 == 0 or not cuda:  # .item() syncs: the times below are exact there
            bar.set_postfix_str(f"loss {loss.item():.3f}")
            synced.append((step + 1, time.time() - t0))
        done = step + 1
        if ckpt_dir is not None and preset.checkpoint_every and done % preset.checkpoint_every == 0 \
                and done < preset.steps:
            hist.losses = [float(x) for x in losses]
            hist.parts = [{k: float(v) for k, v in p.items()} for p in parts_log]
            hist.synced, hist.seconds = [list(x) for x in synced], time.time() - t0
            C.save(Path(ckpt_dir), done, model, opt, sched, hist, None, "", Dist(), keep=1)
        if on_step is not None:
            on_step(step)
    bar.close()
    if preset.gradient_checkpointing:
        set_checkpointing(model, False)
    curve = [float(x) for x in losses]
    part_curves = {k: [float(p[k]) for p in parts_log if k in p] for k in ("ce", "kl", "align")}
    return model.eval(), {"steps": preset.steps, "tokens": preset.train_tokens, "seconds": time.time() - t0,
                          "loss_curve": curve, "synced": synced,
                          **({"part_curves": {k: v for k, v in part_curves.items() if v}} if teacher else {}),
                          "trainable": sum(p.numel() for g in param_groups for p in g["params"]),
                          "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}
