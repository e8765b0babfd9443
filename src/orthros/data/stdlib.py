"""The embedded default corpus: Python's standard-library sources on this machine.

No download: every machine with Python has them. Files are split into train
and held-out sets by a stable hash of their relative path, so the split is
the same on every machine with the same Python version.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(split: str = "train", heldout_fraction: float = 0.05) -> list[Path]:
    """Sorted `.py` files of the standard library (tests and site-packages excluded)."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    root = stdlib_dir()
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if rel.startswith(("site-packages/", "test/", "idlelib/idle_test/")) or "/tests/" in rel:
            continue
        h = int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        is_heldout = h < heldout_fraction
        if split == "all" or (split == "heldout") == is_heldout:
            files.append(p)
    if not files:
        raise FileNotFoundError(f"no Python sources found under {root}")
    return files


def stdlib_text(split: str = "train", max_bytes: int | None = None) -> str:
    """Concatenated sources (documents separated by a blank line), up to `max_bytes`."""
    parts, total = [], 0
    for p in stdlib_files(split):
        try:
            t = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(t)
        total += len(t)
        if max_bytes is not None and total >= max_bytes:
            break
    text = "\n\n".join(parts)
    return text if max_bytes is None else text[:max_bytes]
