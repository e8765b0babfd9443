"""User mistakes end in one line, `orthros CMD: error: FILE: PROBLEM`, and exit code 2.

The loaders check what they read (model directories, configs, corpora) and
raise `UserError` naming the file. `user_message` also recognises the few
library exceptions that reach the command line with a user's file behind
them: an OSError carrying a filename, a JSON / YAML syntax error, a damaged
safetensors file. Anything else is a bug and keeps its traceback.

    ORTHROS_DEBUG=1 orthros generate runs/x --prompt hi    # or: orthros --debug generate ...

shows the traceback of a user error too (for developers).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

DEBUG_ENV = "ORTHROS_DEBUG"


class UserError(ValueError):
    """A mistake in the user's input (a file, a flag, a config value): one line, exit code 2.

    A ValueError, so library callers catching ValueError see it as before."""


class Unsupported(UserError, NotImplementedError):
    """A valid request for something not built yet (a model feature a cache does not keep): one line,
    exit code 2, as a UserError; a NotImplementedError to library callers."""


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def one_line(text: str) -> str:
    """Newlines of a multi-line message (YAML, transformers) folded into one line."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def user_message(e: BaseException) -> str | None:
    """The one-line message for an exception caused by the user's input; None for a bug."""
    if type(e).__name__ == "SafetensorError":  # raised by the Rust extension; normally caught by the loaders
        return one_line(f"damaged safetensors file ({e})")
    if isinstance(e, json.JSONDecodeError):
        return one_line(f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})")
    if isinstance(e, UnicodeDecodeError):
        return one_line(f"not UTF-8 text (byte {e.object[e.start:e.start + 1]!r} at offset {e.start})")
    if isinstance(e, (UserError, ValueError)):
        return one_line(str(e))
    if isinstance(e, OSError):  # FileNotFoundError, PermissionError, IsADirectoryError, a full disk, ...
        if e.filename is not None:
            return one_line(f"{e.filename}: {e.strerror or e}")
        return one_line(str(e))
    if type(e).__module__.startswith("yaml"):  # yaml.YAMLError, without importing yaml here
        return one_line(str(e))
    return None


def read_json(path: str | Path, what: str = "JSON file"):
    """The parsed JSON of `path`; UserError naming the file if it is missing, not UTF-8 or not JSON."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: no such {what}" if not p.exists() else f"{p}: not a file")
    try:
        return json.loads(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(f"{p}: not a {what} (not UTF-8 text: byte {e.object[e.start:e.start + 1]!r} at offset "
                        f"{e.start})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{p}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None


def check_output_dir(path: str | Path, flag: str) -> Path:
    """A directory the command will write into: fine if missing (it is created) or a directory."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UserError(f"{p}: {flag} must be a directory, but a file of that name exists")
    return p


def is_oom(err: BaseException) -> bool:
    """Whether an exception says a device ran out of memory (torch.OutOfMemoryError, also after it
    crossed a process boundary, or its message)."""
    return type(err).__name__ == "OutOfMemoryError" or "out of memory" in str(err).lower()


class CountError(UserError, argparse.ArgumentTypeError):
    """A count or amount out of its range, or not a number at all: the parser's one-line error for a flag's
    value, a UserError where the value is read later (a length inside `bench serve --long-cases`)."""


def check_count(n: int, least: int, most: int | None = None) -> int:
    """n if it lies in [least, most], else CountError (`must be >= 0 and <= 65535, got 99999`)."""
    if n < least or (most is not None and n > most):
        raise CountError(f"must be >= {least}" + (f" and <= {most}" if most is not None else "") + f", got {n}")
    return n


def count_arg(least: int, most: int | None = None):
    """An argparse type for a count a flag takes: a whole number in [least, most], else the parser's
    one-line error (`argument --port: must be >= 0 and <= 65535, got 99999`)."""
    def parse(s: str) -> int:
        try:
            n = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"a whole number, not {s!r}") from None
        return check_count(n, least, most)
    return parse


def number_arg(above: float | None = None, least: float | None = None, most: float | None = None):
    """An argparse type for a number a flag takes: finite, > `above`, >= `least`, <= `most` (those given), else
    the parser's one-line error (`argument --top-p: must be > 0 and <= 1, got 2`)."""
    bounds = [(f"> {above:g}", lambda x: x > above) if above is not None else None,
              (f">= {least:g}", lambda x: x >= least) if least is not None else None,
              (f"<= {most:g}", lambda x: x <= most) if most is not None else None]
    bounds = [b for b in bounds if b]

    def parse(s: str) -> float:
        try:
            x = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"a number, not {s!r}") from None
        if not (math.isfinite(x) and all(ok(x) for _, ok in bounds)):
            raise CountError(f"must be {' and '.join(b for b, _ in bounds) or 'finite'}, got {s}")
        return x
    return parse


# an amount a flag takes (seconds, a rate, a bandwidth, GiB): `argument --seconds: must be > 0, got -5`
positive_arg = number_arg(above=0)
