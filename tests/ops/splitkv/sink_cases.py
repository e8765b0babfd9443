"""The split-KV kernel with attention sinks against the reference op: several splits, the sink keys in
a split of their own or beside the window, documents and padding, a decode pair (only the base row
windowed), bf16 / fp8 keys on a GPU. Run under TRITON_INTERPRET=1 on CPU (test_sinks.py) or on a GPU.

    TRITON_INTERPRET=1 python -m tests.ops.splitkv.sink_cases
"""

from __future__ import annotations

import sys

import torch

from orthros.ops import naive_attention
from orthros.ops.splitkv.dense import splitkv_attention
from tests.ops.cases import make_case, rel_err


def check(docs, past, T, window, sinks, device, dtype=torch.float32, window_rows=None, splits=None, fp8=False):
    case = make_case("base", T=T, past=past, docs=docs, window=window, seed=past + T + sinks, device=device)
    q, k, v, slot, qdoc, kdoc = (case[n] for n in ("q", "k", "v", "q_slot", "q_doc", "k_doc"))
    slot = slot.expand(q.shape[0], -1)
    r = T if window_rows is None else window_rows
    if fp8:
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    ref = torch.cat([naive_attention(q[:, :r].float(), k[..., :].float(), v.float(), slot[:, :r], qdoc[:, :r], kdoc,
                                     window=window, sinks=sinks),
                     naive_attention(q[:, r:].float(), k.float(), v.float(), slot[:, r:], qdoc[:, r:], kdoc)], 1)
    out = splitkv_attention(q.to(dtype), k if fp8 else k.to(dtype), v if fp8 else v.to(dtype), slot, qdoc, kdoc,
                            window=window, window_rows=window_rows, num_splits=splits, sinks=sinks)
    err = rel_err(out.float(), ref)
    tol = 1e-5 if dtype == torch.float32 and not fp8 else 3e-2
    assert err < tol, (docs, past, T, window, sinks, dtype, window_rows, splits, fp8, err)
    # the sinks are read: without them the windowed rows differ
    plain = splitkv_attention(q.to(dtype), k if fp8 else k.to(dtype), v if fp8 else v.to(dtype), slot, qdoc, kdoc,
                              window=window, window_rows=window_rows, num_splits=splits)
    # (in bf16 / fp8 against the measured error: 4 sinks among 3,000 keys move a row by ~0.15 there)
    effect = rel_err(plain.float(), ref)
    assert effect > (10 * tol if tol < 1e-3 else max(tol, 5 * err)), ("sinks not read", effect, err)


def main(device="cpu"):
    for splits in (1, 3):
        check("dense", 300, 1, 16, 4, device, splits=splits)  # a decode step's base row
        check("dense", 300, 2, 16, 4, device, window_rows=1, splits=splits)  # a decode pair
        check("padded", 300, 2, 16, 3, device, window_rows=1, splits=splits)  # left padding: each row's own start
        check("packed", 300, 3, 24, 2, device, splits=splits)  # several documents a row
    check("dense", 20, 2, 16, 8, device, splits=2)  # the sinks inside the window (nothing twice)
    if device != "cpu":  # the interpreter's bf16 dots are wrong; fp8 keys need a GPU
        check("dense", 3000, 2, 128, 4, device, dtype=torch.bfloat16, window_rows=1)
        check("padded", 3000, 1, 128, 4, device, dtype=torch.bfloat16, fp8=True)
    print("ok")


if __name__ == "__main__":
    main(*sys.argv[1:2])
