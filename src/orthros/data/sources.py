"""Where training text comes from: text files, directories, jsonl, the stdlib corpus.

Pre-training reads *documents* (one string each); SFT reads *examples*
(a prompt/response pair or a chat `messages` list). Every mistake the user
can make here — a missing path, an empty file, a jsonl line without the
expected field — is a ValueError/FileNotFoundError that names the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError
from .stdlib import stdlib_files

STDLIB = "stdlib"
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")


def expand_paths(sources: list[str], suffixes=TEXT_SUFFIXES) -> list[Path]:
    """Files named by `sources` (files, or directories searched recursively for `suffixes`)."""
    files: list[Path] = []
    for s in sources:
        p = Path(s).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"data path {s!r} does not exist")
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in suffixes)
            if not found:
                raise FileNotFoundError(f"data directory {s!r} holds no files ending in {', '.join(suffixes)}")
            files.extend(found)
        else:
            files.append(p)
    return files


def read_text(path: Path) -> str:
    """The UTF-8 text of a data file. A binary file is refused rather than read with
    replacement characters: training on that would be a silent wrong result."""
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); a binary file? "
                        f"(convert text in other encodings to UTF-8 first)") from None
    if "\x00" in text:
        raise UserError(f"{path}: not a text file (it holds NUL bytes)")
    if not text.strip():
        raise ValueError(f"data file {str(path)!r} is empty")
    return text


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(read_text(path).split("\n"), 1):  # not splitlines: JSON strings may hold U+2028
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{n}: each jsonl line must be a JSON object, got {type(obj).__name__}")
        rows.append(obj)
    if not rows:
        raise ValueError(f"data file {str(path)!r} is empty")
    return rows


def is_sft_record(obj: dict) -> bool:
    return "messages" in obj or ("prompt" in obj and ("response" in obj or "completion" in obj))


def detect_format(sources: list[str]) -> str:
    """'sft' when the first jsonl record is a prompt/response or messages example, else 'text'."""
    if sources == [STDLIB]:
        return "text"
    for f in expand_paths(sources):
        if f.suffix == ".jsonl":
            return "sft" if is_sft_record(read_jsonl(f)[0]) else "text"
    return "text"


def read_documents(sources: list[str], split: str = "train", text_field: str = "text",
                   max_bytes: int | None = None) -> list[str]:
    """Documents for pre-training: one per text file, one per jsonl record's `text_field`.

    `"stdlib"` stands for this Python's standard-library sources (`split`
    picks the train or held-out files). Stops after `max_bytes` characters.
    """
    docs, total = [], 0
    for s in sources:
        if s == STDLIB:
            for p in stdlib_files(split):
                try:
                    docs.append(p.read_text(encoding="utf-8"))
                except (UnicodeDecodeError, OSError):
                    continue
                total += len(docs[-1])
                if max_bytes is not None and total >= max_bytes:
                    return docs
            continue
        for f in expand_paths([s]):
            if f.suffix == ".jsonl":
                for n, obj in enumerate(read_jsonl(f), 1):
                    if text_field not in obj:
                        raise ValueError(f"{f}:{n}: no {text_field!r} field (set data.text_field, or use "
                                         f"prompt/response or messages records for SFT)")
                    docs.append(str(obj[text_field]))
                    total += len(docs[-1])
            else:
                docs.append(read_text(f))
                total += len(docs[-1])
            if max_bytes is not None and total >= max_bytes:
                return docs
    docs = [d for d in docs if d]
    if not docs:
        raise ValueError(f"no text found in {sources}")
    return docs


def read_examples(sources: list[str]) -> list[dict]:
    """SFT examples from jsonl files: {prompt, response|completion} or {messages: [{role, content}]}."""
    out = []
    for f in expand_paths(sources, suffixes=(".jsonl",)):
        if f.suffix != ".jsonl":
            raise ValueError(f"SFT data must be .jsonl files, got {str(f)!r}")
        for n, obj in enumerate(read_jsonl(f), 1):
            if not is_sft_record(obj):
                raise ValueError(f"{f}:{n}: an SFT record needs 'prompt' and 'response' (or 'completion'), "
                                 f"or 'messages'; got keys {sorted(obj)}")
            if "messages" in obj:
                msgs = obj["messages"]
                if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                         for m in msgs):
                    raise ValueError(f"{f}:{n}: 'messages' must be a list of {{role, content}} objects")
                if not any(m["role"] == "assistant" for m in msgs):
                    raise ValueError(f"{f}:{n}: 'messages' has no assistant turn to learn from")
            out.append(obj)
    return out
