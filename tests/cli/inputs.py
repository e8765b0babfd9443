"""The bad inputs a user could plausibly hand `orthros`, built once in one directory tree.

Every damaged model is a copy of a good tiny one with one thing wrong, so a
test that fails names exactly what the loader missed. `EVIL` files are
pickles that create the directory `UNPICKLED` when unpickled: if it ever
appears, a pickle was opened.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from orthros import OrthrosConfig, OrthrosForCausalLM

MARKER = "UNPICKLED"


class _Evil:
    """Unpickling this runs os.mkdir(marker): a stand-in for arbitrary code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def evil_pickle(path: Path, root: Path) -> None:
    path.write_bytes(pickle.dumps(_Evil(root / MARKER)))


def tree_digest(root: Path) -> dict[str, str]:
    """relative path -> content hash ('dir' for a directory): any change anywhere shows."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _variant(src: Path, dst: Path, config_edit=None, config_text: str | None = None) -> Path:
    shutil.copytree(src, dst)
    if config_edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if config_text is not None:
        (dst / "config.json").write_text(config_text)
    return dst


def _truncate(path: Path, keep: float = 0.5) -> None:
    with open(path, "r+b") as f:
        f.truncate(int(path.stat().st_size * keep))


def _set(**kv):
    return lambda c: c.update(kv)


def _drop(key):
    return lambda c: c.pop(key)


def build_models(w: Path, tok) -> None:
    """Orthros model directories: good ones, and one damage each."""
    torch.manual_seed(0)
    byte = w / "byte"  # byte-level: needs no tokenizer files
    OrthrosForCausalLM(OrthrosConfig.from_name("tiny", max_position_embeddings=64)).save_pretrained(byte)
    OrthrosForCausalLM(OrthrosConfig.from_name("tiny", vocab_size=320, max_position_embeddings=64)).save_pretrained(
        w / "vocab320")  # a teacher with another vocabulary
    bpe = w / "bpe"
    OrthrosForCausalLM(OrthrosConfig.from_name("tiny", vocab_size=len(tok))).save_pretrained(bpe)
    tok.save_pretrained(bpe)
    shutil.copytree(bpe, w / "notok", ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    _variant(bpe, w / "badtok")
    tok.save_pretrained(_variant(byte, w / "bigtok"))  # a 320-token tokenizer beside a 256-token model
    (w / "badtok/tokenizer.json").write_text('{"version": "1.0", "model": ')

    weights = byte / "model.safetensors"
    _truncate(_variant(byte, w / "trunc") / "model.safetensors")
    (_variant(byte, w / "hdr") / "model.safetensors").write_bytes(weights.read_bytes()[:40])
    with open(_variant(byte, w / "trailing") / "model.safetensors", "ab") as f:
        f.write(b"\0" * 16)
    (_variant(byte, w / "zero") / "model.safetensors").write_bytes(b"")
    sd = load_file(str(weights))
    sd["model.embed_tokens.weight"][3, 5] = float("nan")
    save_file(sd, str(_variant(byte, w / "nan") / "model.safetensors"), metadata={"format": "pt"})
    for name, file in (("pickle_bin", "pytorch_model.bin"), ("pickle_pt", "model.pt")):
        d = _variant(byte, w / name)
        (d / "model.safetensors").unlink()
        evil_pickle(d / file, w)
    (_variant(byte, w / "noweights") / "model.safetensors").unlink()

    sharded = w / "sharded"
    OrthrosForCausalLM.from_pretrained(str(byte)).save_pretrained(sharded, max_shard_size="100KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    (_variant(sharded, w / "shard_missing") / shards[-1].name).unlink()
    (_variant(sharded, w / "index_bad") / "model.safetensors.index.json").write_text("{not json")

    _variant(byte, w / "cfg_json", config_text='{"model_type": "orthros", "hidden_size": 64,')
    _variant(byte, w / "cfg_list", config_text="[1, 2]")
    _variant(byte, w / "cfg_neg", _set(hidden_size=-64))
    _variant(byte, w / "cfg_window0", _set(window_size=0))
    _variant(byte, w / "cfg_heads", lambda c: (c.pop("head_dim"), c.update(num_attention_heads=5)))
    _variant(byte, w / "cfg_kv", _set(num_key_value_heads=3))
    _variant(byte, w / "cfg_llama", _set(model_type="llama"))
    _variant(byte, w / "cfg_layers", _set(num_hidden_layers=1))  # weights of 2 layers, config of 1
    _variant(byte, w / "cfg_vocab", _set(vocab_size=300))


def build_sources(w: Path, tok) -> None:
    """Hugging Face Llama checkpoints for `orthros convert`: a good one, and one damage each."""
    from orthros.convert.tiny import make_tiny_checkpoint

    llama = w / "llama"
    make_tiny_checkpoint(llama, "llama", tokenizer=tok)
    shards = sorted(llama.glob("model-*.safetensors"))
    _truncate(_variant(llama, w / "llama_trunc") / shards[-1].name)
    (_variant(llama, w / "llama_missing_shard") / shards[0].name).unlink()
    d = _variant(llama, w / "llama_pickle")
    for f in [*d.glob("*.safetensors"), d / "model.safetensors.index.json"]:
        f.unlink()
    evil_pickle(d / "pytorch_model.bin", w)
    _variant(llama, w / "llama_cfg_json", config_text='{"model_type": "llama"')
    _variant(llama, w / "llama_cfg_neg", _set(hidden_size=-64))
    _variant(llama, w / "llama_cfg_heads0", _set(num_attention_heads=0))
    _variant(llama, w / "llama_cfg_heads", lambda c: (c.pop("head_dim"), c.update(num_attention_heads=5)))
    _variant(llama, w / "llama_cfg_novocab", _drop("vocab_size"))
    _variant(llama, w / "llama_gpt2", _set(model_type="gpt2", architectures=["GPT2LMHeadModel"]))
    shutil.copytree(llama, w / "llama_notok", ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))


def build_runs(w: Path) -> None:
    """Training inputs: a previous run's out_dir, checkpoints that must not resume, configs."""
    prev = w / "run_prev"
    (prev / "checkpoints" / "step_00000002").mkdir(parents=True)
    (prev / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n')
    for name in ("config.json", "model.safetensors"):
        shutil.copy(w / "byte" / name, prev / "checkpoints" / "step_00000002" / name)
    pk = w / "run_pickle" / "checkpoints" / "step_00000002"  # an older version's pickle training state
    shutil.copytree(w / "byte", pk)
    evil_pickle(pk / "train_state.pt", w)
    bad = w / "ckpt_bad_state"
    shutil.copytree(w / "byte", bad)
    (bad / "train_state.json").write_text('{"step": 2, "optimizer": ')
    save_file({"t0": torch.zeros(3)}, str(bad / "train_state.safetensors"))
    (w / "bad.yaml").write_text("train:\n  steps: [1, 2\nmodel: {name: tiny}\n")
    (w / "badvals.yaml").write_text("train:\n  steps: 0\n")
    (w / "unknown.yaml").write_text("train:\n  stepz: 10\n")


def build_corpora(w: Path) -> None:
    (w / "binary.txt").write_bytes(bytes(range(256)) * 8)  # 0x80.. is not UTF-8
    (w / "nul.txt").write_bytes(b"def f():\n    return 1\n\0\0\0\0" * 50)
    (w / "empty.txt").write_text("")
    (w / "blank.txt").write_text("  \n\n\t\n")
    (w / "latin1.jsonl").write_bytes('{"text": "caf\xe9"}\n'.encode("latin-1"))
    (w / "empty.jsonl").write_text("\n\n")
    (w / "nodata").mkdir()
    (w / "nodata" / "weights.bin").write_bytes(b"\1\2\3")


def build_misc(w: Path) -> None:
    (w / "occupied").mkdir()
    (w / "occupied" / "keep.txt").write_text("someone's work\n")
    (w / "afile").write_text("a file, not a directory\n")
    (w / "bench_bad.json").write_text('{"rows": [')
    (w / "bench_wrong.json").write_text('{"hello": "world"}')
    (w / "bench_decode.json").write_text(json.dumps({"rows": [], "env": {"date": "d"},
                                                     "command": "orthros bench decode --model tiny"}))
    (w / "cwd").mkdir()  # the commands run here: default output paths (runs/, benchmarks/results/) land inside the tree


def build_world(w: Path) -> Path:
    from orthros.convert.tiny import tiny_tokenizer

    tok = tiny_tokenizer(vocab_size=320, corpus_bytes=30_000)
    build_models(w, tok)
    build_sources(w, tok)
    build_runs(w)
    build_corpora(w)
    build_misc(w)
    return w
