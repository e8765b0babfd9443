"""Independent jobs (one per architecture) in parallel worker processes.

Training a model of a few million parameters on a GPU is bound by the host:
each step issues thousands of small kernels, and the GPU idles between them.
Several models trained side by side, one process each, fill it; each job is
seeded on its own, so its result does not depend on what runs beside it.
"""

from __future__ import annotations

import gc
import multiprocessing
import sys
import traceback
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, as_completed, wait

from ..errors import is_oom


def run_jobs(fn, jobs: list[tuple], workers: int = 1) -> list:
    """[fn(*job) for job in jobs], in `workers` spawned processes when > 1 (results in order).
    `fn` must be a module-level function; a job's exception is printed when it happens and the
    first (in job order) raised here once every job has ended."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if workers == 1 or len(jobs) <= 1:
        return [fn(*job) for job in jobs]
    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in forked children
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx) as pool:
        futures = [pool.submit(run_job, fn, *job) for job in jobs]
        for f in as_completed(futures):  # a failure is said when it happens, the others run on
            if f.exception() is not None:
                i = futures.index(f)
                _failed(f"#{i} ({jobs[i][0]})" if jobs[i] else f"#{i}", f.exception())
    return [f.result() for f in futures]


class JobsFailed(RuntimeError):
    """Jobs of a `run_after` call raised: `errors` {name: exception}; `done` holds what the other
    jobs returned (those that needed a failed job did not run: `skipped`); `report`: what the
    caller made of those (orthros experiment cpt: the finished arms' report)."""

    def __init__(self, errors: dict, done: dict, skipped: list):
        self.errors, self.done, self.skipped = errors, done, skipped
        self.report: dict | None = None
        lines = [f"{n}: {type(e).__name__}: {e}" for n, e in errors.items()]
        if skipped:
            lines.append(f"not run (they needed a failed job): {', '.join(skipped)}")
        super().__init__(f"{len(errors)} job(s) failed; {len(done)} finished\n  " + "\n  ".join(lines))


def run_job(fn, *args):
    """fn(*args) in a worker process, which then gives back the device memory the job cached. A worker
    outlives its job, and PyTorch's allocator keeps what a job freed reserved for its process: without
    this, a job run again alone after running out of memory (`run_after`) would meet the memory an idle
    worker still holds. A failed job's frames are cleared first, so that its tensors are free to go."""
    try:
        return fn(*args)
    except BaseException as e:
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        release_device_memory()


def release_device_memory() -> None:
    """Collect what is unreachable and hand this process's cached CUDA memory back to the device."""
    gc.collect()
    torch = sys.modules.get("torch")  # a job that never imported torch used no device
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _failed(name: str, err: BaseException) -> None:
    """A job's failure, said when it happens (not after the jobs beside it end)."""
    print(f"job {name} failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
    traceback.print_exception(err, file=sys.stderr)


def run_after(fn, jobs: dict, needs: dict, workers: int = 1) -> dict:
    """{name: fn(*jobs[name])}, each job started once the jobs it `needs` ({name: [names]})
    are done, up to `workers` at a time: a job that others wait for starts first, and the
    rest fill the workers beside it (no stage waits for its slowest job).

    A job that raises is reported at once (stderr); the jobs that need it are not run, the others
    go on, and `JobsFailed` (with what finished) is raised once they are done. A job that ran out of
    device memory while others ran beside it is run again once, alone, after every other job (`fn`
    should pick up what it saved: an experiment's arm keeps its trained weights)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    unknown = {d for ds in needs.values() for d in ds} - set(jobs)
    if unknown:
        raise ValueError(f"jobs wait for unknown jobs: {', '.join(sorted(unknown))}")
    waited_for = {d for ds in needs.values() for d in ds}
    order = sorted(jobs, key=lambda n: (n not in waited_for, list(jobs).index(n)))
    done: dict = {}
    errors: dict = {}
    running: dict = {}

    def blocked(n, seen=()):  # needs a failed job, directly or through another
        return any(d in errors or (d not in seen and blocked(d, (*seen, n))) for d in needs.get(n, ()))

    def ready():
        return [n for n in order if n not in done and n not in errors and n not in running
                and set(needs.get(n, ())) <= set(done)]

    def settle(n, call):
        try:
            done[n] = call()
        except Exception as e:  # noqa: BLE001 - reported now, raised with the others at the end
            errors[n] = e
            _failed(n, e)

    def left():
        return [n for n in order if n not in done and n not in errors and not blocked(n)]

    if workers == 1:
        while left():
            todo = ready()
            if not todo:
                raise ValueError("jobs wait for each other in a cycle")
            settle(todo[0], lambda: fn(*jobs[todo[0]]))
    else:
        held: list = []  # out of memory beside other jobs: run again alone, at the end
        shared, retried = set(), set()
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            while left():
                todo = [n for n in ready() if n not in held]
                if held and not todo and not running:
                    n = held.pop(0)
                    retried.add(n)
                    running[n] = pool.submit(run_job, fn, *jobs[n])
                elif not (running.keys() & retried):  # nothing starts beside a job run again alone
                    for n in todo[: workers - len(running)]:
                        running[n] = pool.submit(run_job, fn, *jobs[n])
                if len(running) > 1:
                    shared.update(running)
                if not running:
                    raise ValueError("jobs wait for each other in a cycle")
                finished, _ = wait(running.values(), return_when=FIRST_COMPLETED)
                for n, f in list(running.items()):
                    if f not in finished:
                        continue
                    del running[n]
                    err = f.exception()
                    if err is not None and is_oom(err) and n in shared and n not in retried:
                        held.append(n)
                        print(f"job {n} ran out of device memory beside other jobs: it runs again alone once "
                              "they end", file=sys.stderr, flush=True)
                        continue
                    settle(n, f.result)
    if errors:
        raise JobsFailed(errors, done, [n for n in order if n not in done and n not in errors])
    return done
