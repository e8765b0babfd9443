"""`orthros` command line: one subcommand per module, each a plain function.

A subcommand module defines `add_arguments(parser)` and `run(args)`; list it
in COMMANDS. Help text comes from the module docstring's first line.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "demo": "orthros.demo",
    "generate": "orthros.generate_cli",
    "convert": "orthros.convert.cli",
    "eval-harness": "orthros.eval.lm_eval_cli",
    "train": "orthros.train.cli",
    "bench": "orthros.bench.cli",
    "eval": "orthros.eval.cli",
    "experiment": "orthros.experiments.cli",
    "serve": "orthros.serve.cli",
}


class UserError(Exception):
    """A mistake in the user's input: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orthros", description="Orthros attention: train, convert, evaluate, benchmark.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, path in COMMANDS.items():
        mod = importlib.import_module(path)
        doc = (mod.__doc__ or "").strip().splitlines()
        p = sub.add_parser(name, help=doc[0] if doc else None, description=(mod.__doc__ or "").strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args._run(args) or 0
    except (UserError, ValueError, FileNotFoundError) as e:
        print(f"orthros {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"orthros {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
