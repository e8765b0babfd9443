"""Training configuration: dataclasses whose attribute docstrings are the CLI help.

One YAML file per experiment (`configs/*.yaml`), any field overridable on
the command line as `--section.field value`:

    orthros train configs/pretrain-tiny.yaml --train.steps 200 --model.attention full

Unknown keys are errors, never silently ignored.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..errors import UserError, one_line


@dataclass
class ModelArgs:
    name: str = "tiny"
    """preset size for a model trained from scratch (tiny, small, 160m, 1.3b, llama-3.1-8b, qwen3-8b)"""
    init_from: str | None = None
    """model directory (a checkpoint or a converted model) to continue pre-training / fine-tune from"""
    attention: str | None = None
    """orthros, full (causal Transformer baseline) or swa (sliding window only); default: the preset's / checkpoint's"""
    window_size: int | None = None
    """sliding window of the base stream (counts the current token)"""
    scale_offset: bool | None = None
    """per-stream query scale-offset; false = the paper's w/o-SO ablation"""
    attn_backend: str | None = None
    """attention op: auto, naive, flex or triton"""
    vocab_size: int | None = None
    """vocabulary size of a model from scratch; default: the tokenizer's, rounded up to a multiple of 64"""
    overrides: dict = field(default_factory=dict)
    """other OrthrosConfig fields of a model from scratch, e.g. {num_hidden_layers: 4}"""
    trainable: str = "all"
    """what trains: all, so-out (the output stream's scale-offsets: the base stream and its K/V stay the
    conversion's), so (scale-offsets), so+norms, or lora+so (LoRA on every projection + SO + norms)"""
    lora_rank: int = 8
    """LoRA rank (trainable: lora+so)"""
    lora_alpha: float | None = None
    """LoRA scale numerator (the delta is B A * alpha / rank); default 2 * lora_rank"""
    lora_targets: list[str] | None = None
    """what LoRA wraps (trainable: lora+so): default every projection (q/k/v/o_proj, gate/up/down_proj);
    add lm_head for a delta of the LM head (a tied head is untied when merged)"""
    lora_dora: bool = False
    """weight-decomposed LoRA (DoRA): each output row's length trains as a vector of its own"""


@dataclass
class DataArgs:
    train: list[str] = field(default_factory=lambda: ["stdlib"])
    """training data: text files, directories, .jsonl files, or 'stdlib' (this Python's standard-library sources)"""
    heldout: list[str] | None = None
    """held-out data for evaluation; default: the stdlib held-out split when training on stdlib, else none"""
    format: str = "auto"
    """text (pre-training), sft (prompt/response or messages jsonl), or auto (from the first jsonl record)"""
    text_field: str = "text"
    """field of a jsonl record holding a pre-training document"""
    tokenizer: str = "auto"
    """auto (the init_from model's, else a trained BPE), bpe, bytes, or a tokenizer directory"""
    vocab_size: int = 8192
    """vocabulary of a BPE trained on the corpus"""
    bpe_max_bytes: int = 20_000_000
    """characters of the corpus a BPE is trained on"""
    max_bytes: int | None = None
    """read at most this many characters of training text (quick runs)"""
    seq_len: int = 512
    """tokens per packed row"""
    prefetch: int = 4
    """batches prepared ahead by a background thread (0 = none)"""


@dataclass
class OptimArgs:
    lr: float = 3e-4
    """peak learning rate (AdamW)"""
    min_lr_ratio: float = 0.1
    """the cosine schedule decays to lr * min_lr_ratio"""
    warmup_steps: int = 100
    """linear warm-up steps"""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices and embeddings (not on norms, biases or scale-offsets)"""
    beta1: float = 0.9
    """AdamW beta1"""
    beta2: float = 0.95
    """AdamW beta2"""
    eps: float = 1e-8
    """AdamW epsilon"""
    grad_clip: float = 1.0
    """clip the global gradient norm to this (0 = off)"""
    vector_lr: float | None = None
    """peak learning rate of the vectors (norms, biases, scale-offsets); default optim.lr"""
    lora_lr: float | None = None
    """peak learning rate of the LoRA factors; default optim.lr"""
    lora_b_ratio: float = 1.0
    """the LoRA B factors' learning rate is the A factors' times this (LoRA+, which suggests 2-16); 1 = one rate"""


@dataclass
class DistillArgs:
    teacher: str | None = None
    """frozen teacher: a Llama / Qwen3 directory or GGUF (run as its Transformer) or an Orthros directory; null = no distillation"""
    teacher_attention: str | None = None
    """run an Orthros teacher as orthros, full or swa (full: a converted model as its source Transformer)"""
    kl: float = 1.0
    """weight of KL(teacher || student) on every output position"""
    temperature: float = 1.0
    """softmax temperature of the KL term (the term is scaled by temperature^2)"""
    ce: float = 0.0
    """weight of the next-token cross-entropy on the data's labels"""
    align: float = 0.0
    """weight of the per-layer alignment MSE (each layer's error over the teacher's mean square)"""
    align_on: str = "kv"
    """what the alignment compares: kv (key / value projections), hidden (each layer's input) or kv+hidden"""
    align_steps: int | None = None
    """apply the alignment term in the first align_steps steps only (a warm-up phase); null = every step"""


@dataclass
class TrainArgs:
    steps: int = 1000
    """optimizer steps"""
    batch_size: int = 8
    """rows per micro-batch per process"""
    grad_accum: int = 1
    """micro-batches per optimizer step (global batch = batch_size x grad_accum x processes)"""
    seed: int = 0
    """seed of initialization and data order"""
    device: str = "auto"
    """auto (cuda when present), cpu or cuda"""
    dtype: str = "auto"
    """auto (bf16 autocast on GPU, fp32 on CPU), bf16 or fp32"""
    gradient_checkpointing: bool = False
    """recompute each block's activations in the backward pass (less memory, ~30% more compute)"""
    compile: bool = False
    """torch.compile each block"""
    max_seconds: float | None = None
    """stop (and save) after this many seconds of training (counted after the first step, which compiles)"""
    stop_at: int | None = None
    """stop (and save) after this step, keeping the schedule of train.steps (run a job in parts)"""
    log_every: int = 10
    """steps between metrics records"""
    eval_every: int = 200
    """steps between held-out evaluations (and one at the end)"""
    eval_batches: int = 8
    """held-out global batches (batch_size x grad_accum x processes rows) per evaluation"""


@dataclass
class CheckpointArgs:
    every: int = 500
    """steps between checkpoints (0 = only at the end)"""
    keep: int = 2
    """checkpoints kept (older ones are deleted)"""
    resume: str | None = None
    """latest (newest checkpoint in out_dir, error if none), auto (latest if any), or a checkpoint directory"""


@dataclass
class LogArgs:
    progress: bool = True
    """tqdm progress bar"""
    plot: bool = True
    """write loss.png at the end"""
    tensorboard: bool = False
    """also write TensorBoard events (if tensorboard is installed)"""


@dataclass
class TrainConfig:
    out_dir: str = "runs/train"
    """run directory: metrics.jsonl, loss.png, tokenizer/, checkpoints/"""
    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataArgs = field(default_factory=DataArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    distill: DistillArgs = field(default_factory=DistillArgs)
    train: TrainArgs = field(default_factory=TrainArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    log: LogArgs = field(default_factory=LogArgs)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(TrainConfig) if f.name != "out_dir"}
_SECTION_CLASSES = {"model": ModelArgs, "data": DataArgs, "optim": OptimArgs, "distill": DistillArgs, "train": TrainArgs,
                    "checkpoint": CheckpointArgs, "log": LogArgs}


def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings of a dataclass: {field: the string literal under it}."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for a, b in zip(body, body[1:]):
        if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
            docs[a.target.id] = b.value.value.strip()
    return docs


def options() -> list[tuple[str, type, object, str]]:
    """Every settable key as (dotted name, type, default, help)."""
    out = []
    hints = typing.get_type_hints(TrainConfig)
    out.append(("out_dir", hints["out_dir"], TrainConfig.out_dir, field_docs(TrainConfig)["out_dir"]))
    for sec, cls in _SECTION_CLASSES.items():
        docs, hints, inst = field_docs(cls), typing.get_type_hints(cls), cls()
        for f in dataclasses.fields(cls):
            out.append((f"{sec}.{f.name}", hints[f.name], getattr(inst, f.name), docs.get(f.name, "")))
    return out


def _coerce(key: str, tp, value, from_cli: bool):
    """Check (and, for CLI strings, parse) `value` against the annotation `tp`."""
    args = typing.get_args(tp)
    optional = (typing.get_origin(tp) in (typing.Union, types.UnionType)) and type(None) in args
    base = next(a for a in args if a is not type(None)) if optional else tp
    if from_cli:
        if optional and value.lower() in ("null", "none", "~"):
            return None
        if base is not str:
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                raise ValueError(f"{key}: cannot parse {value!r}") from None
            if typing.get_origin(base) is list and isinstance(value, str):
                value = [value]
    if value is None:
        if optional:
            return None
        raise ValueError(f"{key} may not be null")
    origin = typing.get_origin(base) or base
    if origin is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if origin is float and isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if origin is list and isinstance(value, str):
        value = [value]
    ok = isinstance(value, origin) and not (origin in (int, float) and isinstance(value, bool))
    if ok and origin is list:
        ok = all(isinstance(v, str) for v in value)
    if not ok:
        want = getattr(base, "__name__", str(base))
        raise ValueError(f"{key} must be {want}{' or null' if optional else ''}, got {value!r}")
    return value


def build_config(file: str | Path | None = None, overrides: dict[str, str] | None = None) -> TrainConfig:
    """A TrainConfig from a YAML file (optional) and `{dotted.key: str}` CLI overrides."""
    known = {name: tp for name, tp, _, _ in options()}
    flat: dict[str, object] = {}
    if file is not None:
        p = Path(file)
        if not p.is_file():
            raise FileNotFoundError(f"config file {str(p)!r} does not exist" if not p.exists()
                                    else f"{p}: not a config file (a directory?)")
        try:
            raw = yaml.safe_load(p.read_bytes().decode("utf-8")) or {}
        except UnicodeDecodeError as e:
            raise UserError(f"{p}: not a YAML config (not UTF-8 text: byte at offset {e.start})") from None
        except yaml.YAMLError as e:
            raise UserError(f"{p}: not valid YAML ({one_line(e)})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{p}: the config must be a mapping of sections")
        for k, v in raw.items():
            if k in _SECTION_CLASSES:
                if not isinstance(v, dict):
                    raise ValueError(f"{p}: section {k!r} must be a mapping")
                for kk, vv in v.items():
                    flat[f"{k}.{kk}"] = vv
            else:
                flat[k] = v
        for k in flat:
            if k not in known:
                raise ValueError(f"{p}: unknown config key {k!r}; known keys: {', '.join(sorted(known))}")
        flat = {k: _coerce(f"{p}: {k}", known[k], v, from_cli=False) for k, v in flat.items()}
    for k, v in (overrides or {}).items():
        if k not in known:
            raise ValueError(f"unknown option --{k}")
        flat[k] = _coerce(f"--{k}", known[k], v, from_cli=True)
    cfg = TrainConfig()
    for k, v in flat.items():
        if "." in k:
            sec, name = k.split(".", 1)
            setattr(getattr(cfg, sec), name, v)
        else:
            setattr(cfg, k, v)
    validate(cfg)
    return cfg


def validate(cfg: TrainConfig) -> None:
    """Range checks that need no data or model; ValueError names the key."""
    def need(ok, key, msg):
        if not ok:
            raise ValueError(f"{key} {msg}")

    t, o, d = cfg.train, cfg.optim, cfg.data
    for key, v in (("train.steps", t.steps), ("train.batch_size", t.batch_size), ("train.grad_accum", t.grad_accum),
                   ("train.log_every", t.log_every), ("train.eval_every", t.eval_every), ("data.seq_len", d.seq_len),
                   ("checkpoint.keep", cfg.checkpoint.keep)):
        need(v >= 1, key, f"must be >= 1, got {v}")
    need(t.eval_batches >= 0, "train.eval_batches", f"must be >= 0, got {t.eval_batches}")
    need(cfg.checkpoint.every >= 0, "checkpoint.every", f"must be >= 0, got {cfg.checkpoint.every}")
    need(o.lr > 0, "optim.lr", f"must be > 0, got {o.lr}")
    need(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", f"must lie in [0, 1], got {o.min_lr_ratio}")
    need(o.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    need(o.grad_clip >= 0, "optim.grad_clip", f"must be >= 0, got {o.grad_clip}")
    need(o.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {o.weight_decay}")
    for key, v in (("optim.beta1", o.beta1), ("optim.beta2", o.beta2)):
        need(0 <= v < 1, key, f"must lie in [0, 1), got {v}")
    need(o.eps > 0, "optim.eps", f"must be > 0, got {o.eps}")
    need(d.prefetch >= 0, "data.prefetch", f"must be >= 0, got {d.prefetch}")
    need(d.bpe_max_bytes >= 1, "data.bpe_max_bytes", f"must be >= 1, got {d.bpe_max_bytes}")
    need(d.max_bytes is None or d.max_bytes >= 1, "data.max_bytes", f"must be >= 1 or null, got {d.max_bytes}")
    need(t.max_seconds is None or t.max_seconds > 0, "train.max_seconds", f"must be > 0 or null, got {t.max_seconds}")
    need(t.stop_at is None or t.stop_at >= 1, "train.stop_at", f"must be >= 1 or null, got {t.stop_at}")
    need(t.device in ("auto", "cpu", "cuda") or t.device.startswith("cuda:"), "train.device",
         f"must be auto, cpu or cuda, got {t.device!r}")
    need(t.dtype in ("auto", "bf16", "fp32"), "train.dtype", f"must be auto, bf16 or fp32, got {t.dtype!r}")
    need(d.format in ("auto", "text", "sft"), "data.format", f"must be auto, text or sft, got {d.format!r}")
    need(len(d.train) > 0, "data.train", "needs at least one source")
    m, ds = cfg.model, cfg.distill
    from ..models.adapter import LORA_KNOWN, MODES

    need(m.trainable in MODES, "model.trainable", f"must be one of {', '.join(MODES)}, got {m.trainable!r}")
    need(m.lora_rank >= 1, "model.lora_rank", f"must be >= 1, got {m.lora_rank}")
    need(m.lora_targets is None or (len(m.lora_targets) > 0 and set(m.lora_targets) <= set(LORA_KNOWN)),
         "model.lora_targets", f"must be some of {', '.join(LORA_KNOWN)}, got {m.lora_targets}")
    need(m.trainable == "all" or m.init_from is not None, "model.trainable",
         f"{m.trainable!r} trains a delta on an existing model: set model.init_from")
    for key, v in (("optim.vector_lr", o.vector_lr), ("optim.lora_lr", o.lora_lr)):
        need(v is None or v > 0, key, f"must be > 0 or null, got {v}")
    need(o.lora_b_ratio > 0, "optim.lora_b_ratio", f"must be > 0, got {o.lora_b_ratio}")
    for key, v in (("distill.kl", ds.kl), ("distill.ce", ds.ce), ("distill.align", ds.align)):
        need(v >= 0, key, f"must be >= 0, got {v}")
    need(ds.temperature > 0, "distill.temperature", f"must be > 0, got {ds.temperature}")
    need(ds.align_on in ("kv", "hidden", "kv+hidden"), "distill.align_on",
         f"must be kv, hidden or kv+hidden, got {ds.align_on!r}")
    need(ds.align_steps is None or ds.align_steps >= 0, "distill.align_steps",
         f"must be >= 0 or null, got {ds.align_steps}")
    need(ds.teacher_attention in (None, "orthros", "full", "swa"), "distill.teacher_attention",
         f"must be orthros, full or swa, got {ds.teacher_attention!r}")
    if ds.teacher is not None:
        need(ds.kl + ds.ce + ds.align > 0, "distill", "weights kl, ce and align are all 0: nothing to train on")
    if cfg.model.attention is not None:
        need(cfg.model.attention in ("orthros", "full", "swa"), "model.attention",
             f"must be orthros, full or swa, got {cfg.model.attention!r}")


def dump(cfg: TrainConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
