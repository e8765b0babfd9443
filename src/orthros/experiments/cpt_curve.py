"""The token curve of the conversion experiment: the same arms trained at several budgets
(`orthros experiment cpt --steps 160 480 1600`), each Orthros arm's gap to the same-data control
(the source architecture's arm, `full-...`) at the same budget, as a table, curve.json and a plot.

    orthros experiment cpt --preset smollm2-kd-h200-rqp-curve --steps 160 480 1600 --jobs 2 \
        --arms orthros-cpt-sink-mix-aw full-cpt-mix-aw --device cuda
    orthros experiment cpt --from-json runs/curve/steps-*/results.json --out runs/curve   # the report again
"""

from __future__ import annotations

import json
from pathlib import Path

from .cpt_data import DOMAINS
from .cpt_report import size_label


def budgets(files: list[str | Path]) -> set[int]:
    """The training-token budgets of results.json / arm-*.json files (one: a comparison; several: a curve)."""
    out = set()
    for f in files:
        d = json.loads(Path(f).read_text())
        rs = d["results"].values() if "results" in d else [d]
        out |= {r["train"]["tokens"] for r in rs if r.get("train")}
    return out


def points(files: list[str | Path]) -> list[dict]:
    """One point per (arm, training tokens) from results.json files; a later file's point wins."""
    out = {}
    for f in files:
        d = json.loads(Path(f).read_text())
        if "results" not in d:
            raise ValueError(f"{f}: a curve needs the results.json of each run (it carries the preset), "
                             "not an arm file")
        cfg = d["meta"]["config"]
        for arm, r in d["results"].items():
            if not r.get("train"):
                continue
            ev = r["eval"]
            window = (r.get("window") or cfg["window"]) if arm.startswith("orthros") else None
            p = {"arm": arm, "label": r["label"], "tokens": r["train"]["tokens"], "steps": r["train"]["steps"],
                 "window": window, "seed": r.get("seed", 0),
                 "train_seconds": r["train"]["seconds"], "gpu": d["meta"].get("gpu"), "date": d["meta"].get("date"),
                 "lengths": [cfg.get("short_len", 2048), cfg.get("seq_len", 8192)], "file": str(f)}
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


def lengths(pts: list[dict]) -> tuple[str, str]:
    """The runs' short and long evaluation lengths, as labels ("2K", "8K")."""
    return tuple(size_label(n) for n in pts[0]["lengths"])


def tokens_label(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 100_000 else f"{n:,}"


def table(pts: list[dict], gp: list[dict]) -> str:
    gaps_of = {(g["arm"], g["tokens"]): g for g in gp}
    doms = [d for d in DOMAINS if any(f"{d}_short" in p for p in pts)]
    S, L = lengths(pts)
    copies = sorted({k for p in pts for k in p["copy"]}, key=int)
    keys = sorted({k for p in pts for k in p["passkey"]}, key=int)
    head = (["arm", "W", "tokens"] + [f"{d} {S} / {L}" for d in doms]
            + [f"copy @{c}" for c in copies] + [f"pass key {k}" for k in keys]
            + [f"gap code {S} / {L}; prose {S} / {L}"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in pts:
        g = gaps_of.get((p["arm"], p["tokens"]))
        gap = "-" if g is None else (f"{g['code_short']:+.1f}% / {g['code_long']:+.1f}%; "
                                      f"{g['prose_short']:+.1f}% / {g['prose_long']:+.1f}%")
        cells = [p["label"], str(p["window"] or "-"), tokens_label(p["tokens"])]
        cells += [f"{p[f'{d}_short']:.3f} / {p[f'{d}_long']:.3f}" if f"{d}_short" in p else "-" for d in doms]
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
    short = {p["arm"]: ("control (full attention)" if p["arm"] == ref else
                        f"Orthros{' light' if 'LoRA' in p['label'] else ''}, W={p['window']}") for p in pts}
    color = {a: "tab:orange" if a == ref else c for a, c in zip(arms, ["tab:blue", "tab:green", "tab:purple"] * 3)}
    ticks = sorted({p["tokens"] for p in pts})
    S, L = lengths(pts)
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.4))
    for ax, dom in zip(axes[:2], ("code", "prose")):
        for arm in arms:
            ps = [p for p in pts if p["arm"] == arm]
            x = [p["tokens"] for p in ps]
            ax.plot(x, [p[f"{dom}_short"] for p in ps], "o--", color=color[arm], label=f"{short[arm]}, {S}")
            ax.plot(x, [p[f"{dom}_long"] for p in ps], "s-", color=color[arm], label=f"{short[arm]}, {L}")
        ax.set_title(f"held-out {dom}: perplexity")
        ax.set_ylabel("perplexity")
        ax.legend(fontsize=7)
    ax = axes[2]
    for i, arm in enumerate(dict.fromkeys(g["arm"] for g in gp)):
        gs = [g for g in gp if g["arm"] == arm]
        x = [g["tokens"] for g in gs]
        for k, style, c in (("code_short", "o--", "tab:blue"), ("code_long", "s-", "tab:blue"),
                            ("prose_short", "o--", "tab:red"), ("prose_long", "s-", "tab:red")):
            name = k.replace("_short", f" {S}").replace("_long", f" {L}")
            # colour says the domain; a second (third) Orthros arm gets hollow (small) markers
            face = dict(markerfacecolor="white") if i % 3 == 1 else dict(markersize=4) if i % 3 == 2 else {}
            ax.plot(x, [g[k] for g in gs], style, color=c, label=f"{short[arm]}: {name}", **face)
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
            ax.plot([p["tokens"] for p in ps], [p["copy"].get(g) for p in ps], style,
                    color=color[arm], label=f"{short[arm]}, gap {g}")
    ax.set_title("copy loss (lower = copies)")
    ax.set_ylabel("loss on the repeated segment (nats)")
    ax.legend(fontsize=7)
    for ax in axes:
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([tokens_label(t) for t in ticks])
        ax.set_xlabel("training tokens")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reference(pts: list[dict]) -> str | None:
    """The same-data control: the one source-architecture arm (`full-...`) trained at every budget."""
    budgets_ = {p["tokens"] for p in pts}
    full = sorted({p["arm"] for p in pts if p["arm"].startswith("full-")})
    full = [a for a in full if {p["tokens"] for p in pts if p["arm"] == a} == budgets_]
    return full[0] if len(full) == 1 else None


def write_curve(files: list[str | Path], out: str | Path, ref: str | None = None) -> dict:
    """curve.json, curve.md and curve.png under `out` from runs at several budgets."""
    pts = points(files)
    ref = ref or reference(pts)
    if ref is not None and not any(p["arm"] == ref for p in pts):
        raise ValueError(f"no trained arm {ref} in these runs (arms: {', '.join(sorted({p['arm'] for p in pts}))})")
    gp = gaps(pts, ref) if ref else []
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    text = table(pts, gp) + (f"\n\nGaps: perplexity above {ref} at the same tokens." if ref else
                             "\n\n(no same-data control, a `full-` arm at every budget: no gaps)")
    (out / "curve.json").write_text(json.dumps({"ref": ref, "points": pts, "gaps": gp}, indent=1))
    (out / "curve.md").write_text(text + "\n")
    plot(pts, gp, ref, out / "curve.png")
    return {"ref": ref, "points": pts, "gaps": gp, "table": text}
