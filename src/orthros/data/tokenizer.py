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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_tokenizer(model_dir: str | Path, vocab_size: int | None = None):
    """The tokenizer saved beside a model, else bytes for a 256-token vocabulary.

    A missing or damaged tokenizer is a UserError naming the directory or file."""
    from ..errors import UserError, one_line, read_json

    d = Path(model_dir)
    present = [d / f for f in TOKENIZER_FILES if (d / f).exists()]
    if present:
        for f in present:  # a syntax error named by file and line, not by the tokenizers library's Rust message
            read_json(f, "tokenizer file")
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(d))
        except Exception as e:  # a damaged file: tokenizers / transformers raise all kinds
            raise UserError(f"{present[0]}: cannot load the tokenizer ({one_line(e)})") from e
    if vocab_size == 256:
        return ByteTokenizer()
    raise FileNotFoundError(f"{d}: no tokenizer files ({', '.join(TOKENIZER_FILES)}), and the vocabulary "
                            f"({vocab_size}) is not byte-level (256)")


# ---------------------------------------------------------------- trained BPE
EOS, PAD, IM_START, IM_END = "<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOS, PAD, IM_START, IM_END]
# ChatML: the template saved with every BPE trained here, so SFT on `messages` works out of the box.
CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_bpe(texts, vocab_size: int):
    """A byte-level BPE trained on `texts` (an iterable of str), as an HF fast tokenizer.

    Byte-level: every string encodes (no unknown token). Saved with
    `save_pretrained`, it loads with `AutoTokenizer.from_pretrained`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    floor = 256 + len(SPECIAL_TOKENS)
    if vocab_size < floor:
        raise ValueError(f"data.vocab_size must be >= {floor} for a byte-level BPE, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=[IM_START, IM_END], chat_template=CHATML_TEMPLATE)


def encode(tok, text: str) -> list[int]:
    """Token ids of `text` without special tokens added (BOS/EOS are placed by the caller)."""
    if isinstance(tok, ByteTokenizer):
        return tok.encode(text)
    return tok(text, add_special_tokens=False)["input_ids"]


def encode_batch(tok, texts: list[str]) -> list[list[int]]:
    if isinstance(tok, ByteTokenizer):
        return [tok.encode(t) for t in texts]
    return tok(texts, add_special_tokens=False)["input_ids"]


def vocab_size_of(tok) -> int:
    return tok.vocab_size if isinstance(tok, ByteTokenizer) else len(tok)
