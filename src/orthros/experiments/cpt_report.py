"""The CPT experiment's table (one row per arm, the paper's layout) and plots."""

from __future__ import annotations

from pathlib import Path

from .cpt_data import DOMAINS

COLORS = {"source": "black", "orthros-0shot": "tab:gray", "orthros-cpt": "tab:blue", "full-cpt": "tab:orange",
          "swa-cpt": "tab:green", "orthros-noso": "tab:purple", "orthros-so": "tab:cyan", "orthros-lora": "tab:red",
          "orthros-kd": "tab:brown", "orthros-kd-d": "tab:pink", "orthros-kd-d-lora": "tab:olive",
          "orthros-kd-lora": "gold", "orthros-kd-d-nomix": "navy", "orthros-kd-d-w256": "salmon",
          "orthros-kd-d-w512": "teal", "orthros-kd-d-s1": "violet", "orthros-cpt-s1": "lightblue",
          "full-cpt-s1": "wheat"}


def size_label(n: int) -> str:
    """2048 -> "2K"; a count that is not whole K as it is."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def format_table(results: dict, preset) -> str:
    L, S = size_label(preset.seq_len), size_label(preset.short_len)
    gaps = [str(g) for g in preset.copy_gaps]
    lens = [str(n) for n in preset.passkey_lengths]
    doms = [d for d in DOMAINS if all(d in r["eval"] for r in results.values())]
    head = (["arm", "trained params"] + [f"{d} ppl {n}" for d in doms for n in (S, L)]
            + [f"copy loss @{size_label(int(g))}" for g in gaps] + [f"passkey {size_label(int(n))}" for n in lens]
            + [f"lm-eval {t}" for t in preset.lm_eval_tasks])
    demo = any("demo" in r["eval"] for r in results.values())
    head += ["demo 343 − 634", "demo codes"] if demo else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, r in results.items():
        ev, tr = r["eval"], r["train"]
        cells = [r["label"], "-" if tr is None else f"{tr['trainable'] / 1e6:.2f}M"]
        for dom in doms:
            cells += [f"{ev[dom]['short']['ppl']:.3f}", f"{ev[dom]['long']['ppl']:.3f}"]
        cells += [f"{ev['copy']['by_gap'][g]['second']:.3f}" for g in gaps]
        cells += [f"{100 * ev['passkey']['by_length'][n]:.0f}%" for n in lens]
        lm = ev.get("lm_eval", {})
        cells += ["-" if not isinstance(lm.get(t), float) else f"{100 * lm[t]:.1f}%" for t in preset.lm_eval_tasks]
        d = ev.get("demo")
        cells += ([f"{d['margin']:+.2f}", f"{d['right']} / {len(d['facts'])}"] if d else ["-", "-"]) if demo else []
        lines.append("| " + " | ".join(cells) + " |")
    first = next(iter(results.values()))["eval"]["copy"]
    wins = sorted({r.get("window") or preset.window for r in results.values()})
    others = " / ".join(f"W={w}" for w in wins if w != preset.window)
    if len(wins) == 1:
        window = f"window {wins[0]}"
    elif preset.window in wins:
        window = f"window {preset.window} ({others} where a row says so)"
    else:  # no row at the preset's window: each row names its own
        window = "window " + " / ".join(str(w) for w in wins) + ", as each row says"
    note = (f"\nCPT: {preset.steps} steps x {preset.batch_size} x {preset.seq_len} tokens = "
            f"{preset.train_tokens:,} tokens per trained arm, {window}. Copy loss: mean loss (nats) on "
            f"the second copy of a {first['seg_len']}-token segment repeated after the gap "
            f"({first['samples']} samples). Passkey: greedy answers through the chat template, "
            f"{len(preset.passkey_depths)} depths x {preset.passkey_samples} samples per length."
            + (" Demo: `orthros demo`'s question, log p(343) − log p(634) after \"The PEP \" (nats), and its "
               "archive code asked at 10 / 50 / 90% depth (right answers)." if demo else ""))
    return "\n".join(lines) + note


def plot_all(results: dict, preset, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    saved = []
    doms = [d for d in DOMAINS if all(d in r["eval"] for r in results.values())]
    fig, axes = plt.subplots(1, len(doms) + 1, figsize=(5.7 * (len(doms) + 1), 4.6))
    for ax, dom in zip(axes[:-1], doms):
        for arm, r in results.items():
            bp = r["eval"][dom]["long"]["by_position"]
            mid = [(a + b) / 2 for a, b in zip(bp["start"], bp["end"])]
            ax.plot(mid, bp["loss"], label=r["label"], color=COLORS.get(arm), lw=1.6)
        ax.set_title(f"held-out {dom}: loss by position ({preset.seq_len}-token rows)")
        ax.set_xlabel("position")
        ax.set_ylabel("loss (nats)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    ax = axes[-1]
    gaps = [str(g) for g in preset.copy_gaps]
    w = 0.8 / max(1, len(results))
    for i, (arm, r) in enumerate(results.items()):
        vals = [r["eval"]["copy"]["by_gap"][g]["second"] for g in gaps]
        ax.bar([j + i * w for j in range(len(gaps))], vals, w, color=COLORS.get(arm), label=r["label"])
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(gaps))], [f"gap {g}" for g in gaps])
    ax.set_ylabel("loss on the repeated segment (nats)")
    ax.set_title("long-range copy probe (lower = copies)")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    p = out / "cpt.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    saved.append(p)
    trained = {a: r for a, r in results.items() if r["train"]}
    if trained:
        fig, ax = plt.subplots(figsize=(7, 4))
        for arm, r in trained.items():
            c = r["train"]["loss_curve"]
            k = max(1, len(c) // 50)
            sm = [sum(c[i : i + k]) / len(c[i : i + k]) for i in range(0, len(c), k)]
            ax.plot([i * k for i in range(len(sm))], sm, label=r["label"], color=COLORS.get(arm))
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title("continued pre-training")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = out / "cpt-train.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        saved.append(p)
    curves = {a: r["train"]["demo_curve"] for a, r in trained.items() if r["train"].get("demo_curve")}
    if curves:
        saved.append(plot_demo_curves(results, curves, out / "cpt-demo.png"))
    return saved


def plot_demo_curves(results: dict, curves: dict, path: Path) -> Path:
    """The demo's margin (log p(343) − log p(634), `demo.real.margin`) along each arm's training
    (`train.demo_curve`: [step, tokens, margin, code log p]), against tokens; an untrained arm's margin
    (the source's, the zero-shot conversion's) as a level line; beside it, where the points have it,
    the archive codes' mean log p (`demo.real.fact_logprob`)."""
    import matplotlib.pyplot as plt

    codes = any(len(p) > 3 for c in curves.values() for p in c)  # curves from before 2026-12-06 lack it
    fig, axes = plt.subplots(1, 2 if codes else 1, figsize=(13 if codes else 7, 4), squeeze=False)
    ax = axes[0, 0]
    for arm, c in curves.items():
        ax.plot([p[1] / 1e6 for p in c], [p[2] for p in c], marker="o", ms=3, color=COLORS.get(arm),
                label=results[arm]["label"])
        if codes:
            axes[0, 1].plot([p[1] / 1e6 for p in c if len(p) > 3], [p[3] for p in c if len(p) > 3], marker="o",
                            ms=3, color=COLORS.get(arm), label=results[arm]["label"])
    for arm, r in results.items():
        d = r["eval"].get("demo")
        if not r["train"] and d:
            ax.axhline(d["margin"], ls="--", lw=1, color=COLORS.get(arm, "black"), label=f"{r['label']} (untrained)")
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_ylabel("log p(343) − log p(634) (nats)")
    ax.set_title("the demo's answer along training (> 0: the right PEP)")
    if codes:
        axes[0, 1].set_ylabel("mean log p(code | its sentence) (nats)")
        axes[0, 1].set_title("the demo's archive codes (10 / 50 / 90% depth)")
    for a in axes[0]:
        a.set_xlabel("training tokens (M)")
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
