"""The conversion experiment's arms (what each trains, from which teacher, on which rows) and its
presets (budgets, data and evaluation), by name: `orthros experiment cpt --preset P --arms A B`.

    source            the source model, untouched (the same-code full attention)
    orthros-0shot     converted to Orthros (window W), no training
    orthros-cpt       Orthros after CE CPT (every weight)
    full-cpt          the source architecture after the same CE CPT (the paper's control)
    orthros-kd        Orthros distilled from the source (KL, K/V alignment warm-up; `train.distill`)
    orthros-kd-d      Orthros distilled from full-cpt, the same-data teacher (trained first)
    ...               the rest below, each with its label (the module docstring of `cpt` says more)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..models.adapter import HEAD, LORA_TARGETS


@dataclass(frozen=True)
class Arm:
    label: str
    changes: dict
    mode: str | None = None
    """trainable set (models.adapter.MODES) or None (not trained)"""
    teacher: str | None = None
    """"source" or the name of an arm whose trained weights teach this one"""
    window: int | None = None
    """the base stream's window; default the preset's"""
    seed: int = 0
    """seed of the row order (0: the corpus order) and of initialisation"""
    mix: bool = False
    """rows mixed with retrieval samples (preset.retrieval_share of them)"""
    recipe: dict = field(default_factory=dict)
    """training fields of the preset this arm changes (lr, align_frac, ce, ...: `arm_preset`)"""
    sharpen: tuple = ()
    """(fraction f, scale s): before training, the output stream's queries of the layers from
    f * L on multiplied by s (their SO vectors): sharper lookups over a long prompt
    (benchmarks/passkey_temperature_probe.py); a start, which training then moves"""
    adapter: str | None = None
    """a shipped adapter (a directory of the project's adapters/) applied after the conversion: a
    calibration evaluated with the table's protocol (mode None), or a start training moves on"""


SINK = 4  # attention sinks of the -sink arms (StreamingLLM's 4; 1 measured as good zero-shot: docs/conversion.md)


def _kd(label, teacher, mode="all", **kw):
    return Arm(label, dict(attention="orthros"), mode, teacher, mix=True, **kw)


LORA_LR = 1e-3  # the light arms' LoRA learning rate (CPTPreset.lora_lr)


def _recipe(mode: str, window: int, seed: int = 0, rank: int = 8, fqk: bool = False, attn: bool = False,
            long: float = 0.0, long_text: bool = False, head: bool = False, lora_plus: float = 0.0,
            dora: bool = False, lora_lr_x: float = 0.0, teacher: str | None = None) -> dict:
    """{name: arm} of the retrieval recipe (sinks, retrieval data, answers x32) at full weights ("all") or
    as a light twin ("lora+so"), at a window, with the variant's seed, LoRA rank, W_Q / W_K frozen or
    LoRA on the attention projections only (`attn`: the MLPs as the source's), and the far context's
    tokens weighed up to `long` times (long_weight_cap): every target's, or the text's only (`long_text`:
    the answers keep their x32); `head`: LoRA on the LM head too (a delta of the tied head's own);
    `lora_plus`: the B factors learn this many times faster than the A factors (LoRA+); `dora`: the LoRA
    weight-decomposed (DoRA: each output row's length trained apart from its direction); `lora_lr_x`: the
    LoRA factors' learning rate this many times CPTPreset's; `teacher`: distilled from that arm (KL on every
    position, the answers' weight kept; the preset's K/V alignment first), which the run trains first."""
    light = mode == "lora+so"
    name = f"orthros-{'lora' if light else 'cpt'}-sink-mix-aw-w{window}" + (f"-s{seed}" if seed else "") \
        + (f"-r{rank}" if rank != 8 else "") + ("-fqk" if fqk else "") + ("-attn" if attn else "") \
        + ("-head" if head else "") + (f"-lce{long:g}" if long else "") + ("t" if long and long_text else "") \
        + (f"-lp{lora_plus:g}" if lora_plus else "") + ("-dora" if dora else "") \
        + (f"-lr{lora_lr_x:g}x" if lora_lr_x else "") + ("-kd-" + _TEACHERS[teacher][0] if teacher else "")
    label = (f"Orthros + {SINK} sinks + {'light CPT (LoRA + SO)' if light else 'CPT'} with retrieval data, "
             f"answers x32, W={window}" + (f", seed {seed}" if seed else "") + (f", rank {rank}" if rank != 8 else "")
             + (", W_Q / W_K frozen" if fqk else "") + (", LoRA on attention only" if attn else "")
             + (", LoRA on the LM head too" if head else "")
             + (f", far-context {'text' if long_text else 'tokens'} weighed up to x{long:g}" if long else "")
             + (f", LoRA+ (B at x{lora_plus:g} the rate)" if lora_plus else "") + (", DoRA" if dora else "")
             + (f", LoRA at x{lora_lr_x:g} the rate" if lora_lr_x else "")
             + (f", distilled from {_TEACHERS[teacher][1]}" if teacher else ""))
    recipe = dict(answer_weight=32.0, **(dict(lora_rank=rank) if rank != 8 else {}),
                  **(dict(freeze=("q_proj", "k_proj")) if fqk else {}),
                  **(dict(lora_targets=("q_proj", "k_proj", "v_proj", "o_proj")) if attn else {}),
                  **(dict(lora_targets=(*LORA_TARGETS, HEAD)) if head else {}),
                  **(dict(long_weight_cap=long) if long else {}),
                  **(dict(long_weight_answers=False) if long and long_text else {}),
                  **(dict(lora_b_ratio=lora_plus) if lora_plus else {}), **(dict(lora_dora=True) if dora else {}),
                  **(dict(lora_lr=LORA_LR * lora_lr_x) if lora_lr_x else {}))
    return {name: Arm(label, dict(attention="orthros", sink_tokens=SINK), mode, teacher, mix=True, window=window,
                      seed=seed, recipe=recipe)}


# the teachers a recipe arm may name: how its name and its label call them
_TEACHERS = {"orthros-cpt-sink-mix-aw-w1024": ("full", "its full-weight twin")}


ARMS = {
    "source": Arm("Source model (full attention)", dict(attention="full")),
    "orthros-0shot": Arm("Orthros, zero-shot", dict(attention="orthros")),
    "orthros-cpt": Arm("Orthros + CPT", dict(attention="orthros"), "all"),
    "full-cpt": Arm("Source arch. + CPT", dict(attention="full"), "all"),
    "swa-cpt": Arm("SWA + CPT", dict(attention="swa"), "all"),
    "orthros-noso": Arm("Orthros w/o SO + CPT", dict(attention="orthros", scale_offset=False), "all"),
    "orthros-so": Arm("Orthros + light CPT (SO + norms)", dict(attention="orthros"), "so+norms"),
    "orthros-lora": Arm("Orthros + light CPT (LoRA + SO)", dict(attention="orthros"), "lora+so"),
    "orthros-kd": _kd("Orthros distilled from the source", "source"),
    "orthros-kd-d": _kd("Orthros distilled from (d)", "full-cpt"),
    "orthros-kd-d-lora": _kd("Orthros distilled from (d), LoRA + SO", "full-cpt", "lora+so"),
    "orthros-kd-lora": _kd("Orthros distilled from the source, LoRA + SO", "source", "lora+so"),
    "orthros-kd-d-nomix": Arm("Orthros distilled from (d), no retrieval data", dict(attention="orthros"), "all",
                              "full-cpt"),
    "orthros-kd-d-w256": _kd("Orthros distilled from (d), W=256", "full-cpt", window=256),
    "orthros-kd-d-w512": _kd("Orthros distilled from (d), W=512", "full-cpt", window=512),
    "orthros-kd-d-s1": _kd("Orthros distilled from (d), seed 1", "full-cpt", seed=1),
    # the cheap levers on the best window, should distillation from (d) stay short of its targets
    "orthros-kd-d-w256-lr3": _kd("Orthros distilled from (d), W=256, peak LR 3e-4", "full-cpt", window=256,
                                 recipe=dict(lr=3e-4)),
    "orthros-kd-d-w256-align50": _kd("Orthros distilled from (d), W=256, K/V alignment for half the steps",
                                     "full-cpt", window=256, recipe=dict(align_frac=0.5)),
    "orthros-kd-d-w256-ce": _kd("Orthros distilled from (d), W=256, KL + 0.5 CE", "full-cpt", window=256,
                                recipe=dict(ce=0.5)),
    "orthros-cpt-s1": Arm("Orthros + CPT, seed 1", dict(attention="orthros"), "all", seed=1),
    # the base window also sees each document's first SINK tokens (`OrthrosConfig.sink_tokens`)
    "orthros-0shot-sink": Arm(f"Orthros + {SINK} sinks, zero-shot", dict(attention="orthros", sink_tokens=SINK)),
    "orthros-cpt-sink": Arm(f"Orthros + {SINK} sinks + CPT", dict(attention="orthros", sink_tokens=SINK), "all"),
    "orthros-cpt-sink-s1": Arm(f"Orthros + {SINK} sinks + CPT, seed 1", dict(attention="orthros", sink_tokens=SINK),
                               "all", seed=1),
    # CE on the corpus with retrieval rows spliced in (the loss on their answers): the lookup the
    # output stream must learn, without a teacher
    "orthros-cpt-sink-mix": Arm(f"Orthros + {SINK} sinks + CPT with retrieval data", dict(attention="orthros",
                                sink_tokens=SINK), "all", mix=True),
    "orthros-lora-sink-mix": Arm(f"Orthros + {SINK} sinks + light CPT (LoRA + SO) with retrieval data",
                                 dict(attention="orthros", sink_tokens=SINK), "lora+so", mix=True),
    "orthros-kd-sink": Arm(f"Orthros + {SINK} sinks distilled from the source", dict(attention="orthros",
                           sink_tokens=SINK), "all", "source", mix=True),
    "orthros-kd-d-sink": Arm(f"Orthros + {SINK} sinks distilled from (d)", dict(attention="orthros", sink_tokens=SINK),
                             "all", "full-cpt", mix=True),
    "orthros-kd-lora-sink": Arm(f"Orthros + {SINK} sinks distilled from the source, LoRA + SO",
                                dict(attention="orthros", sink_tokens=SINK), "lora+so", "source", mix=True),
    "orthros-kd-d-lora-sink": Arm(f"Orthros + {SINK} sinks distilled from (d), LoRA + SO",
                                  dict(attention="orthros", sink_tokens=SINK), "lora+so", "full-cpt", mix=True),
    # the output stream's SO alone (`make_trainable(..., "so-out")`): the base stream and its K/V stay the
    # zero-shot conversion's; only how the output rows query them is learnt (the CPU calibration:
    # benchmarks/so_out_calibration.py)
    "orthros-kd-so-out-sink": Arm(f"Orthros + {SINK} sinks, output-stream SO distilled from the source",
                                  dict(attention="orthros", sink_tokens=SINK), "so-out", "source", mix=True,
                                  # the CPU calibration's rate; no K/V alignment (the base stream is frozen)
                                  recipe=dict(light_lr=1e-2, align_frac=0.0)),
    # the same two light arms from sharper output-stream lookups in the second half of the layers
    # (x 1.4: the probe's setting that extends a learnt lookup to 7,680 tokens at +3-4% perplexity)
    "orthros-kd-so-out-sink-sharp": Arm(f"Orthros + {SINK} sinks, output-stream SO distilled from the source, "
                                        "sharpened start", dict(attention="orthros", sink_tokens=SINK), "so-out",
                                        "source", mix=True, recipe=dict(light_lr=1e-2, align_frac=0.0),
                                        sharpen=(0.5, 1.4)),
    "orthros-kd-lora-sink-sharp": Arm(f"Orthros + {SINK} sinks distilled from the source, LoRA + SO, sharpened start",
                                      dict(attention="orthros", sink_tokens=SINK), "lora+so", "source", mix=True,
                                      sharpen=(0.5, 1.4)),
    "orthros-kd-d-w256-sink": Arm(f"Orthros + {SINK} sinks distilled from (d), W=256",
                                  dict(attention="orthros", sink_tokens=SINK), "all", "full-cpt", window=256, mix=True),
    "full-cpt-s1": Arm("Source arch. + CPT, seed 1", dict(attention="full"), "all", seed=1),
    # the window sweep and second seeds of the two sinks recipes with retrieval data (CE; distilled)
    **{f"orthros-cpt-sink-mix-w{w}": Arm(f"Orthros + {SINK} sinks + CPT with retrieval data, W={w}",
                                         dict(attention="orthros", sink_tokens=SINK), "all", mix=True, window=w)
       for w in (256, 512)},
    **{f"orthros-kd-sink-w{w}": Arm(f"Orthros + {SINK} sinks distilled from the source, W={w}",
                                    dict(attention="orthros", sink_tokens=SINK), "all", "source", mix=True, window=w)
       for w in (256, 512)},
    # the queries and keys of every layer kept the source's (both streams read with them): the source's
    # lookup heads keep matching what they matched, only what feeds them adapts
    "orthros-cpt-sink-mix-fqk": Arm(f"Orthros + {SINK} sinks + CPT with retrieval data, W_Q / W_K frozen",
                                    dict(attention="orthros", sink_tokens=SINK), "all", mix=True,
                                    recipe=dict(freeze=("q_proj", "k_proj"))),
    "orthros-kd-sink-fqk": Arm(f"Orthros + {SINK} sinks distilled from the source, W_Q / W_K frozen",
                               dict(attention="orthros", sink_tokens=SINK), "all", "source", mix=True,
                               recipe=dict(freeze=("q_proj", "k_proj"))),
    # the answers of the retrieval samples weigh 32 text tokens each: ~5-10% of the loss instead of ~0.2%
    "orthros-cpt-sink-mix-aw": Arm(f"Orthros + {SINK} sinks + CPT with retrieval data, answers x32",
                                   dict(attention="orthros", sink_tokens=SINK), "all", mix=True,
                                   recipe=dict(answer_weight=32.0)),
    "orthros-kd-sink-aw": Arm(f"Orthros + {SINK} sinks distilled from the source, answers x32",
                              dict(attention="orthros", sink_tokens=SINK), "all", "source", mix=True,
                              recipe=dict(answer_weight=32.0)),
    # the shipped output-stream calibrations (benchmarks/so_out_calibration.py), evaluated as they are
    "orthros-so-out-shipped": Arm(f"Orthros + {SINK} sinks, shipped output-stream SO adapter",
                                  dict(attention="orthros", sink_tokens=SINK), adapter="smollm2-135m-w128-s4-so-out"),
    "orthros-so-out-phrase": Arm(f"Orthros + {SINK} sinks, shipped output-stream SO adapter, sentence answers",
                                 dict(attention="orthros", sink_tokens=SINK),
                                 adapter="smollm2-135m-w128-s4-so-out-phrase"),
    # the recipe that keeps the pass key (the rqp preset: sentence answers, x32), its light twin (an
    # adapter, as the demo ships), a second seed, the window sweep, and the same-data control: the source
    # architecture trained on the same mixed rows with the same weights
    "orthros-lora-sink-mix-aw": Arm(f"Orthros + {SINK} sinks + light CPT (LoRA + SO) with retrieval data, answers x32",
                                    dict(attention="orthros", sink_tokens=SINK), "lora+so", mix=True,
                                    recipe=dict(answer_weight=32.0)),
    # the light twin distilled from the source (its answers' whole distribution, not only the label), and
    # the light twin at a wider window: a window's quality beside its prefill speed
    "orthros-kd-lora-sink-mix-aw": Arm(f"Orthros + {SINK} sinks distilled from the source, LoRA + SO, answers x32",
                                       dict(attention="orthros", sink_tokens=SINK), "lora+so", "source", mix=True,
                                       recipe=dict(answer_weight=32.0)),
    # (and at rank 16, 10 MB: whether the light twin's 1-2.6% over its full-weight twin is the rank's)
    **_recipe("lora+so", 256), **_recipe("lora+so", 512), **_recipe("lora+so", 512, seed=1),
    **_recipe("lora+so", 512, rank=16),
    # the light twin with the MLPs as the source's: at 52.4M tokens the full twin's MLP deltas alone turned
    # the demo's answer (its margin without them: +0.17; with them: -3.11; docs/notes/2026-12-conversion.md)
    **_recipe("lora+so", 512, attn=True),
    # the light twin at the window whose full-weight recipe meets the perplexity target at 52.4M tokens, at
    # rank 8 and at rank 16 (a 10 MB adapter; the W = 512 twin at rank 8 was 2-3.4% above full weights)
    **_recipe("lora+so", 1024), **_recipe("lora+so", 1024, rank=16),
    # and with a delta on the LM head (rank 8: 0.4M numbers): full weights move the tied embedding, which no
    # projection's LoRA reaches; continued pre-training on code is where LoRA is known to learn less
    **_recipe("lora+so", 1024, head=True),
    # at 5.2M tokens rank 16 took 0.3-0.6 points off rank 8's 1.6-1.9% over full weights and the head's delta
    # nothing (docs/results.md): ranks 32 and 64 (9.9M / 19.6M numbers, 7% / 15% of the model)
    **_recipe("lora+so", 1024, rank=32), **_recipe("lora+so", 1024, rank=64),
    # rank or the rate? LoRA+ (the B factors learn 4x / 16x faster than the A factors, Hayou et al. 2024) at
    # rank 16: the numbers of -r16, so a gain over it is the optimiser's, not capacity's
    **_recipe("lora+so", 1024, rank=16, lora_plus=4), **_recipe("lora+so", 1024, rank=16, lora_plus=16),
    # or the direction? DoRA at rank 16 (each row's length a vector of its own, 0.16M numbers more), which
    # closes part of LoRA's gap to full fine-tuning at the same rank (Liu et al. 2024)
    **_recipe("lora+so", 1024, rank=16, dora=True),
    # the largest rank whose adapter stays under the demo's 16 MB (7.3M bf16 numbers, 15.2 MB with the vectors)
    **_recipe("lora+so", 1024, rank=24), **_recipe("lora+so", 1024, rank=24, dora=True),
    # rank 16 to 32 and DoRA left prose at 8K +1.55% over full weights, the gap largest just past the window
    # (docs/results.md); LoRA+ x4 cost prose. The factors' one rate, doubled: under-trained at 160 steps?
    **_recipe("lora+so", 1024, rank=24, lora_lr_x=2),
    # rank 64 (+1.9%) and twice the rate (+2.6%) widened the prose gap. The full-weight twin as the teacher:
    # its logits on every position carry what the factors miss past the window, which its labels alone do not
    **_recipe("lora+so", 1024, rank=24, teacher="orthros-cpt-sink-mix-aw-w1024"),
    "orthros-cpt-sink-mix-aw-s1": Arm(f"Orthros + {SINK} sinks + CPT with retrieval data, answers x32, seed 1",
                                      dict(attention="orthros", sink_tokens=SINK), "all", mix=True, seed=1,
                                      recipe=dict(answer_weight=32.0)),
    # the recipe at full weights over windows; at W=512 (its best perplexity) a second seed, and W_Q / W_K kept
    # the source's (its light twins, which move them only by rank 8, copy 1.15-1.4x better)
    **_recipe("all", 256), **_recipe("all", 512), **_recipe("all", 512, seed=1), **_recipe("all", 512, fqk=True),
    **_recipe("all", 1024), **_recipe("all", 1024, seed=1),
    # the W = 1024 recipe with the tokens its window cannot give weighed up to 5x / 2x (LongCE, the source
    # judging): past the window is where its perplexity gap (+1.6% / +2.2% at 8K) and its copying (2x the
    # control's loss at a 2K gap) are left. At 5.2M tokens they copy better and lose perplexity everywhere.
    # There the weights also multiply the answers' x32 (the answers' mean weight is 1.96), so that the
    # answers' share of a step's loss goes from 15% to 24%. The -t arms weigh the text only (the answers
    # keep their x32: 14%; benchmarks/results/long-weights/retrieval-answers.md)
    **_recipe("all", 1024, long=5.0), **_recipe("lora+so", 1024, long=5.0), **_recipe("all", 1024, long=2.0),
    **_recipe("all", 1024, long=5.0, long_text=True), **_recipe("all", 1024, long=2.0, long_text=True),
    "full-cpt-mix-aw": Arm("Source arch. + CPT with retrieval data, answers x32", dict(attention="full"), "all",
                           mix=True, recipe=dict(answer_weight=32.0)),
    "full-cpt-mix-aw-s1": Arm("Source arch. + CPT with retrieval data, answers x32, seed 1", dict(attention="full"),
                              "all", mix=True, seed=1, recipe=dict(answer_weight=32.0)),
    "orthros-cpt-sink-mix-s1": Arm(f"Orthros + {SINK} sinks + CPT with retrieval data, seed 1",
                                   dict(attention="orthros", sink_tokens=SINK), "all", mix=True, seed=1),
    "orthros-kd-sink-s1": Arm(f"Orthros + {SINK} sinks distilled from the source, seed 1",
                              dict(attention="orthros", sink_tokens=SINK), "all", "source", mix=True, seed=1),
}

RECIPE_FIELDS = ("lr", "light_lr", "lora_lr", "lora_b_ratio", "lora_rank", "lora_targets", "lora_dora", "warmup",
                 "kl", "ce", "temperature", "align", "align_on", "align_frac", "freeze", "answer_weight",
                 "long_weight_cap", "long_weight_answers")


def arm_preset(arm: str, preset: "CPTPreset") -> "CPTPreset":
    """The preset an arm trains with: the run's, with the arm's `recipe` changes (training fields only:
    every arm is evaluated alike)."""
    bad = set(ARMS[arm].recipe) - set(RECIPE_FIELDS)
    if bad:
        raise ValueError(f"arm {arm}: recipe may change {', '.join(RECIPE_FIELDS)}, not {', '.join(sorted(bad))}")
    return dataclasses.replace(preset, **ARMS[arm].recipe)


# what `orthros experiment cpt` runs unless --arms says otherwise: (a)-(g) of the comparison
DEFAULT_ARMS = ("source", "orthros-0shot", "orthros-cpt", "full-cpt", "orthros-kd", "orthros-kd-d",
                "orthros-kd-d-lora")


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
    lora_lr: float = LORA_LR
    lora_b_ratio: float = 1.0
    """the LoRA B factors' learning rate over lora_lr (LoRA+; 1 = one rate)"""
    lora_rank: int = 8
    lora_targets: tuple = LORA_TARGETS
    """the projections a light arm's LoRA wraps (default all of them; `models.adapter.HEAD` adds the LM head)"""
    lora_dora: bool = False
    """a light arm's LoRA weight-decomposed (DoRA)"""
    warmup: int = 20
    weight_decay: float = 0.1
    gradient_checkpointing: bool = True
    compile: bool = False
    """torch.compile each block of the student (and of a teacher), as `orthros train`'s train.compile"""
    eval_rows: int = 16
    """held-out rows per domain at seq_len (the 2K rows are cut from the same documents)"""
    short_len: int = 2048
    copy_gaps: list[int] = field(default_factory=lambda: [512, 2048, 6144])
    copy_samples: int = 32
    passkey_lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 7680])
    passkey_depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    passkey_samples: int = 10
    """samples per length and depth (5 depths x 10 = 50 a length: a 95% interval of about +-14 points)"""
    eval_batch: int = 2
    demo_chars: int = 24000
    """the demo probe (`demo.real.probe`): `orthros demo`'s question (the 343 - 634 margin) and its
    archive code at 10 / 50 / 90% depth, about the demo's chapter cut to this many characters
    (24,000: the demo's ~6K tokens); 0: not run"""
    demo_every: int = 0
    """during training, the demo probe's margin every this many steps (the model as it is then:
    the arm's `train.demo_curve`, [step, tokens, margin, the archive codes' mean log p]); 0: never"""
    lm_eval_tasks: list[str] = field(default_factory=lambda: ["python_docs_cloze", "python_docs_recall"])
    """local lm-evaluation-harness tasks (configs/lm_eval of the source checkout): the next
    word (local context), and a sentence's second half recalled from ~4K tokens back"""
    lm_eval_limit: int | None = None
    retrieval_share: float = 0.3
    """share of the rows of a -mix arm that start with a retrieval sample (data.retrieval)"""
    retrieval_lengths: tuple = (1024, 8192)
    haystack_rows: float = 4.0
    """corpus text kept apart for the retrieval samples' haystacks and the text after them, in rows
    of seq_len per retrieval row (a sample and its fill use about one row; the curve's longest
    budget fits the corpus of one machine only at 1)"""
    retrieval_questions: int = 1
    """facts a lookup sample asks in turn (one chat turn each, every answer a target)"""
    retrieval_kinds: tuple = ("passkey", "lookup", "copy")
    """the retrieval samples' kinds, in turn (data.retrieval); "docqa" has the source answer
    questions about the text (greedy, on the run's device, while the rows are made)"""
    retrieval_phrase: bool = False
    """pass keys and lookups answered in a sentence, as the source answers ("The pass key is 56993."),
    not with the bare number (data.retrieval.sample's `phrase`)"""
    retrieval_varied: bool = False
    """pass keys written and asked in many wordings (nouns, units, sentence and question forms:
    data.retrieval.varied_passkey), never the demo probe's, rather than three fixed needles"""
    kl: float = 1.0
    """distilled arms: weight of KL(teacher || student) on every output position"""
    temperature: float = 1.0
    ce: float = 0.0
    """distilled arms: weight of the cross-entropy on the labels"""
    align: float = 1.0
    """distilled arms: weight of the per-layer K/V alignment, in the first align_frac of the steps"""
    align_on: str = "kv"
    align_frac: float = 0.25
    freeze: tuple = ()
    """parameters kept the source's: those whose name contains one of these (e.g. ("q_proj", "k_proj"):
    the queries and keys the source's lookup heads match with, as QK-Restore keeps them)"""
    answer_weight: float = 1.0
    """weight of a retrieval sample's answer tokens against a text token (CE, and KL where distilled).
    A retrieval row's answers are 6 tokens (a pass key), 20-40 (a lookup of up to 8 facts) or 80-125
    (a copy) of its ~8K targets: at 1 they are 0.23% of the rq preset's targets, at 32 about 7% of
    its loss (24 rows of the SmolLM2 tokenizer)."""
    long_weight_cap: float = 0.0
    """> 0: every target also weighs min(p_full / p_window, cap), the source's probability of it with
    the whole row over that with the arm's window (LongCE with the source as the judge:
    experiments/long_weights.py), so the tokens only the far context gives count up to `cap` times;
    0: every text token weighs 1"""
    long_weight_answers: bool = True
    """with long_weight_cap: the weights also multiply the retrieval answers' answer_weight (True), or fall
    on the text only and the answers keep answer_weight (False)"""
    arms: tuple = ()
    """the arms run when --arms names none (empty: DEFAULT_ARMS, (a)-(g) of the comparison)"""
    checkpoint_every: int = 100
    """steps between an arm's training checkpoints (run_arm: out/checkpoints/ARM; 0: none); a cut
    run continues from the newest"""
    save_weights: bool = True
    """every trained arm saves its weights under out/models before its evaluation: an arm that
    teaches another needs them, and a run cut during an evaluation resumes there"""

    @property
    def train_tokens(self) -> int:
        return self.steps * self.batch_size * self.seq_len


PRESETS = {
    # One H200, all arms side by side (--jobs 8): 16K tokens a step.
    "smollm2-h200": CPTPreset(passkey_samples=4, retrieval_share=0.0),  # the 2026-12-01 table's preset
    # Distillation and the controls, 16K tokens a step, up to 6 arms side by side on one H200.
    "smollm2-kd-h200": CPTPreset(steps=320),
    # The same with denser retrieval supervision: half the rows open with a retrieval sample and a
    # lookup asks up to 8 of its facts (the zero-shot probe: the output stream must learn the lookup)
    "smollm2-kd-h200-rq": CPTPreset(steps=320, retrieval_share=0.5, retrieval_questions=8),
    # the same, pass keys and lookups answered in a sentence as the source answers them: greedy, an arm
    # trained on bare keys must find the key's first digit from the question alone, which fails past
    # ~4K tokens (the filler dilutes that lookup, benchmarks/passkey_attention_probe.py --prefix ''),
    # where after "The pass key is" a copy finds it at 7,680 (docs/notes/2026-12-conversion.md)
    "smollm2-kd-h200-rqp": CPTPreset(steps=320, retrieval_share=0.5, retrieval_questions=8, retrieval_phrase=True),
    # the same with every retrieval sample 4K-8K tokens long: most needles 1K-7K tokens before the
    # question, where every arm of the rq run lost them (0-20% beyond ~3K). Activations are kept
    # (the same math as recomputing them, ~1.4x faster a step: benchmarks/cpt_steps.py; three arms
    # side by side: an estimated 20-25 GB each), so that three arms train and are evaluated in one 10-minute call
    # on an H200; on an H100 (80 GB) the two distilled arms of three did not finish (2026-12-05): --jobs 2 there
    "smollm2-kd-h200-far": CPTPreset(steps=320, retrieval_share=0.5, retrieval_questions=8,
                                     retrieval_lengths=(4096, 8192), gradient_checkpointing=False),
    # the same as rq, a quarter of the retrieval samples questions about their text that the source answers
    "smollm2-kd-h200-qa": CPTPreset(steps=320, retrieval_share=0.5, retrieval_questions=4,
                                    retrieval_kinds=("passkey", "lookup", "copy", "docqa"),
                                    gradient_checkpointing=False),
    # rqp's sentence answers with qa's document questions: the pass-key recipe's arms read one key well
    # but answer the demo's question with the later of two PEPs in the text (benchmarks/demo_answer_margin.py)
    "smollm2-kd-h200-rqpqa": CPTPreset(steps=320, retrieval_share=0.5, retrieval_questions=8, retrieval_phrase=True,
                                       retrieval_kinds=("passkey", "lookup", "copy", "docqa")),
    # rqp with compound lookups in turn with the others: facts named by two words, each word shared with
    # other facts ("the golden tower" beside "the golden mill" and "the upper tower"), asked by the whole
    # name; what the demo's question needs (its PEP named by its title among other PEPs) and rqp's
    # one-word lookups never asked
    "smollm2-kd-h200-rqpc": CPTPreset(steps=320, retrieval_share=0.5, retrieval_questions=8, retrieval_phrase=True,
                                      retrieval_kinds=("passkey", "lookup", "copy", "compound")),
    # The token curve: 32K tokens a step (4 rows), activations kept (a 135M model needs no
    # recomputation on an H200), one or two arms at a time; --steps sets the budget: 160 / 480 /
    # 1600 steps = 5.2M / 15.7M / 52.4M tokens. Step time of the distilled arm on one H200, alone
    # (benchmarks/cpt_steps.py, before the LM heads were chunked): 0.697 s at 2 rows with
    # recomputation (23.5K tokens/s), 0.48 s at 2 rows without (34K), 1.14 s at 8 rows without (57.5K).
    "smollm2-kd-h200-curve": CPTPreset(batch_size=4, steps=480, gradient_checkpointing=False),
    # the same curve for the recipe that keeps the pass key (rqp's data; arms orthros-cpt-sink-mix-aw and
    # full-cpt-mix-aw): 4 rows a step, half of them retrieval samples answered in sentences
    # (haystacks: 1 row of text per retrieval row, where 4 would ask 157M tokens of a machine's 87M at 1600 steps)
    "smollm2-kd-h200-rqp-curve": CPTPreset(batch_size=4, steps=480, gradient_checkpointing=False,
                                           retrieval_share=0.5, retrieval_questions=8, retrieval_phrase=True,
                                           haystack_rows=1.0, demo_every=100),
    # The headline of docs/results.md: the recipe at W = 512 and its same-data control on the curve's
    # data, 1,600 steps x 4 rows = 52.4M tokens each, side by side (--jobs 2; about 1,160 and 870 s of
    # training on one H100, 150 s to prepare the rows)
    "smollm2-w512-52m": CPTPreset(batch_size=4, steps=1600, gradient_checkpointing=False, retrieval_share=0.5,
                                  retrieval_questions=8, retrieval_phrase=True, haystack_rows=1.0, demo_every=100,
                                  arms=("orthros-cpt-sink-mix-aw-w512", "full-cpt-mix-aw")),
    # The 52.4M schedule with pass keys in many wordings (data.retrieval.varied_passkey): the W = 1024 recipe
    # met the perplexity target but, like the 52.4M light twin, stopped finding the demo's archive code,
    # which the 52.4M twin finds when it is written as the training's needle is (benchmarks/fact_phrasing_probe.py)
    "smollm2-52m-varied": CPTPreset(batch_size=4, steps=1600, gradient_checkpointing=False, retrieval_share=0.5,
                                    retrieval_questions=8, retrieval_phrase=True, retrieval_varied=True,
                                    haystack_rows=1.0, demo_every=100,
                                    arms=("orthros-lora-sink-mix-aw-w1024", "orthros-cpt-sink-mix-aw-w1024")),
    # The whole pipeline on a CPU in a few minutes: a short window, short rows, a few steps.
    "smollm2-cpu-smoke": CPTPreset(window=16, seq_len=256, batch_size=2, steps=3, warmup=1, eval_rows=2, demo_chars=600,
                                   short_len=128, copy_gaps=[64], copy_samples=2, passkey_lengths=[160],
                                   passkey_depths=[0.5], passkey_samples=1, gradient_checkpointing=False,
                                   lm_eval_limit=4, lm_eval_tasks=["python_docs_cloze"], retrieval_lengths=(96, 200)),
}
