"""Screen candidate low-bit formats end to end on the copy probe with fake quantization.

    python benchmarks/kv_quant_screen.py --only base lloyd-v   # see FORMATS below
    python benchmarks/kv_quant_screen.py --list

A `ShadowCache` is a `LowBitStaticCache` whose slots below the bound are read
from an fp32 shadow: each key group and each value is rotated, passed through
a candidate's quantize-then-dequantize function, rotated back and kept. The
slot logic (sinks, bound, ring, chunking) is the real cache's, so a candidate
that is also implemented in `ops/lowbit.py` gives the same numbers as the real
cache (checked for `base` against `kv_quant_variants.py`'s `int2`). Bits per
element are counted by hand per candidate (levels + side information).

The probe and samples are `kv_quant_variants.py`'s (8 per gap, gaps 512 and 2048).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from orthros.models.lowbit_cache import LowBitStaticCache
from orthros.ops.lowbit import rotate

# ------------------------------------------------------------------ formats
# A key format: f(x [B, n, g, Hkv, D] groups of g slots (rotated, fp32), valid [B, n, g, 1, 1]) -> same shape.
# A value format: f(x [B, T, Hkv, D] (rotated, fp32)) -> same shape.

LLOYD2 = torch.tensor([-1.5104, -0.4528, 0.4528, 1.5104])  # Lloyd-Max levels of N(0, 1), 4 levels
LLOYD3 = torch.tensor([-2.1519, -1.3439, -0.7560, -0.2451, 0.2451, 0.7560, 1.3439, 2.1519])


def _masked_minmax(x, dim, valid):
    if valid is None:
        return x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    lo = x.masked_fill(~valid, float("inf")).amin(dim, keepdim=True)
    hi = x.masked_fill(~valid, float("-inf")).amax(dim, keepdim=True)
    bad = lo > hi
    return lo.masked_fill(bad, 0.0), hi.masked_fill(bad, 0.0)


def uniform(x, bits, dim, valid=None, lo=None, hi=None, side=torch.float16):
    """Round to nearest on 2^bits uniform levels over [lo, hi] (min / max by default)."""
    if lo is None:
        lo, hi = _masked_minmax(x, dim, valid)
    L = 2**bits - 1
    z = lo.to(side).float()
    s = ((hi - lo) / L).to(side).float()
    n = torch.where(s > 0, (x - z) / s.clamp_min(1e-30), torch.zeros_like(x)).round().clamp(0, L)
    return n * s + z


def codebook(x, levels, dim, valid=None, center="mean", spread="std"):
    """Nearest of `levels` (for N(0, 1)) scaled by the group's spread around its center."""
    if valid is None:
        valid = torch.ones_like(x, dtype=torch.bool)
    w = valid.expand_as(x).float()
    cnt = w.sum(dim, keepdim=True).clamp_min(1)
    mu = (x * w).sum(dim, keepdim=True) / cnt
    if spread == "std":
        sd = (((x - mu) ** 2 * w).sum(dim, keepdim=True) / cnt).sqrt()
    mu, sd = mu.half().float(), sd.half().float()
    lv = levels.to(x.device)
    y = (x - mu) / sd.clamp_min(1e-30)
    n = (y[..., None] - lv).abs().argmin(-1)
    return torch.where(sd > 0, lv[n] * sd + mu, mu)


def uniform_mse(x, bits, dim, valid=None, ratios=(1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)):
    """Min / max range shrunk about its centre by the ratio with the least squared error, per group."""
    lo, hi = _masked_minmax(x, dim, valid)
    c, r = (lo + hi) / 2, (hi - lo) / 2
    best, err = None, None
    w = None if valid is None else valid.expand_as(x).float()
    for a in ratios:
        y = uniform(x, bits, dim, valid, c - a * r, c + a * r)
        e = (y - x) ** 2
        e = (e if w is None else e * w).sum(dim, keepdim=True)
        if best is None:
            best, err = y, e
        else:
            take = e < err
            best, err = torch.where(take, y, best), torch.minimum(e, err)
    return best


def sparse_outlier(x, bits, valid):
    """Dense-and-sparse (KVQuant): per channel and key group, the slot furthest from the group's
    mean is kept exact (an fp16 value and a slot index: 22 bits a group) and left out of the range."""
    v = valid.expand_as(x)
    mu = (x * v).sum(2, keepdim=True) / v.sum(2, keepdim=True).clamp_min(1)
    far = ((x - mu).abs() * v).argmax(2, keepdim=True)
    out = torch.zeros_like(v).scatter_(2, far, True) & v
    y = uniform(x, bits, 2, v & ~out)
    return torch.where(out, x.half().float(), y)


def key_fmt(kind, bits=2, **kw):
    def f(x, valid):
        if kind == "sparse":
            return sparse_outlier(x, bits, valid)
        if kind == "uniform":
            return uniform(x, bits, 2, valid, **kw)
        if kind == "mse":
            return uniform_mse(x, bits, 2, valid)
        if kind == "lloyd":
            return codebook(x, LLOYD2 if bits == 2 else LLOYD3, 2, valid)
        raise ValueError(kind)
    return f


def value_fmt(kind, bits=2, group=64):
    def f(x):
        g = x.unflatten(-1, (-1, min(group, x.shape[-1])))
        if kind == "uniform":
            y = uniform(g, bits, -1)
        elif kind == "mse":
            y = uniform_mse(g, bits, -1)
        elif kind == "lloyd":
            y = codebook(g, LLOYD2 if bits == 2 else LLOYD3, -1)
        else:
            raise ValueError(kind)
        return y.flatten(-2)
    return f


# name -> (key format, value format, cache kwargs, bits / element (K, V) at D = 64)
FORMATS = {
    "base": (key_fmt("uniform"), value_fmt("uniform"), {}, (2.5, 2.5)),
    "base-s64r256": (key_fmt("uniform"), value_fmt("uniform"), dict(sinks=64, recent=256), (2.5, 2.5)),
    "base-v32": (key_fmt("uniform"), value_fmt("uniform", group=32), {}, (2.5, 3.0)),
    "sparse-k": (key_fmt("sparse"), value_fmt("uniform"), {}, (2.5 + 22 / 64, 2.5)),
    "lloyd-v": (key_fmt("uniform"), value_fmt("lloyd"), {}, (2.5, 2.5)),
    "lloyd-k": (key_fmt("lloyd"), value_fmt("uniform"), {}, (2.5, 2.5)),
    "lloyd-kv": (key_fmt("lloyd"), value_fmt("lloyd"), {}, (2.5, 2.5)),
    "mse-v": (key_fmt("uniform"), value_fmt("mse"), {}, (2.5, 2.5)),
    "mse-k": (key_fmt("mse"), value_fmt("uniform"), {}, (2.5, 2.5)),
    "k4v2": (key_fmt("uniform", 4), value_fmt("uniform"), {}, (4.5, 2.5)),
    "k3v2": (key_fmt("uniform", 3), value_fmt("uniform"), {}, (3.5, 2.5)),
    "k2": (key_fmt("uniform"), None, {}, (2.5, 16)),
    "k3": (key_fmt("uniform", 3), None, {}, (3.5, 16)),
    "kexact-v2": (lambda x, v: x, value_fmt("uniform"), {}, (16, 2.5)),
    "kexact-vlloyd": (lambda x, v: x, value_fmt("lloyd"), {}, (16, 2.5)),
}


class ShadowCache(LowBitStaticCache):
    """LowBitStaticCache whose packed part is read from fake-quantized fp32 shadows (see the docstring).
    kf(layer) / vf(layer): that layer's key / value format, or None to keep it exact."""

    def __init__(self, config, B, T, device, dtype, kf, vf, **kw):
        super().__init__(config, B, T, device, dtype, "int2", **kw)
        self.kfmt, self.vfmt = kf, vf
        C = self.kq[0].shape[1]
        Hkv, D = config.num_key_value_heads, config.head_dim
        self.kf = [torch.zeros(B, C, Hkv, D) for _ in range(self.num_layers)]
        self.vf = [torch.zeros(B, C, Hkv, D) for _ in range(self.num_layers)]

    def _write_key_groups(self, layer_idx, src, first):
        assert not torch.is_tensor(first), "prefill only"
        g, n = self.key_group, src.shape[1]
        B, _, Hkv, D = src.shape
        slots = first + torch.arange(n)
        valid = (slots >= self.sinks)[None].expand(B, -1).reshape(B, n // g, g, 1, 1)
        f = self.kfmt(layer_idx)
        x = rotate(src).reshape(B, n // g, g, Hkv, D)
        y = x if f is None else f(x, valid)
        self.kf[layer_idx][:, first: first + n] = rotate(y.reshape(B, n, Hkv, D))

    def update(self, layer_idx, k, v):
        a = self._start
        out = super().update(layer_idx, k, v)
        f = self.vfmt(layer_idx)
        hv = v.to(self.hi).float()
        self.vf[layer_idx][:, a: a + v.shape[1]] = hv if f is None else rotate(f(rotate(hv)))
        return out

    def dense(self, layer_idx, length, bound):
        NS, R = self.sinks, self.ring
        j = torch.arange(length)
        old = (j < bound)[None, :, None, None]
        k = torch.where(old, self.kf[layer_idx][:, :length], self.rk[layer_idx][:, j % R].float())
        v = torch.where(old, self.vf[layer_idx][:, :length], self.rv[layer_idx][:, j % R].float())
        if NS:
            sink = (j < NS)[None, :, None, None]
            i = j.clamp_max(NS - 1)
            k = torch.where(sink, self.sk[layer_idx][:, i].float(), k)
            v = torch.where(sink, self.sv[layer_idx][:, i].float(), v)
        return k, v


def per_layer(f, layers=None):
    """A format for the given layers (all by default), exact elsewhere (and everywhere if f is None)."""
    return lambda i: f if layers is None or i in layers else None


def run(model, stream, name, kf, vf, kw, gaps, samples, rows=()):
    """{gap: copy loss} and {row: mean token loss} (rows: (name, ids) held-out rows)."""
    from orthros.eval.longrange import cached_losses, copy_probe

    def new(model, B, T):
        p = next(model.parameters())
        return ShadowCache(model.config, B, T, p.device, p.dtype, kf, vf, **kw)
    copy = {g: r["second"] for g, r in copy_probe(model, stream, gaps, samples, batch_size=4,
                                                  new_cache=new)["by_gap"].items()} if gaps else {}
    with torch.no_grad():
        ppl = {n: cached_losses(model, r[None], torch.arange(r.numel() - 1), None, new_cache=new).mean().item()
               for n, r in rows}
    return copy, ppl


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", default=None)
    p.add_argument("--list", action="store_true")
    p.add_argument("--gaps", nargs="*", type=int, default=[512, 2048])
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--ppl", action="store_true", help="also the loss of the 2048-token code0 / prose0 rows")
    p.add_argument("--layers", nargs="*", type=int, default=None, help="quantize only these layers (sensitivity)")
    p.add_argument("--key4-layers", nargs="*", type=int, default=None,
                   help="these layers' keys in int4 (min / max, the cache's format), the others' as the format says")
    p.add_argument("--out", default="benchmarks/results/kv_quant/kv_quant_screen.jsonl", help="records are appended")
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(FORMATS))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from kv_quant_quality import copy_stream, heldout_rows, load_model

    model, tok, _ = load_model(None, "adapters/smollm2-135m-w128-lora")
    stream = copy_stream(tok)
    rows = heldout_rows(tok, 2048, 2) if args.ppl else ()
    lay = None if args.layers is None else set(args.layers)
    for name in args.only or list(FORMATS):
        kf, vf, kw, (kb, vb) = FORMATS[name]
        t = time.time()
        kfl = per_layer(kf, lay)
        if args.key4_layers:
            k4, kfl0 = key_fmt("uniform", 4), kfl
            kfl = lambda i: k4 if i in args.key4_layers else kfl0(i)
            kb += 2 * len(args.key4_layers) / model.config.num_hidden_layers
        copy, ppl = run(model, stream, name, kfl, per_layer(vf, lay), kw, args.gaps, args.samples, rows)
        rec = dict(command="python " + " ".join(map(shlex.quote, ["benchmarks/kv_quant_screen.py", *sys.argv[1:]])),
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), name=name, layers=args.layers, key4_layers=args.key4_layers, bits=(kb + vb) / 2, copy=copy, ppl=ppl,
                   seconds=round(time.time() - t))
        print(json.dumps(rec), flush=True)
        with open(args.out, "a") as fh:
            fh.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
