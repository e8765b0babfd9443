"""The training loop: pre-training from scratch, continued pre-training, SFT.

    cfg = build_config("configs/pretrain-tiny.yaml", {"train.steps": "100"})
    summary = train(cfg)

One loop for every phase; only the data differs. SFT rows carry labels
-100 outside the responses, so the model makes output positions only where
a response token is predicted. Losses are normalised by the number of
target tokens of the whole global batch (all micro-batches, all processes),
so gradient accumulation and data parallelism reproduce one big batch.
"""

from __future__ import annotations

import inspect
import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from tqdm import tqdm

from ..data.loader import BatchLoader
from ..data.packing import PackedRows, count_targets, pack_documents, pack_examples
from ..data.sft import render_example
from ..data.sources import STDLIB, detect_format, read_documents, read_examples
from ..data.tokenizer import TOKENIZER_FILES, ByteTokenizer, encode_batch, load_tokenizer, train_bpe, vocab_size_of
from ..errors import UserError, one_line
from ..loading import check_model_dir, load_model, read_config
from ..models import OrthrosConfig, OrthrosForCausalLM
from . import checkpoint as C
from . import dist as D
from .config import TrainConfig, dump
from .distill import distill_loss
from .metrics import MetricsLog, plot_runs


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN/inf; training stopped before the update."""


def compile_blocks(model) -> None:
    """torch.compile each transformer block in place (`train.compile`)."""
    try:  # aliased outputs of a compiled block (views of one projection) failed view replay on torch 2.13 CPU
        import torch._functorch.config as functorch_config

        functorch_config.view_replay_for_aliased_outputs = False
    except (ImportError, AttributeError):
        pass
    for block in model.model.layers:
        block.compile()


def log(d: D.Dist, msg: str) -> None:
    if d.main:
        print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------- model
RUN_OUTPUTS = ("metrics.jsonl", "checkpoints", "tokenizer", "loss.png", "tensorboard")


def check_out_dir(cfg: TrainConfig) -> Path:
    """A fresh run (no checkpoint.resume) never writes over another run's files."""
    out = Path(cfg.out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: out_dir is a file, not a directory")
    if cfg.checkpoint.resume is None:
        found = [n for n in RUN_OUTPUTS if (out / n).exists()]
        if found:
            raise UserError(f"{out}: out_dir already holds a training run ({', '.join(found)}); continue it with "
                            f"--resume, or choose another out_dir")
    return out


def model_config(cfg: TrainConfig, resume: Path | None) -> OrthrosConfig:
    """The model's config (vocab_size not final yet for a model from scratch)."""
    m = cfg.model
    if resume is not None:
        return read_config(resume)
    changes = {k: getattr(m, k) for k in ("attention", "window_size", "scale_offset", "attn_backend")
               if getattr(m, k) is not None}
    if m.init_from is not None:
        c = read_config(m.init_from)
        for k, v in changes.items():
            setattr(c, k, v)
        c.validate()
        return c
    fields = set(inspect.signature(OrthrosConfig.__init__).parameters) - {"self", "kwargs"}
    unknown = sorted(set(m.overrides) - fields)
    if unknown:  # OrthrosConfig would keep them as unused attributes: a typo must not pass silently
        raise UserError(f"model.overrides: unknown OrthrosConfig field(s) {', '.join(map(str, unknown))}")
    try:
        return OrthrosConfig.from_name(m.name, **{**m.overrides, **changes})
    except TypeError as e:  # a value of the wrong type
        raise UserError(f"model.overrides: {one_line(e)}") from None


def build_model(cfg: TrainConfig, mc: OrthrosConfig, resume: Path | None) -> OrthrosForCausalLM:
    """The model to train, its trainable set chosen (`model.trainable`).

    A light set (SO, norms, LoRA) trains a delta on `model.init_from`: a checkpoint of
    such a run holds the merged model (to use) and the delta unmerged in
    adapter.safetensors (to resume exactly), so a resume rebuilds init_from + delta."""
    from ..models.adapter import LORA_TARGETS, load_trainable, make_trainable

    m = cfg.model
    if m.trainable != "all":
        model = load_model(m.init_from, dtype=torch.float32, config=mc, new_scale_offset=True)
        torch.manual_seed(cfg.train.seed)  # LoRA's A factors: the same on every process and every run
        model = make_trainable(model, m.trainable, rank=m.lora_rank, alpha=m.lora_alpha,
                               targets=tuple(m.lora_targets or LORA_TARGETS), dora=m.lora_dora)
        if resume is not None:
            load_trainable(model, resume / "adapter.safetensors")
        return model
    if resume is not None:
        return load_model(resume, dtype=torch.float32, config=mc)
    if m.init_from is not None:  # attention / SO may change on purpose: SO vectors may come or go
        return load_model(m.init_from, dtype=torch.float32, config=mc, new_scale_offset=True)
    torch.manual_seed(cfg.train.seed)  # every process builds the same initial weights
    return OrthrosForCausalLM(mc)


def param_groups(model, o) -> list[dict]:
    """Matrices and embeddings decay at optim.lr; vectors (norms, biases, SO) at optim.vector_lr
    and LoRA factors at optim.lora_lr, without decay; with optim.lora_b_ratio != 1 the B factors form a
    group of their own at lora_lr times it (LoRA+). Frozen parameters are left out."""
    ratio = o.lora_b_ratio
    groups = {"decay": [], "vec": [], "lora": [], "lora_b": []}
    for name, p in model.named_parameters():
        if p.requires_grad:
            lora = "lora_b" if ratio != 1.0 and name.endswith(".lora_B") else "lora"
            groups[lora if ".lora_" in name else ("decay" if p.dim() >= 2 else "vec")].append(p)
    lora_lr = o.lora_lr or o.lr
    spec = {"decay": (o.lr, o.weight_decay), "vec": (o.vector_lr or o.lr, 0.0), "lora": (lora_lr, 0.0),
            "lora_b": (lora_lr * ratio, 0.0)}
    return [{"params": ps, "lr": spec[g][0], "weight_decay": spec[g][1]} for g, ps in groups.items() if ps]


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def setup_teacher(cfg: TrainConfig, model, tok, d: D.Dist, out: Path):
    """(frozen teacher or None, loss weights) for `distill.*`; the teacher's vocabulary checked."""
    from .distill import LossWeights, check_vocab, load_teacher

    ds = cfg.distill
    if ds.teacher is None:
        return None, None
    # Process 0 first: a Llama / Qwen3 teacher is converted once into out_dir/teacher, which the others then read.
    if not d.main:
        D.barrier(d)
    bf16 = cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and d.device.type == "cuda")
    teacher = load_teacher(ds.teacher, d.device, torch.bfloat16 if bf16 else torch.float32, ds.teacher_attention,
                           out / "teacher")
    if d.main:
        D.barrier(d)
    check_vocab(model, teacher, tok, ds.teacher if Path(ds.teacher).is_dir() else None)
    log(d, f"teacher: {ds.teacher} ({teacher.config.attention}, {teacher.config.num_hidden_layers} layers); "
           f"loss = {ds.ce} CE + {ds.kl} KL(T={ds.temperature}) + {ds.align} {ds.align_on} alignment"
           + (f" (first {ds.align_steps} steps)" if ds.align and ds.align_steps is not None else ""))
    return teacher, LossWeights(ds.ce, ds.kl, ds.temperature, ds.align, ds.align_on)


# -------------------------------------------------------------------- data
def get_tokenizer(cfg: TrainConfig, mc: OrthrosConfig, resume: Path | None, texts, d: D.Dist, out: Path):
    kind = cfg.data.tokenizer
    if kind == "bytes":
        return ByteTokenizer()
    if resume is not None:
        return load_tokenizer(resume, mc.vocab_size)
    if kind == "auto" and cfg.model.init_from is not None:
        return load_tokenizer(cfg.model.init_from, mc.vocab_size)
    if kind in ("auto", "bpe"):
        tok_dir = out / "tokenizer"
        if d.main:  # one process trains it, the others load what it saved
            budget, chosen = cfg.data.bpe_max_bytes, []
            for t in texts:
                chosen.append(t[:budget])
                budget -= len(chosen[-1])
                if budget <= 0:
                    break
            log(d, f"training a byte-level BPE ({cfg.data.vocab_size} tokens) on {sum(map(len, chosen)):,} characters")
            train_bpe(chosen, cfg.data.vocab_size).save_pretrained(str(tok_dir))
        D.barrier(d)
        return load_tokenizer(tok_dir)
    if not Path(kind).is_dir():
        raise FileNotFoundError(f"data.tokenizer: {kind!r} is neither auto/bpe/bytes nor a directory")
    if not any((Path(kind) / f).exists() for f in TOKENIZER_FILES):
        raise UserError(f"{kind}: data.tokenizer names a directory without tokenizer files "
                        f"({', '.join(TOKENIZER_FILES)})")
    return load_tokenizer(kind)


def _sft_texts(examples):
    for ex in examples:
        if "messages" in ex:
            yield "\n".join(str(m["content"]) for m in ex["messages"])
        else:
            yield f"{ex['prompt']}\n{ex.get('response', ex.get('completion'))}"


def load_data(cfg: TrainConfig, mc: OrthrosConfig, resume, d: D.Dist, out: Path):
    """(tokenizer, train rows, held-out rows or None, format)."""
    dc = cfg.data
    fmt = detect_format(dc.train) if dc.format == "auto" else dc.format
    heldout_src = dc.heldout if dc.heldout is not None else ([STDLIB] if dc.train == [STDLIB] else [])
    if fmt == "sft":
        train_ex = read_examples(dc.train)
        held_ex = read_examples(heldout_src) if heldout_src else None
        tok = get_tokenizer(cfg, mc, resume, list(_sft_texts(train_ex)), d, out)
        pad = getattr(tok, "pad_token_id", None) or 0

        def pack(exs, what):
            rows, cut = pack_examples([render_example(e, tok) for e in exs], dc.seq_len, pad)
            if cut:
                log(d, f"warning: {cut} {what} examples are longer than data.seq_len={dc.seq_len} and were cut")
            return rows

        train_rows, held_rows = pack(train_ex, "training"), (pack(held_ex, "held-out") if held_ex else None)
    else:
        docs = read_documents(dc.train, "train", dc.text_field, dc.max_bytes)
        tok = get_tokenizer(cfg, mc, resume, docs, d, out)
        eos = getattr(tok, "eos_token_id", None)
        train_rows = pack_documents(encode_batch(tok, docs), dc.seq_len, eos)
        held_rows = None
        if heldout_src:
            held = read_documents(heldout_src, "heldout", dc.text_field)
            held_rows = pack_documents(encode_batch(tok, held), dc.seq_len, eos)
    return tok, train_rows, held_rows, fmt


def eval_batches(rows: PackedRows | None, cfg: TrainConfig, d: D.Dist) -> list[dict]:
    """This process's share of a fixed held-out sample (the same number of micro-batches on every process)."""
    if rows is None or cfg.train.eval_batches == 0:
        return []
    # eval_batches global batches, split like training batches: the same sample on any number of processes
    per = min(len(rows) // d.world, cfg.train.eval_batches * cfg.train.batch_size * cfg.train.grad_accum)
    if per == 0:
        raise ValueError(f"the held-out data packs into {len(rows)} rows of {rows.seq_len} tokens, fewer than one "
                         f"per process ({d.world}); add held-out data, lower data.seq_len or set data.heldout: []")
    import numpy as np

    order = np.random.default_rng(0).permutation(len(rows))[d.rank * per : (d.rank + 1) * per]
    B = cfg.train.batch_size
    return [{k: torch.from_numpy(v) for k, v in rows.arrays(order[i : i + B]).items()} for i in range(0, per, B)]


# -------------------------------------------------------------------- loop
def train(cfg: TrainConfig) -> dict:
    """Run training as configured; returns a summary dict (losses, steps, checkpoint)."""
    d = D.setup(cfg.train.device)
    try:
        return _train(cfg, d)
    finally:
        D.teardown(d)


def _train(cfg: TrainConfig, d: D.Dist) -> dict:
    out = check_out_dir(cfg)
    ckpt_root = out / "checkpoints"
    resume = C.resolve_resume(cfg.checkpoint.resume, ckpt_root)
    mc = model_config(cfg, resume)
    if resume is not None or cfg.model.init_from is not None:  # damaged weights fail before any data work
        check_model_dir(resume if resume is not None else cfg.model.init_from, mc,
                        new_scale_offset=resume is None)
    if cfg.distill.teacher is not None and (resume is not None or cfg.model.init_from is not None):
        from .distill import check_teacher

        check_teacher(cfg.distill.teacher, mc.vocab_size)  # before any data work or file is written
    if cfg.data.seq_len > mc.max_position_embeddings:
        raise ValueError(f"data.seq_len={cfg.data.seq_len} exceeds the model's max_position_embeddings="
                         f"{mc.max_position_embeddings}")
    t_data = time.perf_counter()
    tok, train_rows, held_rows, fmt = load_data(cfg, mc, resume, d, out)  # a bad corpus fails before out_dir exists
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
    D.barrier(d)
    tv = vocab_size_of(tok)
    if resume is None and cfg.model.init_from is None:
        mc.vocab_size = cfg.model.vocab_size or -(-tv // 64) * 64
    if tv > mc.vocab_size:
        raise ValueError(f"the tokenizer has {tv} tokens but the model's vocab_size is {mc.vocab_size}")
    n_tgt = int(train_rows.target[:, 1:].sum()) if len(train_rows) else 0
    log(d, f"data ({fmt}): {len(train_rows):,} rows x {cfg.data.seq_len} tokens, {n_tgt:,} target tokens; "
           f"tokenizer {tv:,} tokens; prepared in {time.perf_counter() - t_data:.1f}s")

    tc = cfg.train
    loader = BatchLoader(train_rows, tc.batch_size, tc.grad_accum, d.rank, d.world, tc.seed, cfg.data.prefetch,
                         pin_memory=d.device.type == "cuda")
    held = eval_batches(held_rows, cfg, d)

    model = build_model(cfg, mc, resume).to(d.device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log(d, f"model: {mc.attention}, {n_params / 1e6:.1f}M parameters, window {mc.window_size}, "
           f"{mc.num_hidden_layers} layers, backend {mc.attn_backend}; device {d.device}, {d.world} process(es)")
    if tc.gradient_checkpointing:
        from ..models.compat import set_checkpointing

        set_checkpointing(model, True)
    if tc.compile:
        compile_blocks(model)
    if d.on:
        D.shard(model, d)
    o = cfg.optim
    teacher, weights = setup_teacher(cfg, model, tok, d, out)
    opt = torch.optim.AdamW(param_groups(model, o), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s, o.warmup_steps, tc.steps, o.min_lr_ratio))
    start = 0
    if resume is not None:
        start = C.load_train_state(resume, model, opt, sched, loader, d)
        log(d, f"resumed from {resume} at step {start}")

    bf16 = tc.dtype == "bf16" or (tc.dtype == "auto" and d.device.type == "cuda")
    amp = torch.autocast(d.device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    metrics = MetricsLog(out, d.main, resume_step=start if resume is not None else None,
                         tensorboard=cfg.log.tensorboard)
    cfg_yaml = dump(cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    tokens_per_step = loader.G * cfg.data.seq_len
    last_ckpt = resume
    summary = {"steps": start, "loss": None, "eval_loss": None, "checkpoint": None}

    def evaluate() -> float | None:
        if not held:
            return None
        model.eval()
        tot = torch.zeros(2, dtype=torch.float64, device=d.device)
        with torch.no_grad(), amp:
            for mb in held:
                mb = {k: v.to(d.device) for k, v in mb.items()}
                tot[0] += model(**mb, num_items_in_batch=1).loss.double()
                tot[1] += count_targets(mb["labels"])
        model.train()
        tot = D.all_sum(d, tot)
        return (tot[0] / tot[1].clamp_min(1)).item()

    def save(step: int) -> Path:
        return C.save(ckpt_root, step, model, opt, sched, loader, tok, cfg_yaml, d, cfg.checkpoint.keep)

    bar = tqdm(total=tc.steps, initial=start, disable=not (d.main and cfg.log.progress), unit="step",
               dynamic_ncols=True, file=sys.stderr)
    win = {"loss": 0.0, "n": 0, "t": 0.0, "wait": 0.0}
    t_train, stop_early, step = time.perf_counter(), False, start
    try:
        for step in range(start, tc.steps):
            t0, w0 = time.perf_counter(), loader.wait_s
            micro, n_local = loader.next()
            n_glob = int(D.all_sum(d, torch.tensor([n_local], device=d.device)).item())
            loss_sum = torch.zeros((), device=d.device)
            parts_sum: dict[str, torch.Tensor] = {}
            align = teacher is not None and (cfg.distill.align_steps is None or step < cfg.distill.align_steps)
            for i, mb in enumerate(micro):
                mb = {k: v.to(d.device, non_blocking=True) for k, v in mb.items()}
                D.set_grad_sync(model, d, i == len(micro) - 1)
                with amp:
                    if teacher is None:
                        loss = model(**mb, num_items_in_batch=max(n_glob, 1)).loss
                    else:
                        loss, parts = distill_loss(model, teacher, mb, max(n_glob, 1), weights, align)
                        for k, v in parts.items():
                            parts_sum[k] = parts_sum.get(k, 0.0) + v
                (loss * d.world).backward()  # FSDP averages gradients over processes; undo it: we want the sum
                loss_sum += loss.detach().float()
            loss_val = D.all_sum(d, loss_sum).item()
            for k, v in parts_sum.items():
                win[k] = win.get(k, 0.0) + D.all_sum(d, v.reshape(1).float()).item()
            gnorm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
            gnorm = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm
            if o.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(params, o.grad_clip, gnorm)
            gnorm = gnorm.item()
            if not (math.isfinite(loss_val) and math.isfinite(gnorm)):
                where = f"the last good checkpoint is {last_ckpt}" if last_ckpt else "no checkpoint was written"
                raise NonFiniteLossError(f"loss {loss_val} / gradient norm {gnorm} at step {step + 1}: stopped "
                                         f"before the update; {where} (try a lower optim.lr or more warm-up)")
            lr = sched.get_last_lr()[0]
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            win["loss"] += loss_val
            win["n"] += 1
            win["t"] += dt
            win["wait"] += loader.wait_s - w0
            done = step + 1
            bar.update(1)
            bar.set_postfix_str(f"loss {loss_val:.3f} | {tokens_per_step / dt / 1e3:,.1f}k tok/s | lr {lr:.2e}",
                                refresh=False)
            if step == start:  # the time budget starts after the first step (which compiles kernels)
                t_budget = time.perf_counter()
            if tc.max_seconds is not None:
                flag = torch.tensor([float(time.perf_counter() - t_budget > tc.max_seconds)], device=d.device)
                stop_early = D.all_sum(d, flag).item() > 0
            stop_early = stop_early or done == tc.stop_at
            last = done == tc.steps or stop_early
            if done % tc.log_every == 0 or last:
                rec = {"step": done, "loss": win["loss"] / win["n"], "lr": lr, "grad_norm": gnorm,
                       **{f"loss_{k}": win[k] / win["n"] for k in ("ce", "kl", "align") if k in win},
                       "tokens": done * tokens_per_step, "tok_per_s": win["n"] * tokens_per_step / win["t"],
                       "step_s": win["t"] / win["n"], "data_wait_s": win["wait"] / win["n"],
                       "data_wait_frac": win["wait"] / win["t"], "elapsed_s": time.perf_counter() - t_train}
                metrics.write(rec)
                summary["loss"] = rec["loss"]
                win = {"loss": 0.0, "n": 0, "t": 0.0, "wait": 0.0}
            if (done % tc.eval_every == 0 or last) and held:
                ev = evaluate()
                metrics.write({"step": done, "eval_loss": ev, "tokens": done * tokens_per_step})
                summary["eval_loss"] = ev
                bar.write(f"step {done}: held-out loss {ev:.4f}", file=sys.stderr) if d.main else None
            if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or last:
                last_ckpt = save(done)
            summary["steps"] = done
            if stop_early:
                log(d, f"stopped at step {done} (train.stop_at / train.max_seconds)")
                break
    finally:
        bar.close()
        loader.close()
        metrics.close()
    summary["checkpoint"] = str(last_ckpt) if last_ckpt else None
    summary["data_wait_frac"] = loader.wait_s / max(time.perf_counter() - t_train, 1e-9)
    if d.main and cfg.log.plot and metrics.path.exists():
        plot_runs({mc.attention: out}, out / "loss.png", title=f"{out.name}: {mc.attention}, {n_params / 1e6:.0f}M")
    ev = f", held-out {summary['eval_loss']:.4f}" if summary["eval_loss"] is not None else ""
    loss = f"{summary['loss']:.4f}" if summary["loss"] is not None else "n/a"
    log(d, f"done: {summary['steps']} steps, train loss {loss}{ev}; data wait "
           f"{100 * summary['data_wait_frac']:.2f}% of training time; model in {summary['checkpoint']}")
    return summary
