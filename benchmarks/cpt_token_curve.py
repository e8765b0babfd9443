"""The token curve: the conversion recipe and its same-data control at several training budgets,
and the recipe's gap to the control at each budget.

    python benchmarks/cpt_token_curve.py benchmarks/results/cpt-smollm2-rqp-curve/*/results.json \
        --ref full-cpt-mix-aw --plot docs/cpt-token-curve.png

Reads `orthros experiment cpt` results (runs of one preset at several `--steps`; no model runs),
prints a table (perplexity, copy loss and pass key by tokens, and the gap to `--ref` in the same
budget), and writes curve.json beside the first file (or to --out) and the plot.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DOMAINS = ("code", "prose", "docs")


def points(files: list[str | Path]) -> list[dict]:
    """One point per (arm, training tokens) from results.json files; a later file's point wins."""
    out = {}
    for f in files:
        d = json.loads(Path(f).read_text())
        if "results" not in d:
            raise SystemExit(f"{f}: not a results.json of `orthros experiment cpt` (no 'results')")
        cfg = d["meta"]["config"]
        for arm, r in d["results"].items():
            if not r.get("train"):
                continue
            ev = r["eval"]
            window = (r.get("window") or cfg["window"]) if arm.startswith("orthros") else None
            p = {"arm": arm, "label": r["label"], "tokens": r["train"]["tokens"], "steps": r["train"]["steps"],
                 "window": window, "seed": r.get("seed", 0),
                 "train_seconds": r["train"]["seconds"], "gpu": d["meta"].get("gpu"), "date": d["meta"].get("date"),
                 "file": str(f)}
            for dom in DOMAINS:
                if dom in ev:
                    p[f"{dom}_short"] = ev[dom]["short"]["ppl"]
                    p[f"{dom}_long"] = ev[dom]["long"]["ppl"]
            p["copy"] = {g: v["second"] for g, v in ev["copy"]["by_gap"].items()}
            p["passkey"] = dict(ev["passkey"]["by_length"])
            out[(arm, p["tokens"])] = p
    return sorted(out.values(), key=lambda p: (p["arm"], p["tokens"]))


def gaps(pts: list[dict], ref: str) -> list[dict]:
    """Each non-reference point's relative gap (%) to the reference arm at the same tokens."""
    refs = {p["tokens"]: p for p in pts if p["arm"] == ref}
    out = []
    for p in pts:
        r = refs.get(p["tokens"])
        if p["arm"] == ref or r is None:
            continue
        g = {"arm": p["arm"], "tokens": p["tokens"]}
        for k in [f"{d}_{n}" for d in DOMAINS for n in ("short", "long")]:
            if k in p and k in r:
                g[k] = 100 * (p[k] / r[k] - 1)
        g["copy"] = {k: 100 * (v / r["copy"][k] - 1) for k, v in p["copy"].items() if k in r["copy"]}
        out.append(g)
    return out


def table(pts: list[dict], gp: list[dict]) -> str:
    gaps_of = {(g["arm"], g["tokens"]): g for g in gp}
    copies = sorted({k for p in pts for k in p["copy"]}, key=int)
    keys = sorted({k for p in pts for k in p["passkey"]}, key=int)
    head = (["arm", "W", "tokens", "code 2K / 8K", "prose 2K / 8K", "docs 2K / 8K"]
            + [f"copy @{c}" for c in copies] + [f"pass key {k}" for k in keys] + ["gap code / prose 2K / 8K"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in pts:
        g = gaps_of.get((p["arm"], p["tokens"]))
        gap = "-" if g is None else (f"{g['code_short']:+.1f}% / {g['code_long']:+.1f}% ; "
                                      f"{g['prose_short']:+.1f}% / {g['prose_long']:+.1f}%")
        cells = [p["label"], str(p["window"] or "-"), f"{p['tokens'] / 1e6:.1f}M"]
        cells += [f"{p[f'{d}_short']:.3f} / {p[f'{d}_long']:.3f}" if f"{d}_short" in p else "-" for d in DOMAINS]
        cells += [f"{p['copy'][c]:.3f}" if c in p["copy"] else "-" for c in copies]
        cells += [f"{100 * p['passkey'][k]:.0f}%" if k in p["passkey"] else "-" for k in keys]
        lines.append("| " + " | ".join(cells + [gap]) + " |")
    return "\n".join(lines)


def plot(pts: list[dict], gp: list[dict], ref: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

    arms = list(dict.fromkeys(p["arm"] for p in pts))
    short = {p["arm"]: ("control (full attention)" if p["arm"] == ref else f"Orthros, W={p['window']}") for p in pts}
    color = {a: "tab:orange" if a == ref else c for a, c in zip(arms, ["tab:blue", "tab:green", "tab:purple"] * 3)}
    ticks = sorted({p["tokens"] / 1e6 for p in pts})
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.4))
    for ax, dom in zip(axes[:2], ("code", "prose")):
        for arm in arms:
            ps = [p for p in pts if p["arm"] == arm]
            x = [p["tokens"] / 1e6 for p in ps]
            ax.plot(x, [p[f"{dom}_short"] for p in ps], "o--", color=color[arm], label=f"{short[arm]}, 2K")
            ax.plot(x, [p[f"{dom}_long"] for p in ps], "s-", color=color[arm], label=f"{short[arm]}, 8K")
        ax.set_title(f"held-out {dom}: perplexity")
        ax.set_ylabel("perplexity")
        ax.legend(fontsize=7)
    ax = axes[2]
    for arm in dict.fromkeys(g["arm"] for g in gp):
        gs = [g for g in gp if g["arm"] == arm]
        x = [g["tokens"] / 1e6 for g in gs]
        for k, style, c in (("code_short", "o--", "tab:blue"), ("code_long", "s-", "tab:blue"),
                            ("prose_short", "o--", "tab:red"), ("prose_long", "s-", "tab:red")):
            name = k.replace("_short", " 2K").replace("_long", " 8K")
            ax.plot(x, [g[k] for g in gs], style, color=c, label=f"{short[arm]}: {name}")
    ax.axhline(3, color="gray", lw=1, ls=":", label="target: within 3%")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_title("perplexity above the same-data control")
    ax.set_ylabel("%")
    ax.legend(fontsize=7)
    ax = axes[3]
    gaps_ = sorted({k for p in pts for k in p["copy"]}, key=int)
    for arm in arms:
        ps = [p for p in pts if p["arm"] == arm]
        for g, style in zip(gaps_, ("o-", "s--", "^:")):
            ax.plot([p["tokens"] / 1e6 for p in ps], [p["copy"].get(g) for p in ps], style,
                    color=color[arm], label=f"{short[arm]}, gap {g}")
    ax.set_title("copy loss (lower = copies)")
    ax.set_ylabel("loss on the repeated segment (nats)")
    ax.legend(fontsize=7)
    for ax in axes:
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([f"{t:.1f}M" for t in ticks])
        ax.set_xlabel("training tokens")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="results.json of `orthros experiment cpt` runs")
    ap.add_argument("--ref", default="full-cpt-mix-aw", help="the arm every gap is measured against")
    ap.add_argument("--out", default=None, help="curve.json (default: beside the first file's folder)")
    ap.add_argument("--plot", default=None, help="the plot (default: curve.png beside curve.json)")
    args = ap.parse_args()
    pts = points(args.files)
    if not any(p["arm"] == args.ref for p in pts):
        raise SystemExit(f"--ref {args.ref}: no such trained arm in these files "
                         f"(arms: {', '.join(sorted({p['arm'] for p in pts}))})")
    gp = gaps(pts, args.ref)
    print(table(pts, gp))
    out = Path(args.out) if args.out else Path(args.files[0]).resolve().parents[1] / "curve.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"ref": args.ref, "points": pts, "gaps": gp}, indent=1))
    png = Path(args.plot) if args.plot else out.with_suffix(".png")
    plot(pts, gp, args.ref, png)
    print(f"wrote {out} and {png}")


if __name__ == "__main__":
    main()
