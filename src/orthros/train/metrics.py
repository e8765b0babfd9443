"""Training feedback: a jsonl metrics log, optional TensorBoard, loss plots."""

from __future__ import annotations

import json
import sys
from pathlib import Path


class MetricsLog:
    """Appends one JSON object per record to `out_dir/metrics.jsonl` (main process only).

    On resume, records past the resumed step (written after the checkpoint
    by the interrupted run) are dropped so the log reads as one run.
    """

    def __init__(self, out_dir: Path, enabled: bool = True, resume_step: int | None = None,
                 tensorboard: bool = False):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.enabled, self.tb = enabled, None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            keep = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in keep))
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(out_dir) / "tensorboard"))
            except ImportError:
                print("log.tensorboard: tensorboard is not installed; skipping it", file=sys.stderr)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def curves(run_dir: Path) -> dict:
    """{'train': [(step, loss)], 'heldout': [(step, loss)], 'tokens': [(step, tokens)]} of a run."""
    recs = read_metrics(Path(run_dir) / "metrics.jsonl")
    return {"train": [(r["step"], r["loss"]) for r in recs if "loss" in r],
            "heldout": [(r["step"], r["eval_loss"]) for r in recs if "eval_loss" in r],
            "tokens": [(r["step"], r["tokens"]) for r in recs if "tokens" in r]}


def plot_runs(runs: dict[str, Path], png: Path, title: str | None = None) -> dict:
    """Train (thin) and held-out (markers) loss of several runs on one plot; returns the curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = {name: curves(d) for name, d in runs.items()}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, c) in enumerate(data.items()):
        color = f"C{i}"
        if c["train"]:
            ax.plot(*zip(*c["train"]), color=color, lw=1, alpha=0.8, label=f"{name} train")
        if c["heldout"]:
            ax.plot(*zip(*c["heldout"]), color=color, lw=2, marker="o", ms=4, label=f"{name} held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return data


def main(argv: list[str] | None = None) -> int:
    """python -m orthros.train.metrics NAME=RUN_DIR ... -o loss.png [--json curves.json]"""
    import argparse

    p = argparse.ArgumentParser(prog="python -m orthros.train.metrics", description="plot several runs' losses")
    p.add_argument("runs", nargs="+", help="NAME=RUN_DIR")
    p.add_argument("-o", "--out", required=True, help="PNG path")
    p.add_argument("--json", help="also write the curves as JSON")
    p.add_argument("--title")
    a = p.parse_args(argv)
    runs = dict(r.split("=", 1) for r in a.runs)
    data = plot_runs(runs, Path(a.out), a.title)
    if a.json:
        Path(a.json).write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
