"""Packing documents and SFT examples into fixed-length rows.

Rows follow transformers' flattening convention, which the model reads
directly: `position_ids` restart at 0 where a document starts, and no token
attends across that boundary. A row is [T] of

    ids    token ids
    pos    position ids (0 = a document starts here)
    target the token is a next-token target (labels = ids there, -100 elsewhere)
    valid  a real token (False = padding at the end of an SFT row)

The model makes output positions only where the *next* token is a target,
so SFT rows pay the output stream only on response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

IGNORE_INDEX = -100


@dataclass
class PackedRows:
    ids: np.ndarray  # [R, T] int32
    pos: np.ndarray  # [R, T] int32
    target: np.ndarray  # [R, T] bool
    valid: np.ndarray | None = None  # [R, T] bool; None = no padding

    def __len__(self) -> int:
        return self.ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.ids.shape[1]

    def arrays(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """`batch` as int64 numpy arrays (no torch call: safe in a loader thread), with the
        output positions as `logits_to_keep` (see `output_index`)."""
        ids = self.ids[rows].astype(np.int64)
        target = self.target[rows]
        out = {"input_ids": ids, "position_ids": self.pos[rows].astype(np.int64),
               "labels": np.where(target, ids, IGNORE_INDEX)}
        if self.valid is not None:
            out["attention_mask"] = self.valid[rows].astype(np.int64)
        nxt = np.zeros_like(target)
        nxt[:, :-1] = target[:, 1:]
        out["logits_to_keep"] = _output_index(nxt)
        return out

    def batch(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        """Model inputs for `rows` ([B] indices): input_ids, position_ids, labels (+ attention_mask)."""
        out = {k: torch.from_numpy(v) for k, v in self.arrays(rows).items()}
        del out["logits_to_keep"]
        return out


def count_targets(labels: torch.Tensor) -> int:
    """Loss terms of a [B, T] labels batch: positions t whose next label counts."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def pack_documents(docs: list[list[int]], seq_len: int, eos_id: int | None = None) -> PackedRows:
    """Concatenate documents (each followed by `eos_id` if given) and cut into rows of `seq_len`.

    A document's first token is not a target (it would be predicted from the
    previous document). The tail that does not fill a row is dropped.
    """
    lens = np.array([len(d) + (eos_id is not None) for d in docs], dtype=np.int64)
    total = int(lens.sum())
    R = total // seq_len
    stream = np.empty(total, dtype=np.int32)
    starts = np.zeros(total, dtype=bool)
    offsets = np.concatenate([[0], np.cumsum(lens)[:-1]])
    for d, o in zip(docs, offsets):
        stream[o : o + len(d)] = d
    if eos_id is not None:
        stream[offsets + lens - 1] = eos_id
    starts[offsets[lens > 0]] = True
    n = R * seq_len
    stream, starts = stream[:n], starts[:n]
    idx = np.arange(n)
    restart = starts | (idx % seq_len == 0)  # a row's first token starts a (piece of a) document
    pos = idx - np.maximum.accumulate(np.where(restart, idx, 0))
    return PackedRows(ids=stream.reshape(R, seq_len), pos=pos.astype(np.int32).reshape(R, seq_len),
                      target=~starts.reshape(R, seq_len))


def pack_examples(examples: list[tuple[list[int], list[bool]]], seq_len: int, pad_id: int = 0
                  ) -> tuple[PackedRows, int]:
    """Pack SFT examples, in order, into rows of `seq_len` padded at the end.

    Examples longer than a row are cut to `seq_len`; examples without a
    target token are dropped. Returns (rows, number of examples cut).
    """
    rows: list[list[tuple[list[int], list[bool]]]] = [[]]
    used, cut = 0, 0
    for ids, mask in examples:
        if len(ids) > seq_len:
            ids, mask, cut = ids[:seq_len], mask[:seq_len], cut + 1
        if not any(mask[1:]):
            continue
        if used + len(ids) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append((ids, mask))
        used += len(ids)
    rows = [r for r in rows if r]
    R = len(rows)
    ids_a = np.full((R, seq_len), pad_id, dtype=np.int32)
    pos_a = np.zeros((R, seq_len), dtype=np.int32)
    tgt_a = np.zeros((R, seq_len), dtype=bool)
    val_a = np.zeros((R, seq_len), dtype=bool)
    for r, row in enumerate(rows):
        o = 0
        for ids, mask in row:
            n = len(ids)
            ids_a[r, o : o + n] = ids
            pos_a[r, o : o + n] = np.arange(n)
            tgt_a[r, o + 1 : o + n] = mask[1:]  # a document's first token is never a target
            val_a[r, o : o + n] = True
            o += n
    return PackedRows(ids=ids_a, pos=pos_a, target=tgt_a, valid=val_a), cut


def output_index(labels: torch.Tensor, multiple: int = 128) -> torch.Tensor:
    """Output positions of a batch as a [B, N] index padded with -1 (`logits_to_keep`).

    Position t is an output when labels[t + 1] counts. N is rounded up to a
    multiple of `multiple` (at most T) so that compiled attention kernels see
    few distinct shapes: pre-training rows give N = T every step, SFT rows a
    handful of sizes.
    """
    nxt = np.zeros(tuple(labels.shape), dtype=bool)
    nxt[:, :-1] = (labels[:, 1:] != IGNORE_INDEX).cpu().numpy()
    return torch.from_numpy(_output_index(nxt, multiple))


def _output_index(nxt: np.ndarray, multiple: int = 128) -> np.ndarray:
    B, T = nxt.shape
    counts = nxt.sum(1, keepdims=True)
    n = int(counts.max()) if B else 0
    n = min(T, -(-n // multiple) * multiple)
    order = np.argsort(~nxt, axis=1, kind="stable")[:, :n]
    return np.where(np.arange(n)[None] < counts, order, -1).astype(np.int64)
