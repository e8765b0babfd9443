"""Which layers an int2 cache should keep in int4 keys: a one-forward calibration.

On SmolLM2-135M converted at W = 128, int2 keys in layer 18 alone cost +43% /
+55% copy-probe loss (gaps 512 / 2048), layer 20 +7% / +4%, any other layer
under +2% (docs/long_context.md): the retrieval that copying needs runs through
a few layers, and an error in their keys moves the attention off the copied
token. So int2 keeps those layers' keys in int4 (`config.kv_int4_key_layers`,
read by `LowBitStaticCache`) and everything else in int2.

The ranking needs no end-to-end probe: one forward of a row in which a segment
repeats after a gap records every layer's output-stream queries and K/V; each
layer's output-stream attention is then recomputed with the keys older than
the window read back from int2 (the cache's format: rotated, per channel over
key groups, sinks exact), and the layers are ranked by the relative error of
the outputs at the repeated segment, where attention has to find the first copy.
On that model this ranks layers 18 and 20 first on every held-out row tried
(two prose, two code), the two the copy probe singles out; then 23 and 7.

    from orthros.models.lowbit_calibrate import int4_key_layers, repeat_row
    model.config.kv_int4_key_layers = int4_key_layers(model, repeat_row(ids))  # saved with the config
"""

from __future__ import annotations

import torch

from ..ops.lowbit import dequantize_keys, quantize_keys, rotate
from .cache import OrthrosCache


def repeat_row(ids: torch.Tensor, seg: int = 200, gap: int = 1000, prefix: int = 64) -> torch.Tensor:
    """1-D ids -> prefix | segment | gap | the segment again (every part a different span of ids)."""
    need = prefix + seg + gap
    if ids.numel() < need:
        raise ValueError(f"repeat_row needs {need} ids, got {ids.numel()}")
    s = ids[prefix: prefix + seg]
    return torch.cat([ids[:prefix], s, ids[prefix + seg: need], s])


def _output_queries(model, out) -> list[torch.Tensor]:
    """Each layer's output-stream queries [T, H, D] (fp32) of a forward `out` over one row whose every
    position is an output (its hidden states entering each layer: norm, q_proj, SO, q-norm, RoPE)."""
    inner = model.model
    h = out.hidden_states
    pos = torch.arange(h[0].shape[1], device=h[0].device)[None]
    rope = inner.rotary(pos, h[0].dtype)
    qs = []
    for i, block in enumerate(inner.layers):
        attn = block.self_attn
        q = attn._queries(attn.q_proj(block.input_layernorm(h[i])), "out", *rope)
        qs.append(q[0].float())
    return qs


def _int2_keys(k: torch.Tensor, group: int, sinks: int) -> torch.Tensor:
    """k [S, Hkv, D] -> what an int2 cache reads back (fp32; trailing slots of a partial group kept)."""
    S = k.shape[0] // group * group
    valid = (torch.arange(S) >= sinks)[None]
    pk, s, z = quantize_keys(rotate(k[None, :S]), 2, group, valid)
    return torch.cat([rotate(dequantize_keys(pk, s, z, 2, group))[0], k[S:]])


def _output_error(q, k, v, kq, window: int, sinks: int, rows: slice) -> float:
    """Relative error of causal attention outputs at `rows` when key j < t - window + 1 (j >= sinks)
    is read from kq instead of k."""
    T, H, D = q.shape
    G = H // k.shape[1]
    qr = q[rows].transpose(0, 1) * D**-0.5  # [H, n, D]
    kh, kqh, vh = (x.repeat_interleave(G, 1).transpose(0, 1) for x in (k, kq, v))
    t = torch.arange(T)[rows][:, None]
    j = torch.arange(T)[None]
    old = (j <= t - window) & (j >= sinks)
    ref = (qr @ kh.transpose(1, 2)).masked_fill(j > t, float("-inf")).softmax(-1) @ vh
    s = torch.where(old, qr @ kqh.transpose(1, 2), qr @ kh.transpose(1, 2))
    out = s.masked_fill(j > t, float("-inf")).softmax(-1) @ vh
    return ((out - ref).norm() / ref.norm()).item()


@torch.no_grad()
def key_errors(model, row: torch.Tensor, last: int = 200, key_group: int = 64, sinks: int = 4) -> list[float]:
    """Per layer: the relative output-stream attention error of int2 keys at the last `last`
    positions of `row` (1-D ids; a `repeat_row`)."""
    n = model.config.num_hidden_layers
    rec = OrthrosCache(n)
    out = model(row[None].to(next(model.parameters()).device), past_key_values=rec, use_cache=True,
                output_hidden_states=True)
    queries = _output_queries(model, out)
    rows = slice(row.numel() - last, None)
    out = []
    for i in range(n):
        k, v = (x[0].float().cpu().to(torch.bfloat16).float() for x in rec.layer_kv(i))  # as a bf16 cache holds them
        kq = _int2_keys(k, key_group, sinks)
        out.append(_output_error(queries[i].cpu(), k, v, kq, model.config.window_size, sinks, rows))
    return out


def int4_key_layers(model, row: torch.Tensor, n: int | None = None, **kw) -> list[int]:
    """The `n` layers whose int2 keys cost the most (`key_errors`), sorted; n defaults to an eighth of
    the layers, rounded up (4 of SmolLM2's 30: 2.63 bits per element instead of 2.5)."""
    e = key_errors(model, row, **kw)
    n = -(-len(e) // 8) if n is None else n
    return sorted(sorted(range(len(e)), key=lambda i: -e[i])[:n])
