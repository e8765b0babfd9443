"""GGUF checkpoints (llama.cpp's format) -> a plain Hugging Face directory.

    gguf_to_hf("SmolLM2-135M-Instruct.Q4_1.gguf", "runs/smollm2")   # config, safetensors, tokenizer
    orthros convert SmolLM2-135M-Instruct.Q4_1.gguf runs/smollm2-orthros   # straight to Orthros

transformers reads GGUF through the `gguf` package (weights dequantized to
the dtype asked for, the tokenizer and chat template too), for the
architectures its reader supports; Orthros converts the Llama and Qwen3
ones. The header is checked here first — magic, version, architecture, and
that every tensor's data lies inside the file — so a damaged or truncated
file is one clear error, not a stack trace from deep inside a reader.
The output is written to a temporary directory beside DST and renamed at
the end: a failure leaves nothing behind.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

ORTHROS_ARCHS = ("llama", "qwen3")  # GGUF `general.architecture` values Orthros converts
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GGUF_MAGIC = b"GGUF"


@dataclass
class GGUFInfo:
    path: Path
    architecture: str
    name: str
    tensors: int
    context_length: int | None


def find_gguf(src: str | Path) -> Path:
    """`src` itself if it is a .gguf file, else the one .gguf file in directory `src`."""
    p = Path(src)
    if p.is_file():
        return p
    if p.is_dir():
        found = sorted(p.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
        if not found:
            raise FileNotFoundError(f"{p}: no .gguf file in this directory")
        raise ValueError(f"{p}: holds several .gguf files ({', '.join(f.name for f in found)}); name one")
    raise FileNotFoundError(f"{p}: no such file or directory")


def is_gguf(src: str | Path) -> bool:
    """Whether `src` is (meant as) a GGUF file — named *.gguf or starting with the GGUF
    magic — or a directory with .gguf files and no config.json."""
    p = Path(src)
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return True
        with open(p, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    return p.is_dir() and not (p / "config.json").exists() and any(p.glob("*.gguf"))


def read_gguf_info(path: str | Path) -> GGUFInfo:
    """Check a GGUF file's header and tensor table; ValueError naming the file and the problem."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        import gguf
    except ImportError:
        raise ValueError("reading GGUF files needs the `gguf` package: pip install gguf") from None
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError / struct / numpy errors on a damaged header
        raise ValueError(f"{path}: damaged or truncated GGUF file ({type(e).__name__}: {e})") from None
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ValueError(f"{path}: truncated GGUF file (tensor {t.name!r} ends at byte "
                             f"{t.data_offset + t.n_bytes:,}, the file has {size:,})")

    def field(name, default=None):
        f = reader.fields.get(name)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch is None:
        raise ValueError(f"{path}: damaged GGUF file (no general.architecture)")
    return GGUFInfo(path, arch, field("general.name", path.stem), len(reader.tensors),
                    field(f"{arch}.context_length"))


def check_supported(info: GGUFInfo) -> None:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if info.architecture not in ORTHROS_ARCHS:
        raise ValueError(f"{info.path}: unsupported GGUF architecture {info.architecture!r}; "
                         f"Orthros converts {', '.join(ORTHROS_ARCHS)}")
    if info.architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{info.path}: this transformers version cannot read {info.architecture!r} GGUF files")


def gguf_to_hf(src: str | Path, dst: str | Path, dtype: str = "fp32", progress: bool = True) -> Path:
    """Write `dst`: a plain Hugging Face checkpoint (config.json, model.safetensors,
    tokenizer files with the chat template, generation_config.json) of a GGUF model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    path = find_gguf(src)
    info = read_gguf_info(path)
    check_supported(info)
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"{dst}: already exists and is not empty")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    verbosity = hf_logging.get_verbosity()
    try:
        if not progress:
            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()
        try:
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=DTYPES[dtype])
        except (ValueError, KeyError, OSError, RuntimeError) as e:
            raise ValueError(f"{path}: transformers could not read this GGUF file ({type(e).__name__}: {e})") from None
        _fix_special_tokens(tok, model)
        tok.clean_up_tokenization_spaces = False  # a byte-level BPE: cleaning would strip spaces before punctuation
        _save_plain(model, tok, tmp)
        (tmp / "orthros_source.json").write_text(json.dumps(
            {"gguf": path.name, "architecture": info.architecture, "name": info.name, "dtype": dtype}, indent=2))
        if dst.exists():
            dst.rmdir()
        tmp.rename(dst)
    finally:
        hf_logging.set_verbosity(verbosity)
        if not progress:
            hf_logging.enable_progress_bar()
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def _fix_special_tokens(tok, model) -> None:
    """transformers' GGUF tokenizer can take the wrong end-of-sequence token (SmolLM2's
    reads as <|im_start|>); the model's generation config has the file's own ids."""
    gc = model.generation_config
    for name in ("eos", "bos", "pad"):
        want = getattr(gc, f"{name}_token_id", None)
        if isinstance(want, list):
            want = want[0] if want else None
        if want is not None and getattr(tok, f"{name}_token_id") != want:
            setattr(tok, f"{name}_token", tok.convert_ids_to_tokens(int(want)))


def _save_plain(model, tok, out: Path) -> None:
    """save_pretrained refuses a model loaded from GGUF (it carries the GGUF
    quantization config), so write the dequantized weights as a fresh model."""
    from safetensors.torch import save_file

    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.architectures = [type(model).__name__]
    cfg.dtype = next(model.parameters()).dtype
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(cfg, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(str(out))
