"""`serve/step_log.py` on CUDA's path, with stand-in events (the engine's own step log on a CPU:
`test_engine.py::test_step_log_records_every_step`): a step's line is written once the device has
passed its end, in step order, timed and placed by the events, never by synchronizing before then."""

import json

import torch

from orthros.serve import step_log as step_log_module
from orthros.serve.step_log import StepLog


class Clock:
    """A stand-in device: `now`, the ms of work it has done; `queued`, the ms of work queued on it (an
    event recorded now is reached when `now` gets there); `syncs`, the waits for an event."""

    def __init__(self):
        self.now, self.queued, self.syncs = 0.0, 0.0, 0


def events(clock: Clock):
    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = clock.queued  # reached once the device's time passes it

        def query(self):
            return clock.now >= self.at

        def synchronize(self):
            clock.syncs += 1
            clock.now = max(clock.now, self.at)

        def elapsed_time(self, other):
            return other.at - self.at

    return Event


def test_lines_wait_for_the_device_and_keep_step_order(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(step_log_module.torch.cuda, "Event", events(clock))
    monkeypatch.setattr(step_log_module.torch.cuda, "synchronize", lambda device=None: None)
    path = tmp_path / "steps.jsonl"
    log = StepLog(str(path), torch.device("cuda"), origin=step_log_module.time.perf_counter())

    def lines():
        return [json.loads(x) for x in path.read_text().splitlines()]

    for step, ms in ((1, 190.0), (2, 185.0), (3, 20.0)):
        mark = log.begin()
        clock.queued += ms  # the step's work, queued behind the earlier steps'
        log.end({"step": step, "decode": 0}, mark)
    assert lines() == [] and clock.syncs == 1  # the device is at 0 ms: nothing written, nothing waited for
    clock.now = 200.0  # past step 1's end, not step 2's
    log.flush()
    (one,) = lines()
    assert one["step"] == 1 and one["ms"] == 190.0 and list(one)[:3] == ["step", "t", "ms"]
    log.close()  # waits for the rest
    got = lines()
    assert [r["step"] for r in got] == [1, 2, 3] and [r["ms"] for r in got] == [190.0, 185.0, 20.0]
    t = [r["t"] for r in got]
    # placed where the device ran them: each starts where the one before it ended
    assert abs((t[1] - t[0]) - 0.190) < 1e-6 and abs((t[2] - t[1]) - 0.185) < 1e-6
    assert clock.syncs == 3  # at close, one wait for each step the device had not finished (2 and 3)
