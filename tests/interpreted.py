"""One Python per test worker with TRITON_INTERPRET=1, for the kernel case modules (`tests/**/*_cases.py`).

The flag must be set before `import triton`, so the cases cannot run in pytest's own process. Starting a
Python for each case paid torch's and transformers' import (about 5 s) every time; this process pays it
once and then runs each case module as `python -m` would (`__name__ == "__main__"`, `sys.argv` set).
Between cases it puts back what a case may change and the next one could read: the environment, torch's
default dtype and device, its global random state (each case starts from the worker's first) and the
split-KV op's study switches.

Protocol (`conftest.run_triton_interpreted` speaks it): a JSON line on stdin, `{"argv": ["-m", module,
*args]}`; a JSON line back on the original stdout, `{"rc", "stdout", "stderr"}`. Output written straight to
the file descriptors (C code) goes to the process's stderr, which the caller keeps in a file.
"""

import contextlib
import io
import json
import os
import runpy
import sys
import traceback


def _state():
    import torch

    return dict(environ=dict(os.environ), dtype=torch.get_default_dtype(), rng=torch.get_rng_state())


def _restore(state) -> None:
    import torch

    os.environ.clear()
    os.environ.update(state["environ"])
    torch.set_default_dtype(state["dtype"])
    torch.set_default_device(None)
    torch.set_rng_state(state["rng"])
    torch.set_grad_enabled(True)
    if "orthros.ops.splitkv.common" in sys.modules:  # the study switches live there
        from orthros.ops.splitkv.study import from_environment

        from_environment(state["environ"])


def run_case(argv: list[str]) -> dict:
    """`python -m module *args` in this process: its exit status and what it printed."""
    if len(argv) < 2 or argv[0] != "-m":
        return dict(rc=2, stdout="", stderr=f"only `-m module [args]` runs here, got {argv}")
    out, err = io.StringIO(), io.StringIO()
    state = _state()
    rc = 0
    saved_argv = sys.argv
    sys.argv = [argv[1], *argv[2:]]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except BaseException:  # noqa: BLE001 - a failed case is reported, the worker lives on
                traceback.print_exc()
                rc = 1
    finally:
        sys.argv = saved_argv
        _restore(state)
    return dict(rc=rc, stdout=out.getvalue(), stderr=err.getvalue())


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray writes to fd 1 must not break the protocol
    sys.stdout = sys.__stdout__ = os.fdopen(1, "w", closefd=False)
    for line in sys.stdin:
        if line.strip():
            replies.write(json.dumps(run_case(json.loads(line)["argv"])) + "\n")
            replies.flush()


if __name__ == "__main__":
    main()
