"""`orthros` command line: one subcommand per module, each a plain function.

A subcommand module defines `add_arguments(parser)` and `run(args)`; list it
in COMMANDS. Help text comes from the module docstring's first line.

A user's mistake (orthros.errors) ends in one line, `orthros CMD: error: ...`,
and exit code 2; `--debug` or ORTHROS_DEBUG=1 shows its traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .errors import UserError, debug_enabled, user_message  # noqa: F401  (UserError: cli.UserError, as before)

COMMANDS = {
    "demo": "orthros.demo",
    "generate": "orthros.generate_cli",
    "download": "orthros.convert.download",
    "convert": "orthros.convert.cli",
    "extract-adapter": "orthros.convert.extract",
    "eval-harness": "orthros.eval.lm_eval_cli",
    "train": "orthros.train.cli",
    "distill": "orthros.train.distill_cli",
    "bench": "orthros.bench.cli",
    "eval": "orthros.eval.cli",
    "experiment": "orthros.experiments.cli",
    "serve": "orthros.serve.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orthros", description="Orthros attention: train, convert, evaluate, benchmark.")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of a user error too (same as ORTHROS_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, path in COMMANDS.items():
        mod = importlib.import_module(path)
        doc = (mod.__doc__ or "").strip().splitlines()
        p = sub.add_parser(name, help=doc[0] if doc else None, description=(mod.__doc__ or "").strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run, _parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if extra:  # said by the command's own parser, with its usage (`orthros generate: error: ...`)
        args._parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args._run(args) or 0
    except KeyboardInterrupt:
        print(f"orthros {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`orthros ... | head`): no error, as any Unix tool
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:
        msg = user_message(e)
        if msg is None or args.debug or debug_enabled():  # a bug, or a developer asking for the traceback
            raise
        print(f"orthros {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
