"""The engine's step log (`orthros serve --step-log PATH`): one JSON line per step.

A step's time is measured without synchronizing the device: on CUDA two events bracket the
work the step queued, and its line is written once the device has passed the second (at a
later step, when the engine goes idle, or at `close`). So logging does not stop the host
from preparing the next step while the device runs this one. `t` is when the device reached
the step (seconds on the engine's clock, through an event recorded when the log was opened,
with the device idle) and `ms` the device's time from there to the step's end: a step the
host queued ahead is placed where it ran. On a CPU the work is done when the step returns:
`t` is its start and `ms` its wall time.
"""

from __future__ import annotations

import collections
import json
import time

import torch


class StepLog:
    def __init__(self, path: str, device: torch.device, origin: float):
        """`origin`: the engine's clock's zero (a `time.perf_counter()` value)."""
        try:
            self.file = open(path, "a", buffering=1)  # line-buffered: a line written is not lost
        except OSError as e:
            raise ValueError(f"cannot write the step log {path}: {e.strerror}") from None
        self.cuda, self.origin = device.type == "cuda", origin
        self.pending: collections.deque = collections.deque()  # (record, start event, end event)
        if self.cuda:  # the device's clock, tied to the host's while the device is idle
            torch.cuda.synchronize(device)
            self.ref = torch.cuda.Event(enable_timing=True)
            self.ref.record()
            self.ref.synchronize()
            self.t_ref = time.perf_counter() - origin

    def begin(self):
        """A mark at the start of a step (before it queues work): its host time and, on CUDA, an event."""
        ev = None
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        return time.perf_counter(), ev

    def end(self, rec: dict, mark) -> None:
        """Log the step begun at `mark` with `rec` (`t` and `ms` filled in here), once its work is done."""
        t0, start = mark
        if start is None:
            self._write(rec, t0 - self.origin, (time.perf_counter() - t0) * 1e3)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pending.append((rec, start, end))
        self.flush()

    def flush(self, wait: bool = False) -> None:
        """Write the pending lines whose steps the device has finished (all of them if `wait`), in order."""
        while self.pending:
            rec, start, end = self.pending[0]
            if not end.query():
                if not wait:
                    return
                end.synchronize()
            self.pending.popleft()
            self._write(rec, self.t_ref + self.ref.elapsed_time(start) / 1e3, start.elapsed_time(end))

    def _write(self, rec: dict, t: float, ms: float) -> None:
        self.file.write(json.dumps({"step": rec["step"], "t": round(t, 6), "ms": round(ms, 3), **rec}) + "\n")

    def close(self) -> None:
        self.flush(wait=True)
        self.file.close()
