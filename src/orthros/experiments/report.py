"""The recall experiment's results as a table (the paper's layout) and a plot, and
several seeds' runs as one (mean, range, every run)."""

from __future__ import annotations

from .presets import LABELS, Preset


def format_table(results: dict, preset: Preset) -> str:
    """One row per architecture, in the paper's layout (markdown)."""
    W = preset.window
    Ls = preset.mqar_eval_lengths
    tasks = preset.eval_tasks
    head = ["architecture", "params"] + ([f"MQAR {L} ({L // W}W)" for L in Ls] if "mqar" in tasks else [])
    head += (["passkey"] if "passkey" in tasks else []) + (["ppl"] if "ppl" in tasks else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arch, r in results.items():
        ev, rng = r["eval"], r.get("range", {}).get("eval")  # rng: [min, max] over seeds

        def cell(*path, scale=100.0, fmt=".1f"):
            v, spread = ev, rng
            for k in path:
                v, spread = v[k], spread[k] if spread else None
            text = f"{scale * v:{fmt}}"
            return text + (f" ({scale * spread[0]:{fmt}}–{scale * spread[1]:{fmt}})" if spread else "")

        cells = [LABELS.get(arch, arch), f"{r['params'] / 1e6:.2f}M"]
        if "mqar" in ev:
            cells += [cell("mqar", "by_length", str(L)) for L in Ls]
        if "passkey" in ev:
            cells.append(cell("passkey", "mean"))
        if "ppl" in ev:
            cells.append(cell("ppl", "ppl", scale=1.0, fmt=".3f"))
        lines.append("| " + " | ".join(cells) + " |")
    seeds = next((list(r["per_seed"]) for r in results.values() if "per_seed" in r), None)
    if seeds:
        lines += ["", f"Mean over seeds {', '.join(seeds)} (range in brackets)."]
    return "\n".join(lines)


def plot(results: dict, preset: Preset, path) -> None:
    """MQAR accuracy vs length and vs key distance, passkey accuracy vs length: one line per architecture."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for arch, r in results.items():
        ev = r["eval"]
        if "mqar" not in ev or "passkey" not in ev:
            ev = {"mqar": ev.get("mqar", {"by_length": {}, "by_distance": {}}),
                  "passkey": ev.get("passkey", {"config": {"lengths": [], "depths": [1]}, "grid": {}})}
        Ls = [int(L) for L in ev["mqar"]["by_length"]]
        axes[0].plot(Ls, [100 * a for a in ev["mqar"]["by_length"].values()], "o-", label=LABELS.get(arch, arch))
        bins = list(ev["mqar"]["by_distance"])
        axes[1].plot(range(len(bins)), [100 * a for a in ev["mqar"]["by_distance"].values()], "o-",
                     label=LABELS.get(arch, arch))
        axes[1].set_xticks(range(len(bins)), bins, rotation=30, fontsize=8)
        pk = ev["passkey"]
        lengths = pk["config"]["lengths"]
        acc = [sum(pk["grid"][f"{L}/{d:g}"] for d in pk["config"]["depths"]) / len(pk["config"]["depths"])
               for L in lengths]
        axes[2].plot(lengths, [100 * a for a in acc], "o-", label=LABELS.get(arch, arch))
    axes[0].set(xscale="log", xlabel="sequence length (tokens)", ylabel="MQAR accuracy %",
                title=f"MQAR (window W={preset.window})")
    axes[1].set(xlabel="key-to-query distance (tokens)", ylabel="MQAR accuracy %", title="MQAR by distance")
    axes[2].set(xscale="log", xlabel="context length (tokens)", ylabel="exact match %", title="passkey retrieval")
    for ax, key in ((axes[0], "mqar"), (axes[2], "passkey")):
        first = next(iter(results.values()))["eval"]
        ticks = ([int(L) for L in first["mqar"]["by_length"]] if key == "mqar" and "mqar" in first else
                 first["passkey"]["config"]["lengths"] if key == "passkey" and "passkey" in first else [])
        if ticks:
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.minorticks_off()
    for ax in axes:
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def aggregate(per_seed: dict) -> dict:
    """Runs of one architecture under several seeds -> one result whose numbers are the
    means over seeds (same structure: the table and the plot read it as one run), with
    "range": the same structure holding [min, max], and "per_seed": every run."""
    runs = list(per_seed.values())

    def combine(values, reduce):
        first = values[0]
        if isinstance(first, dict):
            return {k: combine([v[k] for v in values], reduce) for k in first}
        if isinstance(first, (int, float)) and not isinstance(first, bool):
            return reduce(values)
        return first  # configs, names: equal across seeds

    mean = combine(runs, lambda v: sum(v) / len(v))
    return {**mean, "range": combine(runs, lambda v: [min(v), max(v)]),
            "per_seed": {str(s): r for s, r in per_seed.items()}}
