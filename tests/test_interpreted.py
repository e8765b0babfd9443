"""The one interpreted Python a test worker runs its kernel case modules in (tests/interpreted.py):
each case sees what a fresh `python -m` would, and a case that fails, dies or hangs is reported as such."""

import subprocess

import pytest

from .conftest import _Interpreted


@pytest.fixture
def worker():
    w = _Interpreted()
    yield w
    w.close()


def run(worker, what, timeout=120):
    return worker.run(["-m", "tests.interpreted_probe", what], timeout)


def test_cases_share_one_process_but_not_its_state(worker):
    first = run(worker, "pid")
    assert first.returncode == 0 and run(worker, "pid").stdout == first.stdout
    assert run(worker, "env").stdout == "unseen\n"
    assert run(worker, "env").stdout == "unseen\n"  # the first case's variable is gone
    assert run(worker, "rng").stdout == run(worker, "rng").stdout  # each case starts from one random state


def test_failures_are_reported_and_the_worker_goes_on(worker):
    r = run(worker, "exit")
    assert r.returncode == 3 and r.stdout == "before\n"
    r = run(worker, "raise")
    assert r.returncode == 1 and "ValueError: a failed check" in r.stderr
    r = run(worker, "fd")
    assert r.returncode == 0 and r.stdout == "ok\n" and "stray" in r.stderr
    assert worker.run(["-c", "print(1)"], 60).returncode == 2  # case modules only


def test_a_case_that_dies_or_hangs(worker):
    pid = run(worker, "pid").stdout
    assert run(worker, "die").returncode == 5
    assert run(worker, "pid").stdout != pid  # started again
    with pytest.raises(subprocess.TimeoutExpired):
        run(worker, "sleep", timeout=2)
    assert run(worker, "pid").returncode == 0
