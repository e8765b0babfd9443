"""Tiny random Llama 3 / Qwen3 checkpoints, made here (no hub), to try conversion on.

    python -m orthros.convert.tiny runs/tiny-llama --arch llama
    orthros convert runs/tiny-llama runs/tiny-llama-orthros --window-size 8

Each is a real transformers checkpoint directory: `config.json`, sharded
safetensors and a byte-level BPE tokenizer trained on a slice of the
embedded corpus, so `AutoTokenizer` / `AutoModelForCausalLM` load it. Llama
gets "llama3" RoPE scaling and untied embeddings; Qwen3 q/k norms and tied
embeddings, like the real families; Qwen3-MoE is Qwen3 with 4 experts, 2 per token; Mixtral
the same routing with Llama's untied embeddings.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

ARCHS = ("llama", "qwen3", "qwen3_moe", "mixtral")


def tiny_tokenizer(vocab_size: int = 320, corpus_bytes: int = 200_000):
    from ..data.stdlib import stdlib_text
    from ..data.tokenizer import train_bpe

    return train_bpe([stdlib_text("train", max_bytes=corpus_bytes)], vocab_size)


def tiny_hf_config(arch: str, vocab_size: int, **overrides):
    """A transformers LlamaConfig / Qwen3Config / Qwen3MoeConfig / MixtralConfig of CI size."""
    from transformers import LlamaConfig, MixtralConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                  initializer_range=0.2)
    if arch == "llama":
        common.update(rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                        original_max_position_embeddings=64))
        return LlamaConfig(**{**common, **overrides})
    if arch == "qwen3":
        common.update(rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
        return Qwen3Config(**{**common, **overrides})
    if arch == "qwen3_moe":  # 4 experts, 2 per token
        common.update(rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
        return Qwen3MoeConfig(**{**common, **overrides})
    if arch == "mixtral":  # 4 experts of width 32, 2 per token
        common.update(rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, intermediate_size=32,
                      num_local_experts=4, num_experts_per_tok=2)
        return MixtralConfig(**{**common, **overrides})
    raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")


def make_tiny_checkpoint(path: str | Path, arch: str = "llama", seed: int = 0, max_shard_size: str = "60KB",
                         dtype: torch.dtype = torch.float32, tokenizer=None, **overrides):
    """Write a random tiny `arch` checkpoint (sharded) and a tokenizer to `path`; return the HF model."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    tok = tokenizer if tokenizer is not None else tiny_tokenizer()
    cfg = tiny_hf_config(arch, len(tok), bos_token_id=None, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    model.save_pretrained(path, max_shard_size=max_shard_size)
    tok.save_pretrained(path)
    return model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m orthros.convert.tiny", description=__doc__.strip().splitlines()[0])
    p.add_argument("out", help="output directory")
    p.add_argument("--arch", choices=ARCHS, default="llama")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    make_tiny_checkpoint(args.out, args.arch, args.seed)
    print(f"wrote a tiny random {args.arch} checkpoint to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
