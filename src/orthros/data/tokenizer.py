"""Tokenizers: a model directory's own (HF `tokenizer.json`), or raw UTF-8 bytes.

Byte-level models (vocab 256) need no tokenizer file, which is what the
one-minute demo trains.
"""

from __future__ import annotations

from pathlib import Path


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255."""

    vocab_size = 256
    eos_token_id = None
    pad_token_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def load_tokenizer(model_dir: str | Path, vocab_size: int | None = None):
    """The tokenizer saved beside a model, else bytes for a 256-token vocabulary."""
    d = Path(model_dir)
    if (d / "tokenizer.json").exists() or (d / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(d))
    if vocab_size == 256:
        return ByteTokenizer()
    raise FileNotFoundError(f"no tokenizer files in {d} and the vocabulary ({vocab_size}) is not byte-level")
