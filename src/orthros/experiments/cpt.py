"""The paper's conversion result at small scale: a real model, converted, then trained.

    orthros experiment cpt --preset smollm2-kd-h200 --device cuda --jobs 6
    orthros experiment cpt --preset smollm2-cpu-smoke            # the whole pipeline in minutes on a CPU

The source is SmolLM2-135M-Instruct (`orthros download`); every trained arm
starts from its weights and sees the same token rows (seed 0: in the same
order) under the same schedule:

    source            the source model, untouched (the same-code full attention)
    orthros-0shot     converted to Orthros (window W), no training
    orthros-cpt       Orthros after CE CPT (every weight)
    full-cpt          the source architecture after the same CE CPT (the paper's control)
    swa-cpt           sliding window only after the same CPT (no output stream)
    orthros-noso      Orthros without scale-offset after the same CPT
    orthros-so        light CPT: SO vectors + norms only
    orthros-lora      light CPT: LoRA on every projection + SO + norms
    orthros-kd        Orthros distilled from the source (KL, K/V alignment warm-up; `train.distill`)
    orthros-kd-d      Orthros distilled from full-cpt, the same-data teacher (trained first)
    orthros-kd-d-lora the light (LoRA + SO) version of orthros-kd-d
    ...-w256/-w512, -nomix, -s1   the window sweep, without retrieval data, a second seed
    ...-w256-lr3/-align50/-ce     W=256 with one training change each (an arm's `recipe`)
    ...-sink          the same arm with 4 attention sinks (`OrthrosConfig.sink_tokens`)
    ...-sink-mix      a CE arm with 4 sinks on the corpus mixed with retrieval samples
    ...-aw            the retrieval samples' answers weigh 32 text tokens each (`answer_weight`)
    orthros-kd-so-out-sink  4 sinks, only the output stream's SO trained (distilled from the source)

Distilled arms train on the corpus mixed with retrieval samples (`data.retrieval`,
`retrieval_share` of the rows; the preset's `retrieval_kinds`, with "docqa" answered
by the source while the rows are made) unless named -nomix; CE arms on the corpus
alone unless named -mix. Each arm is evaluated on held-out code, prose and package docs
(`cpt_data`): perplexity at 2K and 8K tokens, the loss by position, the copy
probe and pass-key retrieval through the chat template (`eval.longrange`), the
local lm-eval task. Light arms save their adapter (`models.adapter`); arms that
teach another save their weights. An arm whose arm-NAME.json exists is not run
again: a run cut by a time limit continues where it stopped. Results:
results.json, table.md, plots in --out.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from .cpt_arms import ARMS, PRESETS, Arm, CPTPreset, arm_preset
from .cpt_data import DOMAINS
from .cpt_train import train_arm
from .jobs import JobsFailed, run_after


# ------------------------------------------------------------------ models
def load_arm(orthros_dir: str | Path, arm: str, window: int, device, dtype=torch.float32):
    """The converted model with an arm's attention; SO tensors dropped where the arm has none."""
    from safetensors.torch import load_file

    from ..models import OrthrosConfig, OrthrosForCausalLM

    spec = ARMS[arm]
    cfg = OrthrosConfig.from_pretrained(str(orthros_dir))
    cfg.window_size = spec.window or window
    for k, v in spec.changes.items():
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
    if spec.adapter:
        from ..models.adapter import SHIPPED, apply_adapter

        where = SHIPPED / spec.adapter
        if not (where / "adapter.json").is_file():
            raise FileNotFoundError(f"arm {arm}: no adapter {where} (the shipped adapters are in a source checkout)")
        apply_adapter(model, where)
    if spec.sharpen:
        sharpen_output_queries(model, *spec.sharpen)
    return model.to(device=device, dtype=dtype)


def sharpen_output_queries(model, fraction: float, scale: float) -> None:
    """The output stream's queries of layers >= fraction * num_layers multiplied by `scale`: SO
    (`so_alpha_out`, `so_beta_out`) acts on a query before RoPE, so scaling both scales the query."""
    if not model.config.scale_offset or scale <= 0 or not 0 <= fraction <= 1:
        raise ValueError(f"sharpen needs SO, a positive scale and a fraction in [0, 1]; got {fraction}, {scale}")
    first = round(fraction * model.config.num_hidden_layers)
    with torch.no_grad():
        for layer in model.model.layers[first:]:
            layer.self_attn.so_alpha_out.mul_(scale)
            layer.self_attn.so_beta_out.mul_(scale)


# ---------------------------------------------------------------- evaluation
def evaluate_arm(model, tok, preset: CPTPreset, heldout: dict, stream: torch.Tensor,
                 partial: Path | None = None) -> dict:
    """Every probe of an arm. `partial`: a JSON file each finished probe is written to at once, and
    read first: a run cut during a probe keeps the probes before it, and the next run does only
    the rest."""
    from ..eval.longrange import chat_passkey, copy_probe, loss_summary, token_losses

    out = json.loads(partial.read_text()) if partial is not None and partial.exists() else {}

    def probe(name, fn):
        if name not in out:
            out[name] = fn()
            if partial is not None:
                tmp = partial.with_suffix(".tmp")
                tmp.write_text(json.dumps(out))
                tmp.replace(partial)

    def losses(rows):
        rows = torch.from_numpy(rows.astype(np.int64))
        long = token_losses(model, rows, preset.eval_batch)
        short = token_losses(model, rows[:, : preset.short_len], preset.eval_batch)
        return {"long": loss_summary(long), "short": loss_summary(short)}

    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=next(model.parameters()).is_cuda):
        for dom, rows in heldout.items():
            if len(rows):  # a domain this machine has no text for is left out
                probe(dom, lambda: losses(rows))
        probe("copy", lambda: copy_probe(model, stream, preset.copy_gaps, preset.copy_samples,
                                         batch_size=preset.eval_batch))
        probe("passkey", lambda: chat_passkey(model, tok, preset.passkey_lengths, preset.passkey_depths,
                                              preset.passkey_samples, batch_size=preset.eval_batch * 8))
        if preset.demo_chars and tok is not None:
            from ..demo.real import probe as demo_probe

            probe("demo", lambda: demo_probe(model, tok, preset.demo_chars))
        if preset.lm_eval_tasks:  # last: the slowest, and the one that separates the arms least
            probe("lm_eval", lambda: lm_eval_scores(model, tok, preset))
    return out


def local_tasks() -> Path | None:
    """The local lm-eval tasks' directory: `configs/lm_eval` of the working directory, else of the
    source checkout this package runs from (an experiment started from another directory finds them)."""
    for d in (Path("configs/lm_eval"), Path(__file__).resolve().parents[3] / "configs" / "lm_eval"):
        if d.is_dir():
            return d.resolve()
    return None


def lm_eval_scores(model, tok, preset: CPTPreset) -> dict:
    """Accuracy on the local lm-eval tasks ({"error": ...} where lm-eval is not installed)."""
    try:
        from ..eval.lm_eval_adapter import evaluate_model
    except ImportError as e:
        return {"error": f"lm-eval not available: {e}"}
    tasks = local_tasks()
    if tasks is None:
        return {"error": "the local lm-eval tasks (configs/lm_eval) are in a source checkout: run there"}
    here = os.getcwd()
    try:
        os.chdir(tasks.parents[1])  # the task files name their data relative to the checkout
        res = evaluate_model(model, tok, preset.lm_eval_tasks, include_path="configs/lm_eval", batch_size=8,
                             limit=preset.lm_eval_limit)
    except Exception as e:  # one evaluation failing must not lose an arm's other results
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        os.chdir(here)
    return {t: res["results"][t].get("acc,none") for t in preset.lm_eval_tasks}


def arm_rows(work: Path, spec: Arm, preset: CPTPreset):
    """(rows, mask or None) an arm trains on: the corpus rows, or with retrieval rows spliced in
    (every k-th row, so that the mix is even over the run); permuted by a seed > 0."""
    rows = np.load(work / "train_rows.npy", mmap_mode="r")
    mask = None
    if spec.mix and preset.retrieval_share > 0:
        rrows, rmask = np.load(work / "retrieval_rows.npy"), np.load(work / "retrieval_mask.npy")
        rows = np.array(rows)
        mask = np.ones(rows.shape, bool)
        at = retrieval_slots(len(rows), len(rrows))
        rows[at], mask[at] = rrows, rmask
    if spec.seed:
        order = np.random.default_rng(spec.seed).permutation(len(rows))
        rows = np.asarray(rows)[order]
        mask = None if mask is None else mask[order]
    return rows, mask


def retrieval_slots(n_rows: int, n_retrieval: int) -> np.ndarray:
    return np.linspace(0, n_rows - 1, n_retrieval).round().astype(np.int64) if n_retrieval else np.zeros(0, np.int64)


def run_arm(arm: str, orthros_dir: str, work: str, preset: CPTPreset, device: str, position: int = 0,
            train_only: bool = False) -> dict:
    """One arm: load, train (if it trains; from its teacher, if it has one), save its adapter
    (and its weights, if it teaches another arm), evaluate. A worker's job. `train_only`: stop
    once the weights are saved (a teacher's students need nothing more; its evaluation is a
    second job, which finds the weights)."""
    from ..data.tokenizer import load_tokenizer
    from ..models.adapter import merge_lora, save_adapter
    from ..train.distill import load_teacher

    spec = ARMS[arm]
    preset = arm_preset(arm, preset)
    torch.manual_seed(spec.seed)
    work = Path(work)
    tok = load_tokenizer(orthros_dir)
    mode = spec.mode
    model = load_arm(orthros_dir, arm, preset.window, device)
    stats = None
    saved = work / "adapters" / arm
    trained = work / "models" / arm
    if mode is not None and (trained / "config.json").exists():  # trained by an earlier run, cut before its end
        from ..loading import load_model

        model = load_model(trained, dtype=torch.float32).to(device)
        info = json.loads((trained / "train_stats.json").read_text())
        stats, mode = info, None
    elif mode not in (None, "all") and (saved / "adapter.json").exists():  # trained by an earlier, cut run
        from ..models.adapter import apply_adapter

        apply_adapter(model, saved)
        info = json.loads((saved / "adapter.json").read_text())
        stats = info.get("train") or {"trainable": info["parameters"], "tokens": info.get("tokens"),
                                      "steps": None, "seconds": None, "loss_curve": []}
        mode = None
    if mode is not None:
        teacher = None
        if spec.teacher == "source":
            teacher = load_teacher(orthros_dir, device, torch.float32, attention="full")
        elif spec.teacher is not None:
            teacher = load_teacher(work / "models" / spec.teacher, device, torch.float32)
        rows, mask = arm_rows(work, spec, preset)
        ckpts = work / "checkpoints" / arm
        curve = work / f"arm-{arm}.demo-curve.json"
        on_step = demo_curve(model, tok, preset, curve) if preset.demo_every and preset.demo_chars else None
        long_w = None
        if preset.long_weight_cap:
            from .long_weights import source_long_weights

            long_w = source_long_weights(orthros_dir, rows, model.config.window_size, model.config.sink_tokens,
                                         preset.long_weight_cap, device, work)
        model, stats = train_arm(model, mode, preset, rows, device, f"{arm}", position, mask, teacher,
                                 on_step=on_step, ckpt_dir=ckpts, token_weights=long_w)
        if curve.exists():
            stats["demo_curve"] = json.loads(curve.read_text())
        del teacher
        if mode != "all":
            save_adapter(model, saved, {"arm": arm, "mode": mode, "window": model.config.window_size,
                                        "sink_tokens": model.config.sink_tokens,
                                        "tokens": preset.train_tokens, "teacher": spec.teacher,
                                        "train": {k: v for k, v in stats.items() if k != "synced"}})
            merge_lora(model)
        if preset.save_weights or train_only or any(a.teacher == arm for a in ARMS.values()):
            model.save_pretrained(trained)
            (trained / "train_stats.json").write_text(json.dumps(stats))
        shutil.rmtree(ckpts, ignore_errors=True)  # the finished weights (or adapter) are kept instead
    if train_only:
        return {"arm": arm, "train": stats}
    heldout = {k: np.load(work / f"heldout_{k}.npy") for k in DOMAINS}
    stream = torch.from_numpy(np.load(work / "copy_stream.npy").astype(np.int64))
    t = time.time()
    partial = work / f"arm-{arm}.partial.json"
    ev = evaluate_arm(model, tok, preset, heldout, stream, partial)
    res = {"arm": arm, "label": spec.label, "teacher": spec.teacher, "window": model.config.window_size,
           "seed": spec.seed, "recipe": spec.recipe, "retrieval_share": preset.retrieval_share if spec.mix else 0.0,
           "retrieval_questions": preset.retrieval_questions if spec.mix else 0,
           "retrieval_kinds": list(preset.retrieval_kinds) if spec.mix else [],
           "train": stats, "eval": ev, "eval_seconds": time.time() - t}
    (work / f"arm-{arm}.json").write_text(json.dumps(res, indent=2))
    partial.unlink(missing_ok=True)
    return res


def demo_curve(model, tok, preset: CPTPreset, path: Path):
    """A `train_arm` step hook: every `preset.demo_every` steps, the demo probe's margin of the model
    as it is then (`demo.real.margin`, eval mode, no autograd) and its mean log p of the archive codes
    (`demo.real.fact_logprob`), appended to `path` as [step, tokens, margin, code log p] (atomically; a
    resumed run keeps the points it has and adds the rest)."""
    from ..demo.real import fact_logprob, margin

    points = json.loads(path.read_text()) if path.exists() else []
    cuda = next(model.parameters()).is_cuda

    def on_step(step: int) -> None:
        done = step + 1
        if done % preset.demo_every or any(p[0] == done for p in points):
            return
        model.eval()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            m = margin(model, tok, preset.demo_chars)["margin"]
            codes = fact_logprob(model, tok, preset.demo_chars)
        model.train()
        points.append([done, done * preset.batch_size * preset.seq_len, m, codes])
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(points))
        tmp.replace(path)

    return on_step


# ------------------------------------------------------------------ the run


def prepare(source: str | Path, work: Path, preset: CPTPreset, need_retrieval: bool = True,
            device: str = "cpu") -> Path:
    """Source (a HF dir or a GGUF) -> the converted Orthros dir; tokenized data under `work` (docqa
    samples answered by the source on `device`)."""
    from ..convert.hf import convert_checkpoint
    from ..data.tokenizer import load_tokenizer

    work.mkdir(parents=True, exist_ok=True)
    conv = work / "orthros"
    if not (conv / "config.json").exists():
        convert_checkpoint(source, conv, window_size=preset.window, dtype="fp32", progress=False)
    tok = load_tokenizer(conv)

    def teacher():  # the source as the distilled arms' teacher is (run_arm)
        from ..data.retrieval import teacher_answerer
        from ..train.distill import load_teacher

        return teacher_answerer(load_teacher(conv, device, torch.float32, attention="full"), tok)

    prepare_data(tok, work, preset, need_retrieval, teacher)
    return conv


def prepare_data(tok, work: Path, preset: CPTPreset, need_retrieval: bool = True, teacher=None) -> None:
    """The token rows under `work` (cached: a later call finds them): training rows, retrieval
    rows, held-out rows, the copy probe's text. Needs only the tokenizer, and for docqa samples
    `teacher() -> answer` (`data.retrieval.teacher_answerer`), called only if they are made."""
    from ..data.retrieval import KINDS, retrieval_rows
    from .cpt_data import heldout_sets, train_stream

    work.mkdir(parents=True, exist_ok=True)
    n = preset.steps * preset.batch_size
    n_ret = round(preset.retrieval_share * n) if need_retrieval else 0
    # the corpus rows, then text the retrieval samples' haystacks are cut from (never the rows' own text)
    need = n * preset.seq_len + (round(preset.haystack_rows * n_ret * preset.seq_len) if n_ret else 0)
    have = np.load(work / "train_rows.npy", mmap_mode="r").shape if (work / "train_rows.npy").exists() else None
    meta = {"rows": n_ret, "lengths": list(preset.retrieval_lengths), "questions": preset.retrieval_questions}
    if tuple(preset.retrieval_kinds) != KINDS:  # (rows made before kinds were a setting: found again)
        meta["kinds"] = list(preset.retrieval_kinds)
    if preset.retrieval_phrase:  # (likewise)
        meta["phrase"] = True
    if preset.retrieval_varied:
        meta["varied"] = True
    made = json.loads((work / "retrieval.json").read_text()) if (work / "retrieval.json").exists() else None
    stale = n_ret and made != meta  # (a work dir from before retrieval.json: made again, the same rows)
    if have != (n, preset.seq_len) or stale:
        stream = train_stream(tok, need, work / "cache")
        if len(stream) < need:
            raise ValueError(f"only {len(stream):,} training tokens on this machine; the preset needs {need:,} "
                             f"({n * preset.seq_len:,} for {n:,} rows"
                             + (f" and {need - n * preset.seq_len:,} kept apart for the retrieval samples' haystacks "
                                f"(haystack_rows={preset.haystack_rows:g})" if n_ret else "")
                             + "): fewer --steps, or a preset that keeps less text apart")
        np.save(work / "train_rows.npy", stream[: n * preset.seq_len].reshape(n, preset.seq_len).astype(np.int32))
        if n_ret:
            hay = stream[n * preset.seq_len :]
            kinds = tuple(preset.retrieval_kinds)
            rrows, rmask = retrieval_rows(tok, hay, n_ret, preset.seq_len, np.random.default_rng(1234),
                                          tuple(preset.retrieval_lengths), questions=preset.retrieval_questions,
                                          kinds=kinds, answer=teacher() if teacher and "docqa" in kinds else None,
                                          progress="docqa" in kinds or n_ret >= 256, phrase=preset.retrieval_phrase,
                                          varied=preset.retrieval_varied)
            np.save(work / "retrieval_rows.npy", rrows)
            np.save(work / "retrieval_mask.npy", rmask)
            (work / "retrieval.json").write_text(json.dumps(meta))
    held = heldout_sets(tok, preset.seq_len, preset.eval_rows, work / "cache")
    for k, v in held.items():
        np.save(work / f"heldout_{k}.npy", v)
    # copy-probe text: held-out prose and code beyond the rows above
    extra = heldout_sets(tok, preset.seq_len, 2 * preset.eval_rows, work / "cache")
    stream = np.concatenate([extra["prose"][preset.eval_rows:].ravel(), extra["code"][preset.eval_rows:].ravel()])
    if len(stream) < max(preset.copy_gaps) + 1000:
        stream = np.concatenate([stream, held["prose"].ravel()])
    np.save(work / "copy_stream.npy", stream)


def check_names(preset_name: str, arms) -> None:
    """ValueError for an unknown preset or arm (the close names suggested): before anything is
    looked for or loaded."""
    if preset_name not in PRESETS:
        raise ValueError(f"unknown preset {preset_name!r}; choose from {', '.join(PRESETS)}")
    bad = [a for a in arms if a not in ARMS]
    if bad:
        import difflib

        near = sorted({m for a in bad for m in difflib.get_close_matches(a, ARMS, n=3, cutoff=0.8)})
        raise ValueError(f"unknown arm(s) {', '.join(bad)}"
                         + (f"; did you mean {', '.join(near)}?" if near else "")
                         + " (`orthros experiment cpt --list-arms` lists them)")


def run_cpt(preset_name: str, source: str | Path, out: str | Path, arms=tuple(ARMS), device: str = "cpu",
            jobs: int = 1, steps: int | None = None, lm_eval_limit: int | None = None,
            compile: bool | None = None) -> dict:
    check_names(preset_name, arms)
    preset = PRESETS[preset_name]
    if steps is not None:
        preset = dataclasses.replace(preset, steps=steps)
    if lm_eval_limit is not None:
        preset = dataclasses.replace(preset, lm_eval_limit=lm_eval_limit)
    if compile is not None:
        preset = dataclasses.replace(preset, compile=compile)
    out = Path(out)
    for a in arms:  # a teacher arm trained by an earlier run must have left its weights
        t = ARMS[a].teacher
        if t not in (None, "source") and t not in arms and not (out / "models" / t / "config.json").exists():
            raise ValueError(f"arm {a} learns from arm {t}: run {t} too (its weights are not under {out}/models)")
    t0 = time.time()
    conv = prepare(source, out, preset, any(ARMS[a].mix for a in arms), device)
    print(f"prepared {conv} and data in {time.time() - t0:.0f}s", flush=True)
    results = {}
    for a in arms:
        f = out / f"arm-{a}.json"
        if f.exists():  # finished by an earlier (cut) run
            results[a] = json.loads(f.read_text())
    todo = [a for a in arms if a not in results]
    # an arm taught by another arm starts once that one's weights are saved (its evaluation is a job
    # of its own, beside the students'); the other arms fill the workers meanwhile
    teachers = {ARMS[a].teacher for a in todo} & set(todo)
    specs = {a: (a, str(conv), str(out), preset, device, i) for i, a in enumerate(todo)}
    specs.update({f"{t}/train": (t, str(conv), str(out), preset, device, todo.index(t), True) for t in teachers})
    needs = {a: [f"{ARMS[a].teacher}/train"] for a in todo if ARMS[a].teacher in teachers}
    needs.update({t: [f"{t}/train"] for t in teachers})
    failed = None
    try:
        done = run_after(run_arm, specs, needs, jobs)
    except JobsFailed as e:  # the arms that finished are reported all the same, then the failure
        done, failed = e.done, e
    results.update({a: r for a, r in done.items() if "/" not in a})
    meta = {"preset": preset_name, "config": dataclasses.asdict(preset), "train_tokens": preset.train_tokens,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": device,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__, "seconds": time.time() - t0}
    report = write_report(results, preset, meta, out)
    if failed is not None:
        failed.report = report
        raise failed
    return report


def write_report(results: dict, preset: CPTPreset, meta: dict, out: str | Path, name: str = "results.json") -> dict:
    """results.json, table.md and the plots (cpt.png, cpt-train.png, cpt-demo.png where arms scored the demo
    along training) under `out`; arms in ARMS order. The report's "files" name what was written."""
    from .cpt_report import format_table, plot_all

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results = {a: results[a] for a in ARMS if a in results}
    (out / name).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    if not results:  # every arm failed
        return {"meta": meta, "results": results, "table": "(no arm finished)", "files": [name]}
    table = format_table(results, preset)
    (out / "table.md").write_text(table + "\n")
    plots = [p.name for p in plot_all(results, preset, out)]
    return {"meta": meta, "results": results, "table": table, "files": [name, "table.md", *plots]}


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
    fields = {f.name for f in dataclasses.fields(CPTPreset)}
    preset = CPTPreset(**{k: v for k, v in cfg.items() if k in fields})
    return write_report(results, preset, meta, out, name)
