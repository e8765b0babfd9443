"""`orthros bench serve`'s report: the Markdown tables (the client's view, the engine's, throughput
at equal tail latency) and the plot of each scenario."""

from __future__ import annotations

from .serve_client import fmt_ms
from .serve_faults import faults_plot, faults_table
from .serve_long import long_plot, long_table


def table(res: dict) -> str:
    e = res["env"]
    head = (f"`{res['command']}` — {res['model']} shape, window {res['window']}, KV {res['kv_dtype']}, "
            f"{e['gpu']}, torch {e['torch']}, {e['date']} (scale `{res['scale']}`"
            + (": a CPU smoke run, not a measurement" if res["scale"] == "tiny" else "") + ")\n\n")
    if res.get("complete") is False:  # written before its run ended: a cut run, or one read back mid-run
        head += (f"**An incomplete run**: the {len(res['rows'])} row(s) measured before it stopped"
                 + (f" ({res['error']})" if res.get("error") else "") + ".\n\n")
    if res["scenario"] == "interference":
        lines = ["| attention | token budget | 128K-prompt TTFT | running ITL p50 during its prefill | p99 | max "
                 "| ITL p50 before |", "|---|---:|---:|---:|---:|---:|---:|"]
        for r in res["rows"]:
            d, b = r["itl_during_prefill"], r["itl_before"]
            lines.append(f"| {r['variant']} | {r['budget']} | {fmt_ms(r['long_ttft_ms'])} | {fmt_ms(d['p50'])} | "
                         f"{fmt_ms(d['p99'])} | {fmt_ms(d['max'])} | {fmt_ms(b['p50'])} |")
        return head + "\n".join(lines) + engine_table(res)
    if res["scenario"] == "long":
        return head + long_table(res) + engine_table(res)
    if res["scenario"] == "faults":
        return head + faults_table(res) + engine_table(res)
    hits = res["scenario"] == "documents"  # the share of prompt tokens read from the prefix cache
    lines = ["| attention | run | ok | req/s | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | ITL p50 | ITL p99 "
             "| E2EL p50 | E2EL p99 |" + (" prefix hits |" if hits else ""),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if hits else "")]
    for r in res["rows"]:
        lines.append(f"| {r['variant']} | {r['run']} | {r['completed']}/{r['completed'] + r['failed']} | "
                     f"{r['request_throughput']:.3f} | {r['output_throughput']:.1f} | {fmt_ms(r['ttft']['p50'])} | "
                     f"{fmt_ms(r['ttft']['p99'])} | {fmt_ms(r['tpot']['p50'])} | {fmt_ms(r['itl']['p50'])} | "
                     f"{fmt_ms(r['itl']['p99'])} | {fmt_ms(r['e2el']['p50'])} | {fmt_ms(r['e2el']['p99'])} |"
                     + (f" {100 * r.get('prefix_hit_rate', 0.0):.1f}% |" if hits else ""))
    return head + "\n".join(lines) + equal_tail_table(res["rows"]) + engine_table(res)


def engine_table(res: dict) -> str:
    """The engine's own view beside the client's: each server's step times (its step log; every
    step of its life, warm-up included), the slowest step and what it ran."""
    steps = res.get("steps") or {}
    if not steps:
        return ""
    lines = ["\n\nThe engine's view (`--step-log`: every step of each server, warm-up included):\n",
             "| server | steps | step p50 | step p99 | step max | the slowest step ran |",
             "|---|---:|---:|---:|---:|---|"]
    for key, st in steps.items():
        slow = st.get("slowest") or [{}]
        what = f"{slow[0].get('decode', 0)} decodes, chunks {slow[0].get('chunks', [])}" if slow[0] else "-"
        lines.append(f"| {key} | {st['steps']} | {fmt_ms(st['ms_p50'])} | {fmt_ms(st['ms_p99'])} | "
                     f"{fmt_ms(st['ms_max'])} "
                     f"| {what} |")
    return "\n".join(lines)


def equal_tail_table(rows: list[dict], base: str = "full", other: str = "orthros") -> str:
    """Throughput at equal tail latency: for each `base` run, the fastest `other` run whose TTFT
    p99 is no higher, and the ratio of their request (and token) throughputs. Only runs of the
    same prompt lengths (rated runs of one scenario) compare; empty if either variant is missing."""
    rated = lambda v: sorted((r for r in rows if r["variant"] == v and r.get("rate") and r["ttft"]["p99"]),
                             key=lambda r: r["rate"])
    a, b = rated(base), rated(other)
    if not a or not b or len({r.get("total_input_tokens") for r in a + b}) > 1:
        return ""  # runs with different prompts (e.g. of an older benchmark) do not compare in req/s
    lines = ["", "", f"At equal tail latency: for each {base} run, the {other} run with the highest request "
             f"throughput whose TTFT p99 is no higher (runs at every rate carry the same prompt lengths).", "",
             f"| {base} run | TTFT p99 | req/s | {other} run | TTFT p99 | req/s | req/s ratio | tokens/s ratio |",
             "|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in a:
        ok = [x for x in b if x["ttft"]["p99"] <= r["ttft"]["p99"]]
        if not ok:
            lines.append(f"| {r['run']} | {fmt_ms(r['ttft']['p99'])} | {r['request_throughput']:.3f} | none as low | "
                         "| | | |")
            continue
        x = max(ok, key=lambda x: x["request_throughput"])
        lines.append(f"| {r['run']} | {fmt_ms(r['ttft']['p99'])} | {r['request_throughput']:.3f} | {x['run']} | "
                     f"{fmt_ms(x['ttft']['p99'])} | {x['request_throughput']:.3f} | "
                     f"{x['request_throughput'] / r['request_throughput']:.2f}x | "
                     f"{x['total_token_throughput'] / r['total_token_throughput']:.2f}x |")
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    from .common import save_figure, subplots

    rows = res["rows"]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    if res["scenario"] == "long":
        fig, axes = subplots(2, 5.5, 4)
        long_plot(res, (fig, axes))
    elif res["scenario"] == "faults":
        fig, (ax,) = subplots(1, 6, 4)
        faults_plot(res, ax)
    elif res["scenario"] == "interference":
        fig, (ax,) = subplots(1, 5.5, 4)
        for i, v in enumerate(variants):
            rs = [r for r in rows if r["variant"] == v and r["itl_during_prefill"]["p99"] is not None]
            x = [r["budget"] for r in rs]
            ax.plot(x, [r["itl_during_prefill"]["p99"] for r in rs], "o-", color=f"C{i}", label=f"{v} p99")
            ax.plot(x, [r["itl_during_prefill"]["p50"] for r in rs], "x--", color=f"C{i}", label=f"{v} p50")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="token budget per step", ylabel="ITL of running streams (ms)",
               title="decode latency while a long prompt prefills")
    elif res["scenario"] in ("traffic", "documents") or len({r["run"] for r in rows}) > 2:
        # Tail TTFT against throughput, in tokens / s (prompt + output) and requests / s (runs at
        # every rate carry the same lengths, so the two agree), each point named by its run
        fig, axes = subplots(2, 5.5, 4)
        for key, label, ax in (("total_token_throughput", "tokens / s (prompt + output)", axes[0]),
                               ("request_throughput", "completed requests / s", axes[1])):
            for v in variants:
                rs = [r for r in rows if r["variant"] == v and r["ttft"]["p99"] is not None and key in r]
                ax.plot([r[key] for r in rs], [r["ttft"]["p99"] / 1e3 for r in rs], "o-", label=v)
                for r in rs:
                    ax.annotate(r["run"], (r[key], r["ttft"]["p99"] / 1e3), fontsize=7, xytext=(3, 3),
                                textcoords="offset points")
            ax.set(xlabel=label, ylabel="TTFT p99 (s)", title="throughput vs tail TTFT")
    else:
        fig, axes = subplots(2, 4.5, 4)
        runs = list(dict.fromkeys(r["run"] for r in rows))
        width = 0.8 / max(1, len(variants))
        for ax, key, label in zip(axes, ("ttft", "e2el"), ("TTFT p50 (s)", "end-to-end p50 (s)")):
            for j, v in enumerate(variants):
                # a run cut short may lack some (variant, run) cells: no bar there
                vals = [next(((r[key]["p50"] or 0) / 1e3 for r in rows if r["variant"] == v and r["run"] == run),
                             float("nan")) for run in runs]
                ax.bar([i + j * width for i in range(len(runs))], vals, width, label=v)
            ax.set_xticks([i + width * (len(variants) - 1) / 2 for i in range(len(runs))], runs)
            ax.set(ylabel=label, title=label.split(" (")[0])
    for ax in fig.axes:
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    save_figure(fig, path)
