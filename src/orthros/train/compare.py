"""Train Orthros and a same-size baseline on the same data and schedule; plot both.

    python -m orthros.train.compare configs/pretrain-160m-stdlib.yaml --out runs/parity \
        --max-seconds 120 --baseline full

The Orthros run goes first, bounded by `--max-seconds`; the baseline then
runs the same schedule (`train.steps`) and stops at the same step, so both
see exactly the same tokens in the same order with the same learning rates.
The baseline reuses the Orthros run's tokenizer. Writes `loss.png` and
`curves.json` (train and held-out loss per step, final numbers).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import positive_arg
from .config import build_config
from .metrics import plot_runs
from .trainer import train


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m orthros.train.compare", description=__doc__.splitlines()[0])
    p.add_argument("config", help="YAML training config (the model section describes the Orthros model)")
    p.add_argument("--out", required=True, help="directory for the two runs, loss.png and curves.json")
    p.add_argument("--baseline", default="full", choices=["full", "swa"])
    p.add_argument("--max-seconds", type=positive_arg, default=None, help="training time of the Orthros run")
    p.add_argument("--set", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                   help="extra override, e.g. --set train.steps 100")
    a = p.parse_args(argv)
    out = Path(a.out)
    base = {k: v for k, v in a.set}
    o1 = {**base, "out_dir": str(out / "orthros"), "model.attention": "orthros"}
    if a.max_seconds is not None:
        o1["train.max_seconds"] = str(a.max_seconds)
    s1 = train(build_config(a.config, o1))
    o2 = {**base, "out_dir": str(out / a.baseline), "model.attention": a.baseline, "train.stop_at": str(s1["steps"]),
          "model.vocab_size": str(_vocab(s1["checkpoint"]))}
    if (out / "orthros" / "tokenizer").is_dir():
        o2["data.tokenizer"] = str(out / "orthros" / "tokenizer")
    s2 = train(build_config(a.config, o2))
    curves = plot_runs({"orthros": out / "orthros", a.baseline: out / a.baseline}, out / "loss.png",
                       title=f"{Path(a.config).stem}: same data, same {s1['steps']} steps")
    summary = {"config": a.config, "overrides": base, "steps": s1["steps"], "orthros": s1, a.baseline: s2,
               "curves": curves}
    (out / "curves.json").write_text(json.dumps(summary, indent=1))
    for name, s in (("orthros", s1), (a.baseline, s2)):
        print(f"{name:8s} steps {s['steps']}  train loss {s['loss']:.4f}  held-out loss {s['eval_loss']}")
    return 0


def _vocab(ckpt: str) -> int:
    return json.loads((Path(ckpt) / "config.json").read_text())["vocab_size"]


if __name__ == "__main__":
    sys.exit(main())
