"""Shared inputs and checks for the op tests (imported by tests and by the interpreter subprocess).

A case is one attention call in one of the phases:
    base  — base stream: queries at slots past..past+T-1 over keys 0..past+T-1, a window.
    out   — output stream, many queries: a sorted subset of positions per row
            (all of them, or SFT-like random ones padded with invalid queries).
    few   — output stream, 1-2 queries per row over a long cache.
Docs: "dense" (one document, no padding), "packed" (several documents per
row) or "padded" (left padding in the second row, packed in the first).
"""

from __future__ import annotations

import torch

from orthros.ops import naive_attention
from orthros.ops.masks import NO_QUERY_DOC, PAD_DOC, visible


def make_docs(B, S, docs, g):
    k_doc = torch.zeros(B, S, dtype=torch.long)
    if docs == "dense":
        return k_doc
    for b in range(B):
        cuts = sorted(torch.randint(1, max(2, S), (3,), generator=g).tolist())
        for c in cuts:
            k_doc[b, c:] += 1
    if docs == "padded" and B > 1:
        npad = S // 3
        k_doc[1, :npad] = PAD_DOC
    return k_doc


def make_case(phase, B=2, T=63, H=4, Hkv=2, D=64, window=16, past=0, docs="packed", dtype=torch.float32,
              device="cpu", seed=0, subset=False):
    """-> dict(q, k, v, q_slot, q_doc, k_doc, window, dense_start)."""
    g = torch.Generator().manual_seed(seed)
    S = past + T
    k_doc = make_docs(B, S, docs, g)
    dense_start = None
    if phase == "base":
        q_slot = (past + torch.arange(T))[None]
        q_doc = k_doc[:, past:]
        M = T
        dense_start = past if docs == "dense" else None
    elif phase == "out":
        window = None
        if subset:  # SFT: a random subset of positions per row, padded with invalid queries
            keep = torch.rand(B, S, generator=g) < 0.4
            keep[0, -1] = True
            M = int(keep.sum(1).max())
            q_slot = torch.zeros(B, M, dtype=torch.long)
            q_doc = torch.full((B, M), NO_QUERY_DOC, dtype=torch.long)
            for b in range(B):
                idx = keep[b].nonzero().flatten()
                q_slot[b, : len(idx)] = idx
                q_doc[b, : len(idx)] = k_doc[b, idx]
        else:  # pre-training: every position
            M = S
            q_slot = torch.arange(S)[None]
            q_doc = k_doc
            dense_start = 0 if docs == "dense" else None
    elif phase == "few":
        M = 1 if T % 2 else 2
        if docs == "dense":
            q_slot = torch.arange(S - M, S)[None]
            dense_start = S - M
        else:
            q_slot = torch.stack([torch.arange(S - M, S)] * B)
            q_slot[-1, 0] = S // 2  # one query in the middle of the cache
        q_doc = k_doc.gather(1, q_slot.expand(B, M))
        window = None if seed % 2 == 0 else window
    else:
        raise ValueError(phase)
    q = torch.randn(B, M, H, D, generator=g)
    k = torch.randn(B, S, Hkv, D, generator=g)
    v = torch.randn(B, S, Hkv, D, generator=g)
    to = lambda t: t.to(device=device, dtype=dtype)
    return dict(q=to(q), k=to(k), v=to(v), q_slot=q_slot.to(device), q_doc=q_doc.to(device),
                k_doc=k_doc.to(device), window=window, dense_start=dense_start)


def lowp_attention(q, k, v, q_slot, q_doc, k_doc, window=None, scale=None):
    """The same computation in plain PyTorch at the inputs' dtype (flash-attention's tolerance yardstick)."""
    B, M, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2).repeat_interleave(H // Hkv, 1)
    vt = v.transpose(1, 2).repeat_interleave(H // Hkv, 1)
    mask = visible(q_slot[:, :, None], torch.arange(S, device=q.device)[None, None], q_doc[:, :, None],
                   k_doc[:, None, :], window)[:, None]
    s = (qt @ kt.transpose(-1, -2)) * scale
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0).to(q.dtype)
    return (p @ vt).transpose(1, 2)


def rel_err(a, b) -> float:
    """fla-style relative RMS error; NaN never passes."""
    a, b = a.double(), b.double()
    err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    assert err == err, "NaN"
    return err


def grads(fn, case, do, need_grad=True):
    q, k, v = (case[n].detach().clone().requires_grad_(need_grad) for n in ("q", "k", "v"))
    args = (case["q_slot"], case["q_doc"], case["k_doc"])
    if not need_grad:
        with torch.no_grad():
            return fn(q, k, v, *args, window=case["window"]), None
    out = fn(q, k, v, *args, window=case["window"])
    g = torch.autograd.grad(out, (q, k, v), do, allow_unused=True, materialize_grads=True)
    return out.detach(), g


def _err(a, r):
    """Relative RMS error; where the reference is (near) zero, e.g. dq or dk of a query that
    sees one key (exactly 0), the error is taken against an RMS of 0.1 (inputs and upstream
    gradient are unit normal, so real gradients are O(0.1-1)) instead of dividing by ~0:
    FlexAttention's bf16 dk there is ~1e-7, far below bf16 resolution."""
    a, r = a.double(), r.double()
    den = max(r.norm().item(), 0.1 * r.numel() ** 0.5)
    err = (a - r).norm().item() / den
    assert err == err, "NaN"
    return err


def check(fn, case, backward=True, factor=2.0, floor=1e-5):
    """fn's output (and dq, dk, dv) vs the fp32 naive op, within `factor` x the low-precision PyTorch error."""
    dtype = case["q"].dtype
    torch.manual_seed(1)
    do = torch.randn_like(case["q"])
    f32 = {**case, **{n: case[n].float() for n in ("q", "k", "v")}}
    ref, gref = grads(naive_attention, f32, do.float(), backward)
    low, glow = grads(lowp_attention, case, do, backward)
    out, gout = grads(fn, case, do, backward)
    assert out.dtype == dtype and out.shape == case["q"].shape
    errs = {"o": (_err(out, ref), _err(low, ref))}
    if backward:
        for name, a, b, r in zip(("dq", "dk", "dv"), gout, glow, gref):
            errs[name] = (_err(a, r), _err(b, r))
    for name, (e, e_low) in errs.items():
        assert e <= factor * e_low + floor, f"{name}: error {e:.3g} vs low-precision PyTorch {e_low:.3g}"
    # Rows that see nothing are exactly 0 (no NaN, no garbage).
    empty = ref.abs().amax(-1) == 0
    assert torch.all(out[empty] == 0)
    return errs
