"""Tokenizers (bytes, a BPE trained here, HF-loadable) and data sources with their errors."""

import json

import pytest

from orthros.data.sources import detect_format, expand_paths, read_documents, read_examples
from orthros.data.stdlib import stdlib_files
from orthros.data.tokenizer import ByteTokenizer, encode, encode_batch, train_bpe, vocab_size_of


def test_bpe_trains_saves_and_loads_with_auto_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    texts = read_documents(["stdlib"], max_bytes=200_000)
    tok = train_bpe(texts, 600)
    tok.save_pretrained(tmp_path)
    back = AutoTokenizer.from_pretrained(str(tmp_path))
    s = "def f(x):\n    return x ** 2  # ünïcode ✓ 😀\n"
    assert back.decode(encode(back, s)) == s  # byte-level: every string round-trips
    assert encode(back, s) == encode(tok, s) and len(encode(back, s)) < len(s.encode())
    assert vocab_size_of(back) == 600 and back.eos_token == "<|endoftext|>" and back.pad_token_id is not None
    chat = back.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert encode_batch(back, ["a b", "c"]) == [encode(back, "a b"), encode(back, "c")]
    with pytest.raises(ValueError, match="data.vocab_size must be >= 260"):
        train_bpe(texts, 100)


def test_bytes():
    t = ByteTokenizer()
    assert encode(t, "é") == [195, 169] and vocab_size_of(t) == 256


def test_sources(tmp_path):
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("beta")
    (tmp_path / "sub" / "c.bin").write_bytes(b"\0")
    (tmp_path / "d.jsonl").write_text('{"text": "gamma"}\n\n{"text": "delta"}\n')
    assert [p.name for p in expand_paths([str(tmp_path)])] == ["a.txt", "d.jsonl", "b.md"]
    assert read_documents([str(tmp_path)]) == ["alpha", "gamma", "delta", "beta"]
    assert detect_format([str(tmp_path / "d.jsonl")]) == "text"
    with pytest.raises(ValueError, match="d.jsonl:1: no 'body' field"):
        read_documents([str(tmp_path / "d.jsonl")], text_field="body")
    sft = tmp_path / "s.jsonl"
    sft.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    assert detect_format([str(sft)]) == "sft"
    with pytest.raises(ValueError, match="no assistant turn"):
        read_examples([str(sft)])


def test_stdlib_split_is_disjoint_and_capped():
    train, held = set(stdlib_files("train")), set(stdlib_files("heldout"))
    assert train and held and not train & held
    docs = read_documents(["stdlib"], max_bytes=10_000)
    assert 10_000 <= sum(map(len, docs)) < 10_000 + max(map(len, docs)) + 1
