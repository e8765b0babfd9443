"""Which tokens does the source need its far context for? The LongCE weights a run would train with
(`experiments/long_weights.py`: min(p_full / p_window, cap), the converted source judging), on rows
of a CPT run's training data and held-out sets, summarised by position and drawn.

    python benchmarks/long_weights_probe.py --source runs/smollm2-orthros-w512-s4 --prep /tmp/prep \
        --window 1024 --sinks 4 --cap 5 --rows 3 --out benchmarks/results/long-weights

`--prep` is a CPT run's folder (its train_rows.npy, retrieval_rows.npy, retrieval_mask.npy and
heldout_*.npy); the first --rows rows of each set are judged. Per set and position band (inside the
window, then past it): the mean weight, the share of tokens weighing more than 1.5 and 3, the share at
the cap, and the share weighing less than 1 (the far context misleads the source there). With the
weights, the mean (weighted) loss of a band grows by the ratio of weighted to plain means: the loss's
tilt to the far context. The set `retrieval` (the retrieval samples, whose kinds take turns row by
row) is judged on its targets only and split into the samples' answers and the text after them; it
also says what share of the rows' loss weight the answers hold at `--answer-weight`, with the weights
multiplied onto the answers and without. Writes <tag>.json, <tag>.md and <tag>.png under --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch


def bands(window: int, T: int) -> list[tuple[int, int]]:
    edges = [1, window] + [e for e in (2048, 4096) if e > window] + [T]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def summarise(w: np.ndarray, window: int, cap: float) -> list[dict]:
    out = []
    for a, b in bands(window, w.shape[1]):
        x = w[:, a:b].astype(np.float32).ravel()
        x = x[~np.isnan(x)]  # (a retrieval set: its targets only)
        if not x.size:
            continue
        out.append(dict(band=f"{a}-{b}", tokens=int(x.size), mean=float(x.mean()), over_1_5=float((x > 1.5).mean()),
                        over_3=float((x > 3).mean()), at_cap=float((x >= cap * 0.999).mean()),
                        under_1=float((x < 0.999).mean())))
    return out


def answers_summary(w: np.ndarray, mask: np.ndarray, answer_weight: float, cap: float) -> dict:
    """The weights on a retrieval set's targets, answers apart from the text after them, and the
    answers' share of the rows' loss weight (each answer weighs `answer_weight` text tokens) without
    the weights, with them on every target, and with them on the text only."""
    from orthros.data.retrieval import answer_mask

    ans = answer_mask(mask)
    text = mask & ~ans
    # w[:, t] weighs predicting token t (labels-indexed, as the mask is)
    wa, wt = w[ans].astype(np.float64), w[text].astype(np.float64)
    A = answer_weight
    return dict(answers=int(ans.sum()), text=int(text.sum()),
                answer_mean=float(wa.mean()), answer_at_cap=float((wa >= cap * 0.999).mean()),
                text_mean=float(wt.mean()), text_at_cap=float((wt >= cap * 0.999).mean()),
                share_plain=float(A * ans.sum() / (A * ans.sum() + text.sum())),
                share_weighted=float(A * wa.sum() / (A * wa.sum() + wt.sum())),
                share_text_only=float(A * ans.sum() / (A * ans.sum() + wt.sum())))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", required=True, help="the converted source (an Orthros directory)")
    p.add_argument("--prep", required=True, help="a CPT run's folder: train_rows.npy, heldout_*.npy")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--cap", type=float, default=5.0)
    p.add_argument("--rows", type=int, default=3, help="rows judged per set")
    p.add_argument("--sets", nargs="+", default=["train", "code", "prose"],
                   help="train, retrieval, or held-out sets (code, prose, docs, novel)")
    p.add_argument("--answer-weight", type=float, default=32.0, help="a retrieval answer's weight (answer_weight)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="benchmarks/results/long-weights")
    p.add_argument("--tag", default="weights")
    a = p.parse_args(argv)
    from orthros.experiments.long_weights import long_context_weights
    from orthros.train.distill import load_teacher

    torch.set_num_threads(max(1, torch.get_num_threads()))
    full = load_teacher(a.source, a.device, torch.float32, attention="full")
    windowed = load_teacher(a.source, a.device, torch.float32, attention="swa", window_size=a.window,
                            sink_tokens=a.sinks)
    prep, res = Path(a.prep), dict(source=a.source, window=a.window, sinks=a.sinks, cap=a.cap, rows=a.rows,
                                   device=a.device, sets={})
    curves = {}
    files = {"train": "train_rows.npy", "retrieval": "retrieval_rows.npy"}
    for name in a.sets:
        f = prep / files.get(name, f"heldout_{name}.npy")
        if not f.is_file():
            raise SystemExit(f"{f}: not found (--prep is a CPT run's folder; sets: train, retrieval, "
                             "or a held-out set it holds)")
        rows = np.load(f)[: a.rows]
        t0 = time.time()
        w = long_context_weights(full, windowed, rows, a.cap, a.device)
        shown = w.astype(np.float32)  # a retrieval set: its targets only (the rest NaN)
        if name == "retrieval":
            mask = np.load(prep / "retrieval_mask.npy")[: a.rows]
            shown = np.where(mask, shown, np.nan)
        res["sets"][name] = dict(seconds=time.time() - t0, bands=summarise(shown, a.window, a.cap),
                                 mean=float(w[:, 1:].astype(np.float32).mean()))
        if name == "retrieval":
            res["sets"][name]["answers"] = answers_summary(w, mask, a.answer_weight, a.cap)
        curves[name] = shown
        print(name, json.dumps(res["sets"][name]["bands"]), res["sets"][name].get("answers", ""), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.tag}.json").write_text(json.dumps(res, indent=1))
    lines = [f"LongCE weights, min(p_full / p_W, {a.cap:g}), the source judging at W = {a.window} with "
             f"{a.sinks} sinks; {a.rows} rows of 8K per set (`benchmarks/long_weights_probe.py`)", "",
             "| set | positions | mean weight | > 1.5 | > 3 | at the cap | < 1 |", "|---|---|---:|---:|---:|---:|---:|"]
    for name, s in res["sets"].items():
        for b in s["bands"]:
            lines.append(f"| {name} | {b['band']} | {b['mean']:.3f} | {100 * b['over_1_5']:.1f}% | "
                         f"{100 * b['over_3']:.1f}% | {100 * b['at_cap']:.1f}% | {100 * b['under_1']:.1f}% |")
    for name, s in res["sets"].items():
        if "answers" in s:
            r = s["answers"]
            lines += ["", f"{name}: {r['answers']} answer and {r['text']} text targets in {a.rows} rows. Mean weight "
                      f"on the answers {r['answer_mean']:.2f} ({100 * r['answer_at_cap']:.0f}% at the cap), on the "
                      f"text {r['text_mean']:.2f}. The answers' share of the rows' loss weight at x{a.answer_weight:g}: "
                      f"{100 * r['share_plain']:.1f}% without the weights, {100 * r['share_weighted']:.1f}% with "
                      f"them on every target, {100 * r['share_text_only']:.1f}% with them on the text only."]
    (out / f"{a.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    from orthros.bench.common import save_figure, subplots

    fig, (ax0, ax1) = subplots(2, 5.5, 4)
    for i, (name, w) in enumerate(curves.items()):
        T = w.shape[1]
        k = 256  # the mean weight over 256-token steps of position
        ax0.plot(np.arange(0, T, k)[: T // k] + k / 2, np.nanmean(w[:, : T // k * k].reshape(len(w), -1, k), (0, 2)),
                 color=f"C{i}", label=name)
        past = w[:, a.window :].ravel()
        past = np.sort(past[~np.isnan(past)])
        ax1.plot(past, 1 - np.arange(len(past)) / len(past), color=f"C{i}", label=name)
    ax0.axvline(a.window, color="grey", ls=":", label=f"W = {a.window}")
    ax0.set(xlabel="position", ylabel="mean weight", title="the weight by position")
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set(xlabel="weight", ylabel="share of tokens past W with a larger one", title="past the window")
    for ax in (ax0, ax1):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, out / f"{a.tag}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
