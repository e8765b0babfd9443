"""Which low-bit layout for the KV cache beyond the window? A one-layer error study on the real model.

    python benchmarks/kv_quant_layouts.py [--rows 2] [--seq-len 2048] [--out benchmarks/results/kv_quant/kv_quant_layouts.json]
    python benchmarks/kv_quant_layouts.py --table-only   # the table of --out (--docs PAGE: spliced there)

One forward of SmolLM2-135M-Instruct converted to Orthros (W = 128) with the
shipped light-CPT adapter records, per layer, the output stream's queries
and the layer's K/V (every position an output position). Each candidate
layout then fake-quantizes K and/or V (quantize, dequantize) and the
output-stream attention is recomputed with every key older than the
window (and not one of the first `--sink` tokens) read from the quantized
copy, exactly what a decode step at each position would see. Reported: the
relative RMS error of the attention outputs against bf16 K/V (mean and
worst over the 30 layers) and the bits per element stored (values +
fp16 scale and zero per group).

Candidates (group-wise asymmetric, round to nearest, min/max range):

    token-g{N}      per token, groups of N channels
    token-had       per token over the whole head after a Hadamard rotation
                    (queries rotated alike: q.k = (qH).(kH); values: o = (sum p vH) H^T)
    channel-g{N}    per channel, groups of N consecutive tokens (KIVI's keys), after RoPE
    channel-had     per channel over groups of 64 tokens after a Hadamard rotation of the
                    channels (the cache's keys: `ops.lowbit.rotate`)
    channel-pre     per channel before RoPE (KVQuant's keys), groups of 64 tokens

K and V are studied one at a time (the other exact), then the chosen pairs together.
This is a proxy (each layer sees exact inputs); the end-to-end numbers of the chosen
layout are benchmarks/kv_quant_quality.py's.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from orthros.layers.rope import apply_rope
from orthros.models.cache import OrthrosCache
from orthros.ops import attention
from orthros.ops.lowbit import rotation_matrix


def fake_quant(x: torch.Tensor, bits: int, axis: str, group: int) -> torch.Tensor:
    """x [S, Hkv, D] -> quantized and dequantized; axis "token": groups of `group` channels
    of one token; "channel": groups of `group` tokens of one channel (aligned at slot 0)."""
    S, Hkv, D = x.shape
    levels = 2**bits - 1
    if axis == "token":
        g = x.reshape(S, Hkv, D // group, group)
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    else:
        pad = (-S) % group
        g = torch.cat([x, x[-1:].expand(pad, -1, -1)]) if pad else x
        g = g.reshape(-1, group, Hkv, D)
        lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
    scale = ((hi - lo) / levels).half().float().clamp_min(1e-8)
    lo = lo.half().float()
    q = ((g - lo) / scale).round().clamp(0, levels)
    out = q * scale + lo
    return out.reshape(-1, Hkv, D)[:S] if axis == "channel" else out.reshape(S, Hkv, D)


def quantize_layout(x: torch.Tensor, bits: int, layout: str, rope=None) -> torch.Tensor:
    """x [S, Hkv, D] (fp32) -> what the layout would give back, in the same (unrotated) space."""
    D = x.shape[-1]
    if layout == "exact":
        return x
    if layout.startswith("token-g"):
        return fake_quant(x, bits, "token", int(layout[7:]))
    if layout == "token-had":
        H = rotation_matrix(D)
        return fake_quant(x @ H, bits, "token", D) @ H.T
    if layout == "channel-had":
        H = rotation_matrix(D)
        return fake_quant(x @ H, bits, "channel", 64) @ H.T
    if layout.startswith("channel-g"):
        return fake_quant(x, bits, "channel", int(layout[9:]))
    if layout == "channel-pre":
        cos, sin = rope
        pre = apply_rope(x[None], cos, -sin)[0]  # RoPE is a rotation: -sin undoes it
        return apply_rope(fake_quant(pre, bits, "channel", 64)[None], cos, sin)[0]
    raise ValueError(layout)


def bits_per_element(layout: str, bits: int, D: int) -> float:
    if layout == "exact":
        return 16.0
    group = {"token-had": D, "channel-pre": 64, "channel-had": 64}.get(layout) or int(layout.split("-g")[1])
    return bits + 32 / group


class Recorder(OrthrosCache):
    """An OrthrosCache that keeps each layer's output-stream queries for the study."""

    def __init__(self, n):
        super().__init__(n)
        self.q = [None] * n

    def attend(self, layer_idx, q, k, v, q_slot, q_doc, k_doc, window=None, backend="auto", dense_start=None,
               scale=None, window_rows=None):
        if window is None:
            self.q[layer_idx] = q[0].detach().float()
        return attention(q, k, v, q_slot, q_doc, k_doc, window=window, scale=scale, backend=backend,
                         dense_start=dense_start)


def mixed_attention(q, k, v, kq, vq, window: int, sink: int, block: int = 256):
    """q [T, H, D], k/v exact and kq/vq quantized [T, Hkv, D]: causal attention where query t reads
    key j from the quantized copy iff sink <= j <= t - window. -> [T, H, D] (fp32)."""
    T, H, D = q.shape
    G = H // k.shape[1]
    rep = lambda x: x.repeat_interleave(G, 1).transpose(0, 1)  # [H, T, D]
    k, v, kq, vq = rep(k), rep(v), rep(kq), rep(vq)
    out = []
    for a in range(0, T, block):
        b = min(T, a + block)
        qb = q[a:b].transpose(0, 1) * D**-0.5  # [H, n, D]
        t, j = torch.arange(a, b)[:, None], torch.arange(b)[None, :]
        old = (j <= t - window) & (j >= sink)
        s = torch.where(old, qb @ kq[:, :b].transpose(1, 2), qb @ k[:, :b].transpose(1, 2))
        s = s.masked_fill(j > t, float("-inf")).softmax(-1)
        o = (s * ~old) @ v[:, :b] + (s * old) @ vq[:, :b]
        out.append(o.transpose(0, 1))
    return torch.cat(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="converted Orthros directory (default: the test cache's W=128 copy)")
    p.add_argument("--adapter", default="adapters/smollm2-135m-w128-lora")
    p.add_argument("--rows", type=int, default=2, help="held-out rows (half code, half prose)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--out", default="benchmarks/results/kv_quant/kv_quant_layouts.json")
    p.add_argument("--docs", default=None, metavar="PAGE",
                   help="also splice the table into PAGE between its marks (docs/long_context.md holds them)")
    p.add_argument("--table-only", action="store_true", help="print (and splice) the table of --out and stop")
    args = p.parse_args()
    if args.table_only:
        publish(json.loads(Path(args.out).read_text()), args.docs)
        return
    from kv_quant_quality import heldout_rows, load_model  # noqa: E402 - sibling benchmark script

    model, tok, where = load_model(args.model, args.adapter)
    W = model.config.window_size
    rows = heldout_rows(tok, args.seq_len, args.rows)
    D = model.config.head_dim
    k_layouts = ["token-g64", "token-g32", "token-had", "channel-g32", "channel-g64", "channel-g128", "channel-pre",
                 "channel-had"]
    v_layouts = ["token-g64", "token-g32", "token-had", "channel-g64"]
    errs: dict[str, list[float]] = {}
    t0 = time.time()
    for name, ids in rows:
        rec = Recorder(model.config.num_hidden_layers)
        with torch.no_grad():
            model(ids[None], past_key_values=rec, use_cache=True)  # every position an output position
        cos, sin = model.model.rotary(torch.arange(ids.numel())[None], torch.float32)
        for layer in range(model.config.num_hidden_layers):
            q = rec.q[layer]
            k, v = (x[0].float().to(torch.bfloat16).float() for x in rec.layer_kv(layer))  # the bf16 cache: reference
            ref = mixed_attention(q, k, v, k, v, W, args.sink)
            cases = [(f"K {lay} int{b}", quantize_layout(k, b, lay, (cos, sin)), v) for b in (4, 2) for lay in k_layouts]
            cases += [(f"V {lay} int{b}", k, quantize_layout(v, b, lay)) for b in (4, 2) for lay in v_layouts]
            for b in (4, 2):
                for kl, vl in (("channel-g64", "token-g64"), ("token-had", "token-had"), ("channel-g128", "token-g64"),
                               ("channel-g32", "token-g32"), ("token-g64", "token-g64"), ("channel-had", "token-had")):
                    cases.append((f"KV {kl}/{vl} int{b}", quantize_layout(k, b, kl, (cos, sin)), quantize_layout(v, b, vl)))
            for case, kq, vq in cases:
                o = mixed_attention(q, k, v, kq, vq, W, args.sink)
                e = ((o - ref).norm() / ref.norm()).item()
                errs.setdefault(case, []).append(e)
        print(f"{name}: {time.time() - t0:.0f} s", flush=True)
    table = []
    for case, es in errs.items():
        what, lay, b = case.split(" ")
        bits = int(b[3:])
        if what == "KV":
            kl, vl = lay.split("/")
            bpe = (bits_per_element(kl, bits, D) + bits_per_element(vl, bits, D)) / 2
        else:
            bpe = bits_per_element(lay, bits, D)
        table.append(dict(case=case, mean_rel_err=sum(es) / len(es), worst_rel_err=max(es), bits_per_element=bpe))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res = dict(model=where, adapter=args.adapter, rows=[n for n, _ in rows], seq_len=args.seq_len, window=W,
               sink=args.sink, layers=model.config.num_hidden_layers, results=table,
               command="python " + " ".join(map(shlex.quote, ["benchmarks/kv_quant_layouts.py", *sys.argv[1:]])),
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    out.write_text(json.dumps(res, indent=2) + "\n")
    publish(res, args.docs)


def render(res: dict) -> str:
    """The Markdown table of a results dict."""
    out = [f"Command: `{res['command']}`  "] if "command" in res else []
    out += [(f"Date: {res['date']}; " if "date" in res else "") +
            f"output-stream attention error, keys older than W={res['window']} quantized (sinks {res['sink']}), "
            f"{len(res['rows'])} rows x {res['seq_len']} tokens of {res['model']}, every layer; the other of K/V "
            f"exact unless 'KV'.", "", "| case | bits/element | mean rel. error | worst layer |", "| --- | --- | --- | --- |"]
    for r in res["results"]:
        out.append(f"| {r['case']} | {r['bits_per_element']:.2f} | {r['mean_rel_err']:.4f} | {r['worst_rel_err']:.4f} |")
    return "\n".join(out) + "\n"


def publish(res: dict, docs: str | None) -> None:
    from orthros.bench.common import splice_marks

    text = render(res)
    print(text)
    if splice_marks(docs, text.rstrip("\n"), ("<!-- kv-layouts-table:begin -->", "<!-- kv-layouts-table:end -->")):
        print(f"table written into {docs}")

if __name__ == "__main__":
    main()
