"""Jobs in worker processes return what the same calls return in-process, in order."""

import pytest

from orthros.experiments.jobs import run_jobs


def _square_plus(x, y):
    if x < 0:
        raise ValueError("negative")
    return x * x + y


def test_parallel_matches_serial():
    jobs = [(i, 10 * i) for i in range(5)]
    assert run_jobs(_square_plus, jobs, workers=2) == run_jobs(_square_plus, jobs, workers=1) == [
        i * i + 10 * i for i in range(5)]


def test_errors_reach_the_caller():
    with pytest.raises(ValueError, match="negative"):
        run_jobs(_square_plus, [(1, 0), (-1, 0)], workers=2)
    with pytest.raises(ValueError, match="workers"):
        run_jobs(_square_plus, [(1, 0)], workers=0)
