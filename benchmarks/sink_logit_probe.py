"""Can a per-head sink logit stand in for the sink token? A CPU measurement beside sink_probe.py.

sink_probe.py shows that a base stream which also sees its first token recovers most of the
zero-shot Orthros gap. A cheaper form for kernels is a learned per-head "sink logit" s (as
gpt-oss' sliding-window layers have): a windowed row's softmax gets one more term exp(s) in its
denominator, i.e. its output is scaled by sigmoid(lse_window - s), which any attention kernel
that returns its log-sum-exp supports without a new mask. It can be calibrated for a converted
model, zero-shot: s_{l,h} is the mean over a calibration row's queries t >= W of the log of the
attention mass the source model puts outside the window, log(exp(lse_full) - exp(lse_window)).

    PYTHONPATH=src .venv/bin/python benchmarks/sink_logit_probe.py      # after sink_probe.py (its rows)

Calibration uses the copy-probe text (held-out prose and code beyond the measured rows), never the
measured rows. Patches are local to this script: every attention layer runs the reference op.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import orthros.ops as ops
from orthros.experiments.cpt import load_arm
from orthros.experiments.cpt_data import heldout_sets

sys.path.insert(0, str(Path(__file__).parent))
from sink_probe import converted, heldout_rows, set_backend  # noqa: E402

_NAIVE = ops.naive_attention


@torch.no_grad()
def calibrate(source, rows: torch.Tensor, W: int) -> torch.Tensor:
    """[L, H]: per layer and head, the mean over queries t >= W of log(mass outside the window W)."""
    sums, count = {}, {}
    calls = [0]

    def spy(q, k, v, q_slot, q_doc, k_doc, window=None, scale=None, **kw):
        assert window is None and not kw  # the source attends fully
        layer = calls[0] % source.config.num_hidden_layers
        calls[0] += 1
        o, full = _NAIVE(q, k, v, q_slot, q_doc, k_doc, window=None, scale=scale, return_lse=True)
        _, win = _NAIVE(q, k, v, q_slot, q_doc, k_doc, window=W, scale=scale, return_lse=True)
        out = full + torch.log(-torch.expm1((win - full).clamp_max(-1e-6)))  # [B, M, H]
        out = out[:, W:].double()
        sums[layer] = sums.get(layer, 0) + out.sum((0, 1))
        count[layer] = count.get(layer, 0) + out.shape[0] * out.shape[1]
        return o

    ops.naive_attention = spy
    try:
        for r in rows:
            source(r[None], use_cache=False)
    finally:
        ops.naive_attention = _NAIVE
    return torch.stack([sums[i] / count[i] for i in sorted(sums)]).float()


@torch.no_grad()
def losses_with_sink_logits(model, rows: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    windowed = [0]

    def sunk(q, k, v, q_slot, q_doc, k_doc, window=None, scale=None, **kw):
        if window is None or s is None or kw:
            return _NAIVE(q, k, v, q_slot, q_doc, k_doc, window=window, scale=scale, **kw)
        layer = windowed[0] % (model.config.num_hidden_layers - 1)  # the last layer runs no base queries
        windowed[0] += 1
        o, lse = _NAIVE(q, k, v, q_slot, q_doc, k_doc, window=window, scale=scale, return_lse=True)
        # only rows whose window dropped keys (slot >= W): below, the window holds every key
        gate = torch.sigmoid(lse - s[layer].to(lse))
        gate = torch.where((q_slot >= window)[..., None], gate, torch.ones_like(gate))
        return (o.float() * gate[..., None]).to(o.dtype)

    ops.naive_attention = sunk
    try:
        out = []
        for r in rows:
            logits = model(r[None, :-1], use_cache=False).logits[0].float()
            out.append(F.cross_entropy(logits, r[1:], reduction="none"))
    finally:
        ops.naive_attention = _NAIVE
    return torch.stack(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--source-len", type=int, default=8192)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--calibration-rows", type=int, default=2)
    ap.add_argument("--work", default="/tmp/sink")
    ap.add_argument("--out", default="/tmp/sink/sink_logit_probe.json")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.time()
    work = Path(args.work)
    conv, tok = converted(work, args.window)
    data = heldout_rows(tok, work, args.rows, args.seq_len, args.source_len)
    extra = heldout_sets(tok, args.source_len, args.rows + args.calibration_rows, work / "cache")
    calib = torch.from_numpy(np.concatenate([extra["prose"][args.rows:], extra["code"][args.rows:]])
                             [:, : args.seq_len].astype(np.int64))
    source = load_arm(conv, "source", args.window, "cpu").eval()
    orth = load_arm(conv, "orthros-0shot", args.window, "cpu").eval()
    set_backend(source, "naive")
    set_backend(orth, "naive")
    s = calibrate(source, calib, args.window)
    print(f"calibrated sink logits on {len(calib)} rows: [L, H] = {tuple(s.shape)}, mean {s.mean():.2f}, "
          f"range {s.min():.2f} .. {s.max():.2f}  ({time.time() - t0:.0f}s)", flush=True)
    results = {}
    for dom, rows in data.items():
        t1 = time.time()
        losses = losses_with_sink_logits(orth, rows, s)
        nll = losses.mean().item()
        results[dom] = {"ppl": math.exp(nll), "nll": nll,
                        "loss_by_pos": {f"{a}-{b}": losses[:, a:b].mean().item()
                                        for a, b in ((0, 128), (128, 512), (512, 1024), (1024, 2048))
                                        if a < losses.shape[1]}}
        print(f"orthros+sinklogit {dom:5s} ppl {results[dom]['ppl']:.3f} "
              f"{json.dumps({k: round(v, 3) for k, v in results[dom]['loss_by_pos'].items()})} "
              f"({time.time() - t1:.0f}s)", flush=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "sink_logits": s.tolist(), "results": results,
                                          "seconds": time.time() - t0}, indent=1))


if __name__ == "__main__":
    main()
