"""Train a model: pre-training from scratch, continued pre-training, or SFT.

    orthros train configs/pretrain-tiny.yaml
    orthros train configs/pretrain-tiny.yaml --model.attention full --out_dir runs/full
    orthros train configs/sft-tiny.yaml --model.init_from runs/tiny/checkpoints/step_00000200
    orthros train configs/pretrain-tiny.yaml --resume            # continue the newest checkpoint
    torchrun --nproc_per_node 8 -m orthros train configs/pretrain-160m.yaml   # FSDP2

A YAML file sets any of the options below; `--section.field value` wins over it.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .config import options

    p.add_argument("config", nargs="?", help="YAML config file")
    p.add_argument("--config", dest="config_opt", metavar="FILE", help="YAML config file (same as the positional)")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CKPT",
                   help="resume from the newest checkpoint in out_dir, or from CKPT (= --checkpoint.resume)")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, tp, default, doc in options():
        sec = name.split(".")[0] if "." in name else "run"
        g = groups.setdefault(sec, p.add_argument_group(sec))
        shown = "" if default in (None, [], {}) else f" (default: {default})"
        g.add_argument(f"--{name}", dest=f"opt:{name}", default=argparse.SUPPRESS, metavar="V",
                       help=doc.replace("%", "%%") + shown.replace("%", "%%"))


def run(args, need_teacher: bool = False) -> int:
    from ..errors import UserError
    from .config import build_config
    from .trainer import NonFiniteLossError, train

    if args.config and args.config_opt and args.config != args.config_opt:
        raise ValueError("give the config file once (positional or --config)")
    overrides = {k[4:]: v for k, v in vars(args).items() if k.startswith("opt:")}
    if args.resume is not None:
        overrides["checkpoint.resume"] = args.resume
    cfg = build_config(args.config or args.config_opt, overrides)
    if need_teacher and cfg.distill.teacher is None:
        raise UserError("orthros distill needs a teacher: set distill.teacher (a model directory) in the config "
                        "or with --distill.teacher")
    try:
        train(cfg)
    except NonFiniteLossError as e:
        print(f"orthros {'distill' if need_teacher else 'train'}: error: {e}", file=sys.stderr)
        return 3
    return 0
