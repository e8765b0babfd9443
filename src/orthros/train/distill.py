"""Distillation: train a converted model against a frozen teacher in the same step.

    loss = ce * CE(labels) + kl * T^2 KL(teacher_T || student_T) + align * alignment

* KL is taken on every output position (the positions whose next label counts:
  every position in pre-training, the response tokens in SFT), at temperature T.
* The alignment term compares, layer by layer, what the student's base stream
  computes with what the teacher computes at the same positions: the key and
  value projections (`kv`: what the output stream reads; if they matched the
  source's everywhere, an Orthros model would reproduce the source exactly) and /
  or each layer's input hidden state (`hidden`). Each layer's squared error is
  divided by the teacher's mean square there (over the micro-batch), so every
  layer weighs alike. That scale is the one term that depends on how a batch
  is cut: torchrun x2 with accumulation against one process on the same global
  batch gave the same KL and totals within 2e-4 (relative) on a tiny model.
* Every term is a sum over tokens divided by the global batch's target count
  (`num_items`), like the trainer's cross-entropy: gradient accumulation and data
  parallelism reproduce one big batch.

The teacher is a Llama / Qwen3 Hugging Face directory or GGUF file (converted
once and run as the same-code full-attention Transformer, which computes
transformers' logits) or an Orthros directory (optionally run as `full`: a
converted model then is its source Transformer). Its vocabulary must be the
student's.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..errors import UserError

IGNORE_INDEX = -100
ALIGN_KINDS = ("kv", "hidden", "kv+hidden")
KL_CHUNK = 2048  # rows whose logits are made at once (fp32, a 49K vocabulary: 400 MB a model)


@dataclass
class LossWeights:
    ce: float = 0.0
    kl: float = 1.0
    temperature: float = 1.0
    align: float = 0.0
    align_on: str = "kv"


# ------------------------------------------------------------------ teacher
def _teacher_config(p: Path) -> dict | None:
    """A teacher's config.json as a dict (None for a GGUF file), or a one-line error: the path
    exists, and is a model of a kind that can teach."""
    if not p.exists():
        raise UserError(f"distill.teacher: {str(p)!r} does not exist")
    if p.is_file():
        return None  # a GGUF: checked when it is converted
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise UserError(f"distill.teacher: {str(p)!r} is not a model directory (no config.json)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{cfg_file}: not valid JSON ({e})") from None
    kind = cfg.get("model_type") if isinstance(cfg, dict) else None
    if kind not in ("orthros", "llama", "qwen3"):
        raise UserError(f"distill.teacher: {p} is a {kind!r} model; a teacher is a Llama / Qwen3 checkpoint or an "
                        "Orthros model")
    return cfg


def check_teacher(path: str | Path, student_vocab: int) -> None:
    """What can be told of a teacher before anything is loaded or written: it exists, it is a
    model of a kind that can teach, and its vocabulary has the student's size."""
    cfg = _teacher_config(Path(path))
    tv = None if cfg is None else cfg.get("vocab_size")
    if isinstance(tv, int) and tv != student_vocab:
        raise UserError(f"the teacher's vocabulary ({tv:,} ids, {path}) differs from the student's "
                        f"({student_vocab:,}): distillation compares their predictions id by id, so both need the "
                        "same tokenizer")


def load_teacher(path: str | Path, device, dtype=torch.bfloat16, attention: str | None = None,
                 cache_dir: str | Path | None = None, **config_changes):
    """A frozen teacher in eval mode, always as an Orthros model (one forward, one set of
    layer names, packed documents separated exactly as the student separates them).

    path: an Orthros directory, or a Llama / Qwen3 Hugging Face directory or GGUF file,
    converted once into `cache_dir` and run as `full` attention: exactly the source
    Transformer (the converted model's logits at W >= T are transformers').
    attention: run an Orthros directory as orthros / full / swa instead of its own.
    config_changes: other fields of an Orthros directory's config (say window_size, sink_tokens)."""
    from ..loading import load_model, read_config

    p = Path(path)
    cfg = _teacher_config(p)
    kind = "gguf" if cfg is None else cfg["model_type"]
    if kind in ("llama", "qwen3", "gguf"):
        if attention not in (None, "full"):
            raise UserError(f"distill.teacher_attention={attention!r}: a {kind} source runs as the Transformer it is")
        if cache_dir is None:
            raise UserError(f"distill.teacher: a {kind} source needs a directory to convert it into")
        from ..convert.hf import convert_checkpoint

        conv = Path(cache_dir)
        if not (conv / "config.json").exists():
            convert_checkpoint(p, conv, window_size=1, scale_offset=False, dtype="fp32", progress=False)
        p, attention = conv, "full"
    config = read_config(p)
    if attention is not None or config_changes:
        for k, v in config_changes.items():
            if not hasattr(config, k):
                raise UserError(f"the teacher's config has no field {k!r}")
            setattr(config, k, v)
        config.attention = attention or config.attention
        config.validate()
    model = load_model(p, dtype=dtype, config=config, new_scale_offset=attention is not None)
    model.to(device).eval().requires_grad_(False)
    return model


def check_vocab(student, teacher, student_tok=None, teacher_dir: str | Path | None = None) -> None:
    """The teacher predicts over the student's token ids: same size, same tokens."""
    sv, tv = student.config.vocab_size, teacher.config.vocab_size
    if sv != tv:
        raise UserError(f"the teacher's vocabulary ({tv:,} ids) differs from the student's ({sv:,}): distillation "
                        "compares their predictions id by id, so both need the same tokenizer")
    if student_tok is None or teacher_dir is None or not hasattr(student_tok, "get_vocab"):
        return
    from ..data.tokenizer import TOKENIZER_FILES, load_tokenizer

    if not any((Path(teacher_dir) / f).exists() for f in TOKENIZER_FILES):
        return  # nothing to compare with: the sizes agree
    t_tok = load_tokenizer(teacher_dir)
    a, b = student_tok.get_vocab(), t_tok.get_vocab()
    if a != b:
        diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:3]
        raise UserError(f"the teacher's tokenizer ({teacher_dir}) differs from the student's: "
                        f"{len(set(a.items()) ^ set(b.items()))} (token, id) pairs differ, e.g. {diff}")


# ------------------------------------------------------------------ capture
def _layers(model):
    inner = getattr(model, "model", model)
    return inner.layers


@contextmanager
def capture(model, on: str | None):
    """Record, per layer, the K/V projections' outputs [B, T, Hkv*D] and / or the layer's
    input [B, T, C] during one forward: yields {("k"|"v"|"h", layer): tensor}.

    A hook overwrites its entry: the recompute of an activation-checkpointed block in the
    backward pass stores the same values again, after the loss has used them."""
    got: dict = {}
    handles = []
    if on:
        for i, layer in enumerate(_layers(model)):
            if "kv" in on:
                attn = layer.self_attn
                for name in ("k", "v"):
                    handles.append(getattr(attn, f"{name}_proj").register_forward_hook(
                        lambda m, args, out, key=(name, i): got.__setitem__(key, out)))
            if "hidden" in on and i > 0:  # layer 0's input is the embeddings: equal by construction
                def pre(m, args, kwargs, key=("h", i)):
                    got[key] = args[0] if args else kwargs["hidden_states"]
                handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


# ------------------------------------------------------------------- losses
def align_sum(student: dict, teacher: dict, mask: torch.Tensor) -> torch.Tensor:
    """Sum over layers and masked tokens of ||s - t||^2 / (D * mean(t^2)); mask: [B, T] bool."""
    keys = sorted(k for k in teacher if k in student)
    if not keys:
        raise RuntimeError("alignment asked for but no layer output was captured")
    total = mask.new_zeros((), dtype=torch.float32)
    for k in keys:
        s, t = student[k][mask].float(), teacher[k][mask].float()
        scale = t.pow(2).mean().clamp_min(1e-6)
        total = total + (s - t).pow(2).sum() / (s.shape[-1] * scale)
    return total / len(keys)


def _head_chunk(s_h, t_h, target, weight, s_head, t_head, temperature: float):
    """(KL sum * T^2, CE sum) over a chunk of rows, the logits made here from the rows'
    final hidden states (s_h, t_h [M, C]; t_h None: no teacher, KL 0) and dropped after;
    target [M]; weight [M] or None (every row 1)."""
    s = s_head(s_h).float()
    ce = F.cross_entropy(s, target, reduction="none")
    if t_h is None:
        return s.new_zeros(()), (ce if weight is None else ce * weight).sum()
    t = t_head(t_h).float()
    ls = F.log_softmax(s / temperature, -1)
    lt = F.log_softmax(t / temperature, -1)
    kl = (lt.exp() * (lt - ls)).sum(-1)
    if weight is not None:
        kl, ce = kl * weight, ce * weight
    return kl.sum() * temperature ** 2, ce.sum()


def head_losses(s_h: torch.Tensor, t_h: torch.Tensor | None, target: torch.Tensor, s_head, t_head,
                temperature: float = 1.0, weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed KL(teacher_T || student_T) * T^2 and summed CE over rows [M, C], both models' LM
    heads applied KL_CHUNK rows at a time and recomputed in the backward pass: neither model's
    [M, V] logits (nor their fp32 softmaxes) are ever held whole. `weight` [M]: each row's terms
    times its weight (None: 1); `t_h` None: CE alone (KL 0)."""
    kl = s_h.new_zeros((), dtype=torch.float32)
    ce = s_h.new_zeros((), dtype=torch.float32)
    for i in range(0, s_h.shape[0], KL_CHUNK):
        sl = slice(i, i + KL_CHUNK)
        args = (s_h[sl], None if t_h is None else t_h[sl], target[sl], None if weight is None else weight[sl],
                s_head, t_head, temperature)
        k, c = (checkpoint(_head_chunk, *args, use_reentrant=False) if s_h.requires_grad
                else _head_chunk(*args))
        kl, ce = kl + k, ce + c
    return kl, ce


def _output_targets(out, labels: torch.Tensor):
    """(keep [B, N], nxt [B, N]): the output rows whose next label counts, and where that label is."""
    T = labels.shape[1]
    pos = out.output_positions  # [B, N], -1 = no output row
    nxt = (pos + 1).clamp(0, T - 1)
    keep = (pos >= 0) & (pos + 1 < T) & (labels.gather(1, nxt) != IGNORE_INDEX)
    return keep, nxt


def weighted_ce_loss(model, batch: dict, num_items: int, weights: torch.Tensor) -> torch.Tensor:
    """The next-token loss with a weight per target: sum(w * CE) / num_items, `weights` [B, T]
    indexed like the labels (the weight of predicting the token at p sits at p). With every
    weight 1 it is the model's own loss; heavier weights on, say, a retrieval sample's answers
    make them count more against the text around them (LongCE weighs the tokens that need a
    long context)."""
    labels = batch["labels"]
    out = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False, lm_head=False)
    keep, nxt = _output_targets(out, labels)
    _, ce = head_losses(out.output_rows[keep], None, labels.gather(1, nxt)[keep], model.get_output_embeddings(),
                        None, weight=weights.float().gather(1, nxt)[keep])
    loss = ce / max(int(num_items), 1)
    return loss if out.aux_loss is None else loss + model.config.router_aux_loss_coef * out.aux_loss


def distill_loss(student, teacher, batch: dict, num_items: int, w: LossWeights, align: bool = True,
                 weights: torch.Tensor | None = None):
    """One micro-batch's loss (a tensor with a graph) and its parts {name: float tensor}.

    batch: input_ids [B, T], labels [B, T] (-100: no loss), optionally attention_mask /
    position_ids, as the trainer's rows carry them; `weights` [B, T] (like the labels) or None:
    each target's KL and CE times its weight (`weighted_ce_loss`). Both models stop before their LM heads;
    `head_losses` applies the heads a chunk of rows at a time."""
    on = w.align_on if (align and w.align > 0) else None
    with capture(student, on) as s_cap:
        out = student(**batch, lm_head=False)
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
    with torch.no_grad(), capture(teacher, on) as t_cap:
        t_rows = teacher(**inputs, use_cache=False, lm_head=False).output_rows  # [B, T, C]: every position
    s_head, t_head = student.get_output_embeddings(), teacher.get_output_embeddings()
    if t_head.out_features != s_head.out_features:
        raise UserError(f"the teacher predicts over {t_head.out_features:,} ids, the student over "
                        f"{s_head.out_features:,}: distillation needs one vocabulary")
    labels = batch["labels"]
    keep, nxt = _output_targets(out, labels)
    pos = out.output_positions
    t_h = t_rows.gather(1, pos.clamp_min(0)[..., None].expand(-1, -1, t_rows.shape[-1]))
    wt = None if weights is None else weights.float().gather(1, nxt)[keep]
    kl, ce = head_losses(out.output_rows[keep], t_h[keep], labels.gather(1, nxt)[keep], s_head, t_head,
                         w.temperature, wt)
    n = max(int(num_items), 1)
    kl, ce = kl / n, ce / n
    parts = {"ce": ce.detach()}
    loss = ce * w.ce if w.ce else ce.new_zeros(())
    if w.kl:
        loss = loss + w.kl * kl
        parts["kl"] = kl.detach()
    if out.aux_loss is not None:  # a MoE student's load-balancing term (output_router_logits)
        loss = loss + student.config.router_aux_loss_coef * out.aux_loss
        parts["aux"] = out.aux_loss.detach()
    if on:
        mask = batch.get("attention_mask")
        mask = torch.ones_like(labels, dtype=torch.bool) if mask is None else mask.bool()
        al = align_sum(s_cap, t_cap, mask) / n
        loss = loss + w.align * al
        parts["align"] = al.detach()
    return loss, parts
