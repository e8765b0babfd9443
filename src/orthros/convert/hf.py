"""Llama 3.x / Qwen3 / Qwen3-MoE / Mixtral checkpoints -> Orthros, streamed tensor by tensor.

Orthros keeps transformers' Llama parameter names, so every weight is reused
under its own name; each layer gains the scale-offset (SO) vectors at
identity (alpha = 1, beta = 0; the last layer only the output stream's, its
base stream makes K/V only). With `window_size >= T` the converted model
computes exactly the source model (SPEC invariant 2); with a real window it
needs continued pre-training (configs/cpt-*.yaml).

    convert_checkpoint("Meta-Llama-3.1-8B", "llama-3.1-8b-orthros", window_size=128)

Everything is checked (architecture, shards present, every tensor's name and
shape) before a byte is written; output goes to a temporary directory beside
DST that is renamed at the end, so a failure leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..errors import UserError, one_line, read_json
from ..models.config import OrthrosConfig
from .safetensors_stream import BLOCK_BYTES, PlannedTensor, ShardWriter, TensorInfo, iter_blocks, parse_size, \
    plan_shards, read_header

SUPPORTED = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
             "mixtral": "MixtralForCausalLM"}
# Mixtral's tensor names -> Orthros' (Qwen3-MoE's already match)
MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                 (".w2.", ".down_proj."))
OUT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# pickled checkpoints: never loaded (unpickling runs code); a directory holding only these is refused
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
DROPPED = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry; Orthros recomputes them
SO_INIT = {"so_alpha": 1.0, "so_beta": 0.0, "so_alpha_out": 1.0, "so_beta_out": 0.0}


# ---------------------------------------------------------------- config
def orthros_config(src: dict, window_size: int = 128, scale_offset: bool = True, dtype: str = "bf16",
                   output_routing: str | None = None, sink_tokens: int = 0) -> OrthrosConfig:
    """A Llama / Qwen3 / Qwen3-MoE / Mixtral `config.json` dict -> OrthrosConfig (ValueError naming what is
    unsupported). Qwen3-MoE's tensors already carry Orthros' names (`mlp.gate`, `mlp.experts.{e}.*`);
    Mixtral's are renamed (`MIXTRAL_NAMES`)."""
    kind = src.get("model_type")
    if kind not in SUPPORTED:
        archs = src.get("architectures") or []
        raise ValueError(f"unsupported architecture: model_type={kind!r} ({', '.join(archs) or 'no architectures'}); "
                         f"supported: {', '.join(f'{k} ({v})' for k, v in SUPPORTED.items())}")

    def need(cond, field, msg):
        if not cond:
            raise ValueError(f"unsupported {kind} checkpoint: {field}={src.get(field)!r} ({msg})")

    need(src.get("hidden_act", "silu") == "silu", "hidden_act", "Orthros has a SwiGLU (silu) MLP")
    need(not src.get("attention_bias", False), "attention_bias", "projections without bias only")
    need(not src.get("mlp_bias", False), "mlp_bias", "MLP without bias only")
    if kind in ("qwen3", "qwen3_moe"):
        need(not src.get("use_sliding_window", False), "use_sliding_window", "every layer must be full attention")
    if kind == "mixtral":
        need(src.get("sliding_window") is None, "sliding_window", "every layer must be full attention")
    layer_types = src.get("layer_types")
    need(layer_types is None or set(layer_types) <= {"full_attention"}, "layer_types",
         "every layer must be full attention")

    # transformers 5 writes `rope_parameters` (with rope_theta inside); 4.x `rope_theta` + `rope_scaling`.
    rope = dict(src.get("rope_parameters") or src.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", src.get("rope_theta", 10000.0))
    kind_rope = rope.get("rope_type", rope.get("type", "default"))
    rope_scaling = None if kind_rope == "default" else rope

    moe = kind in ("qwen3_moe", "mixtral")
    if output_routing is not None and not moe:
        raise ValueError(f"output_routing={output_routing!r}: only a mixture-of-experts checkpoint (Qwen3-MoE, "
                         f"Mixtral) routes, not a {kind} one")
    heads = src["num_attention_heads"]
    need(type(heads) is int and heads >= 1, "num_attention_heads", "must be a positive integer")
    need(src.get("head_dim") or (type(src["hidden_size"]) is int and src["hidden_size"] % heads == 0),
         "hidden_size", f"must be a multiple of num_attention_heads={heads} when no head_dim is given")
    return OrthrosConfig(
        vocab_size=src["vocab_size"],
        hidden_size=src["hidden_size"],
        intermediate_size=src["intermediate_size"],
        num_hidden_layers=src["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=src.get("num_key_value_heads") or heads,
        head_dim=src.get("head_dim") or src["hidden_size"] // heads,
        max_position_embeddings=src.get("max_position_embeddings", 8192),
        initializer_range=src.get("initializer_range", 0.02),
        rms_norm_eps=src.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        qk_norm=kind in ("qwen3", "qwen3_moe"),
        tie_word_embeddings=bool(src.get("tie_word_embeddings", False)),
        window_size=window_size,
        sink_tokens=sink_tokens,
        attention="orthros",
        scale_offset=scale_offset,
        **(_moe_fields(src) if kind == "qwen3_moe" else _mixtral_fields(src) if kind == "mixtral" else {}),
        **({"output_routing": output_routing or "independent",
            "output_router_logits": bool(src.get("output_router_logits", False)),
            "router_aux_loss_coef": src.get("router_aux_loss_coef", 0.001)} if moe else {}),
        pad_token_id=src.get("pad_token_id"),
        bos_token_id=src.get("bos_token_id"),
        eos_token_id=src.get("eos_token_id"),
        architectures=["OrthrosForCausalLM"],
        dtype={"bf16": "bfloat16", "fp32": "float32"}[dtype],
    )


def _moe_fields(src: dict) -> dict:
    """The mixture-of-experts fields of a Qwen3-MoE `config.json` (transformers' names and defaults;
    transformers 5 writes the expert count as `num_local_experts`)."""
    return dict(num_experts=src["num_experts"] if "num_experts" in src else src["num_local_experts"],
                num_experts_per_tok=src.get("num_experts_per_tok", 8),
                moe_intermediate_size=src.get("moe_intermediate_size", 768),
                norm_topk_prob=bool(src.get("norm_topk_prob", False)),
                decoder_sparse_step=src.get("decoder_sparse_step", 1),
                mlp_only_layers=list(src.get("mlp_only_layers") or []))


def _mixtral_fields(src: dict) -> dict:
    """Mixtral as a mixture of experts in Qwen3-MoE's terms: every layer sparse, experts of width
    `intermediate_size`, top-k weights renormalised."""
    return dict(num_experts=src["num_local_experts"], num_experts_per_tok=src.get("num_experts_per_tok", 2),
                moe_intermediate_size=src["intermediate_size"], norm_topk_prob=True)


def _orthros_name(kind: str, name: str) -> str:
    """A source tensor's name in the Orthros checkpoint."""
    if kind == "mixtral" and ".block_sparse_moe." in name:
        for a, b in MIXTRAL_NAMES:
            name = name.replace(a, b)
    return name


def expected_tensors(config: OrthrosConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an Orthros checkpoint of this config holds (name -> shape), read off
    the model itself (built on the meta device, so an 8B costs nothing)."""
    from ..models.model import OrthrosForCausalLM

    with torch.device("meta"):
        model = OrthrosForCausalLM(config)
    out = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


# ---------------------------------------------------------------- sources
def source_tensors(src: Path) -> dict[str, TensorInfo]:
    """name -> TensorInfo over the checkpoint's shards (index.json or a single file)."""
    index = src / "model.safetensors.index.json"
    if index.exists():
        idx = read_json(index, "safetensors index")
        weight_map = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise UserError(f"{index}: no 'weight_map' (tensor name -> shard file)")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (src / f).exists()]
        if missing:
            raise FileNotFoundError(f"{src}: missing shard(s) listed in {index.name}: {', '.join(missing)}")
    else:
        files = sorted(p.name for p in src.glob("*.safetensors"))
        if not files:
            other = sorted(p.name for p in src.iterdir() if p.suffix in WEIGHT_SUFFIXES)
            pickles = [n for n in other if n.endswith(PICKLE_SUFFIXES)]
            if pickles:
                raise UserError(f"{src / pickles[0]}: a pickle-format checkpoint, refused: orthros reads safetensors "
                                f"only and never unpickles a file (that can run arbitrary code)")
            raise FileNotFoundError(f"{src}: no *.safetensors weights" + (f" (found {', '.join(other)}; only "
                                                                           "safetensors is supported)" if other else ""))
        weight_map = None
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        try:
            infos, _ = read_header(src / f)
        except ValueError as e:  # damaged or truncated; the message names the file
            raise UserError(one_line(e)) from None
        for name, info in infos.items():
            if name in tensors:
                raise ValueError(f"{src}: tensor {name!r} appears in both {tensors[name].file.name} and {f}")
            tensors[name] = info
    if weight_map is not None:
        for name, f in weight_map.items():
            if name not in tensors or tensors[name].file.name != f:
                raise ValueError(f"{src}: {index.name} puts {name!r} in {f}, but that shard does not hold it")
    return tensors


@dataclass
class Plan:
    config: OrthrosConfig
    out: list[PlannedTensor]
    sources: dict[str, TensorInfo]  # output name -> where its bytes come from (absent: SO init)
    dropped: list[str]


def plan_conversion(src: Path, window_size: int, scale_offset: bool, dtype: str | None,
                    output_routing: str | None = None, sink_tokens: int = 0) -> Plan:
    """Read config and shard headers, check every tensor; nothing is written."""
    src = Path(src)
    if not src.is_dir():
        raise FileNotFoundError(f"source checkpoint directory {src} does not exist")
    cfg_path = src / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{src} has no config.json (expected a Hugging Face checkpoint directory)")
    src_cfg = read_json(cfg_path, "config file")
    if not isinstance(src_cfg, dict):
        raise UserError(f"{cfg_path}: must hold a JSON object, got {type(src_cfg).__name__}")
    if not isinstance(window_size, int) or window_size < 1:
        raise ValueError(f"--window-size must be an integer >= 1, got {window_size!r}")
    if not isinstance(sink_tokens, int) or isinstance(sink_tokens, bool) or sink_tokens < 0:
        raise ValueError(f"--sink-tokens must be an integer >= 0, got {sink_tokens!r}")
    tensors = source_tensors(src)
    if dtype is None:  # keep fp32 checkpoints fp32, everything else becomes bf16
        dtype = "fp32" if tensors and all(t.dtype == "F32" for t in tensors.values()) else "bf16"
    if dtype not in OUT_DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(OUT_DTYPES)}, got {dtype!r}")
    try:
        config = orthros_config(src_cfg, window_size, scale_offset, dtype, output_routing, sink_tokens)
    except KeyError as e:
        raise UserError(f"{cfg_path}: lacks {e.args[0]!r}") from None
    except (ValueError, TypeError, ZeroDivisionError) as e:  # unsupported or out-of-range values
        raise UserError(f"{cfg_path}: {one_line(e)}") from None
    want = expected_tensors(config)
    dropped = [n for n in tensors if n.endswith(DROPPED) or (config.tie_word_embeddings and n == "lm_head.weight")]
    have = {_orthros_name(src_cfg["model_type"], n): t for n, t in tensors.items() if n not in dropped}
    new = {n for n in want if n.rsplit(".", 1)[-1] in SO_INIT}
    missing = sorted(set(want) - new - set(have))
    if missing:
        raise ValueError(f"{src}: checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. "
                         f"{', '.join(missing[:4])}")
    extra = sorted(set(have) - set(want))
    if extra:
        raise ValueError(f"{src}: checkpoint has {len(extra)} tensor(s) a {src_cfg['model_type']} model of this config "
                         f"does not, e.g. {', '.join(extra[:4])}")
    for name, info in have.items():
        if info.shape != want[name]:
            raise ValueError(f"{src}: shape mismatch for {name}: checkpoint has {list(info.shape)}, "
                             f"config.json implies {list(want[name])}")
        if not info.torch_dtype.is_floating_point:
            raise ValueError(f"{src}: tensor {name} has non-float dtype {info.dtype}")
    out_dtype = OUT_DTYPES[dtype]
    out = [PlannedTensor(n, want[n], out_dtype) for n in sorted(want, key=_natural)]
    return Plan(config, out, {n: have[n] for n in want if n in have}, dropped)


def _natural(name: str):
    """Sort layer 2 before layer 10 so shards hold consecutive layers."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]


# ---------------------------------------------------------------- convert
def convert_checkpoint(src: str | Path, dst: str | Path, window_size: int = 128, scale_offset: bool = True,
                       dtype: str | None = None, max_shard_size: str | int = "5GB",
                       block_bytes: int = BLOCK_BYTES, progress: bool = True,
                       output_routing: str | None = None, sink_tokens: int = 0) -> Path:
    """Convert the Llama 3.x / Qwen3 / Qwen3-MoE / Mixtral checkpoint `src` into an Orthros one at `dst`.

    `src` is a Hugging Face directory, or a GGUF file (or a directory holding one),
    dequantized to fp32 first (`convert.gguf`).

    Args:
        window_size: the base stream's sliding window W.
        sink_tokens: the window also sees each document's first `sink_tokens` tokens (attention
            sinks; they keep much of a converted model's zero-shot quality: docs/conversion.md).
        scale_offset: add the SO vectors (at identity); False = the paper's w/o-SO ablation.
        dtype: "bf16" or "fp32"; None keeps an all-fp32 checkpoint fp32 and makes anything else bf16.
        max_shard_size: output shard size ("5GB", "500MB", bytes).
        block_bytes: at most this many bytes of one tensor are in memory at a time.
        output_routing: a mixture-of-experts model's output-row routing (docs/moe.md); default
            "independent"; an error for a dense model.
    Returns:
        `dst`, holding config.json, generation_config.json, safetensors shards
        (+ index) and the source's tokenizer files.
    """
    from .gguf import gguf_to_hf, is_gguf

    src, dst = Path(src), Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"destination {dst} already exists and is not an empty directory; choose another")
    if is_gguf(src):  # dequantize to a plain fp32 HF checkpoint beside dst first, then convert that
        dst.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.gguf-", dir=dst.parent))
        try:
            hf = gguf_to_hf(src, staging / "hf", dtype="fp32", progress=progress)
            return convert_checkpoint(hf, dst, window_size, scale_offset, dtype, max_shard_size, block_bytes, progress,
                                      output_routing, sink_tokens)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    plan = plan_conversion(src, window_size, scale_offset, dtype, output_routing, sink_tokens)
    shards = plan_shards(plan.out, parse_size(max_shard_size))
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        _write(plan, shards, src, tmp, block_bytes, progress)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary directory
        if dst.exists():
            dst.rmdir()  # empty, checked above
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _write(plan: Plan, shards, src: Path, tmp: Path, block_bytes: int, progress: bool) -> None:
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    total = sum(t.nbytes for t in plan.out)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=not progress)
    weight_map = {}
    for fname, shard in zip(names, shards):
        with ShardWriter(tmp / fname, shard, {"converted_by": "orthros"}) as w:
            for t in shard:
                weight_map[t.name] = fname
                info = plan.sources.get(t.name)
                if info is None:  # a new SO vector at identity
                    w.write(t.name, torch.full(t.shape, SO_INIT[t.name.rsplit(".", 1)[-1]], dtype=t.dtype))
                else:
                    for block in iter_blocks(info, t.dtype, block_bytes):
                        w.write(t.name, block)
                bar.update(t.nbytes)
    bar.close()
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    plan.config.save_pretrained(tmp)
    _carry_files(src, tmp, plan.config)


def _carry_files(src: Path, dst: Path, config: OrthrosConfig) -> None:
    """Tokenizer files, generation config, licence: every top-level file that is not weights or config."""
    for p in sorted(src.iterdir()):
        if not p.is_file() or p.name.startswith(".") or p.name == "config.json":
            continue
        if p.name.endswith(WEIGHT_SUFFIXES) or p.name.endswith(".index.json"):
            continue
        shutil.copy2(p, dst / p.name)
    if not (dst / "generation_config.json").exists():
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(config).save_pretrained(dst)
