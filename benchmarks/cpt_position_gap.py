"""Where a converted arm's perplexity gap lies: the held-out loss by position, against a reference arm.

Reads the arm files `orthros experiment cpt` writes (arm-*.json, or an arm of results.json as
`results.json#ARM`: each held-out domain's loss in 256-token buckets of its 8K rows) and prints, for
every domain, each arm's perplexity ratio to the reference arm in position ranges: inside the
window, just past it, and out to the row's end. A gap that grows with the position is context the
arm uses less well than the reference; a flat one is the training budget. No model runs.

    python benchmarks/cpt_position_gap.py --ref benchmarks/results/cpt-smollm2-kd/arm-full-cpt.json \
        --arms benchmarks/results/cpt-smollm2-kd/arm-source.json \
               benchmarks/results/cpt-smollm2-rq/arm-orthros-cpt-sink-mix.json \
               benchmarks/results/cpt-smollm2-rqp/arm-orthros-cpt-sink-mix-aw.json \
        --out benchmarks/results/cpt-position-gap --plot docs/cpt-position-gap.png

Writes gap.json under --out, and the plot to --plot (default: gap.png under --out).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from orthros.experiments.cpt_data import DOMAINS

RANGES = ((0, 256), (256, 512), (512, 2048), (2048, 4096), (4096, 8192))


def load(path: str) -> dict:
    """An arm: an arm file (arm-*.json), or one arm of a results.json as `results.json#ARM`."""
    file, _, name = path.partition("#")
    p = Path(file)
    if not p.is_file():
        raise SystemExit(f"{p}: no such file (arm-*.json or results.json#ARM of `orthros experiment cpt`)")
    d = json.loads(p.read_text())
    if "results" in d and isinstance(d["results"], dict) and d["results"]:
        if name not in d["results"]:
            raise SystemExit(f"{path}: name one of its arms after '#': {', '.join(d['results'])}")
        d = d["results"][name]
    if "eval" not in d or "arm" not in d:
        raise SystemExit(f"{p}: not an arm file of `orthros experiment cpt` (no 'arm' / 'eval')")
    return d


def range_loss(bp: dict, lo: int, hi: int) -> float:
    """Token-weighted mean loss of the buckets inside [lo, hi)."""
    parts = [(b - a, l) for a, b, l in zip(bp["start"], bp["end"], bp["loss"]) if a >= lo and b <= hi]
    if not parts:
        raise SystemExit(f"no 256-token bucket lies inside [{lo}, {hi})")
    return sum(w * l for w, l in parts) / sum(w for w, _ in parts)


def gaps(ref: dict, arm: dict, ranges=RANGES) -> dict:
    """{domain: [perplexity ratio - 1 for each range]} over the domains both arms have."""
    out = {}
    for dom in DOMAINS:
        if dom in ref["eval"] and dom in arm["eval"]:
            r, a = ref["eval"][dom]["long"]["by_position"], arm["eval"][dom]["long"]["by_position"]
            out[dom] = [math.exp(range_loss(a, lo, hi) - range_loss(r, lo, hi)) - 1 for lo, hi in ranges]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", required=True, help="the reference arm's file (the paper's control: arm-full-cpt.json)")
    ap.add_argument("--arms", nargs="+", required=True, help="the arms' files")
    ap.add_argument("--out", default="benchmarks/results/cpt-position-gap")
    ap.add_argument("--plot", default=None, help="also save the plot here (a docs page that shows it)")
    args = ap.parse_args()
    ref = load(args.ref)
    arms = [load(f) for f in args.arms]
    names = [f"{lo}-{hi}" for lo, hi in RANGES]
    table = {}
    for arm, f in zip(arms, args.arms):
        table[arm["label"]] = {"file": f, "gap": gaps(ref, arm)}
    for dom in DOMAINS:
        rows = [(label, t["gap"][dom]) for label, t in table.items() if dom in t["gap"]]
        if not rows:
            continue
        print(f"\n{dom}: perplexity against {ref['label']}, by position")
        print("| arm | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        for label, g in rows:
            print(f"| {label} | " + " | ".join(f"{100 * x:+.1f}%" for x in g) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gap.json").write_text(json.dumps({"reference": {"label": ref["label"], "file": args.ref},
                                              "ranges": RANGES, "arms": table}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doms = [d for d in DOMAINS if any(d in t["gap"] for t in table.values())]
    fig, axes = plt.subplots(1, len(doms), figsize=(5.2 * len(doms), 4.2), squeeze=False)
    for ax, dom in zip(axes[0], doms):
        for label, t in table.items():
            if dom in t["gap"]:
                ax.plot(range(len(names)), [100 * x for x in t["gap"][dom]], marker="o", label=label)
        ax.axhline(0, color="black", lw=0.8)
        ax.axhline(3, color="gray", lw=0.8, ls="--")
        ax.set_xticks(range(len(names)), names, rotation=20)
        ax.set_xlabel("position in the 8K row")
        ax.set_ylabel(f"perplexity vs {ref['arm']} (%)")
        ax.set_title(f"held-out {dom}")
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()  # below the panels: it hides no point
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.04 + 0.045 * math.ceil(len(labels) / 2), 1, 1))
    plot = Path(args.plot) if args.plot else out / "gap.png"  # one copy: where the page shows it, if one does
    fig.savefig(plot, dpi=110)
    print(f"\nsaved {out}/gap.json, {plot}")


if __name__ == "__main__":
    main()
