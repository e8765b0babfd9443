"""Independent jobs (one per architecture) in parallel worker processes.

Training a model of a few million parameters on a GPU is bound by the host:
each step issues thousands of small kernels, and the GPU idles between them.
Several models trained side by side, one process each, fill it; each job is
seeded on its own, so its result does not depend on what runs beside it.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait


def run_jobs(fn, jobs: list[tuple], workers: int = 1) -> list:
    """[fn(*job) for job in jobs], in `workers` spawned processes when > 1 (results in order).
    `fn` must be a module-level function; a job's exception is raised here."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if workers == 1 or len(jobs) <= 1:
        return [fn(*job) for job in jobs]
    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in forked children
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx) as pool:
        futures = [pool.submit(fn, *job) for job in jobs]
        return [f.result() for f in futures]


def run_after(fn, jobs: dict, needs: dict, workers: int = 1) -> dict:
    """{name: fn(*jobs[name])}, each job started once the jobs it `needs` ({name: [names]})
    are done, up to `workers` at a time: a job that others wait for starts first, and the
    rest fill the workers beside it (no stage waits for its slowest job)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    unknown = {d for ds in needs.values() for d in ds} - set(jobs)
    if unknown:
        raise ValueError(f"jobs wait for unknown jobs: {', '.join(sorted(unknown))}")
    waited_for = {d for ds in needs.values() for d in ds}
    order = sorted(jobs, key=lambda n: (n not in waited_for, list(jobs).index(n)))
    done: dict = {}

    def ready():
        return [n for n in order if n not in done and n not in running and set(needs.get(n, ())) <= set(done)]

    running: dict = {}
    if workers == 1:
        while len(done) < len(jobs):
            todo = ready()
            if not todo:
                raise ValueError("jobs wait for each other in a cycle")
            done[todo[0]] = fn(*jobs[todo[0]])
        return done
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        while len(done) < len(jobs):
            for n in ready()[: workers - len(running)]:
                running[n] = pool.submit(fn, *jobs[n])
            if not running:
                raise ValueError("jobs wait for each other in a cycle")
            finished, _ = wait(running.values(), return_when=FIRST_COMPLETED)
            for n, f in list(running.items()):
                if f in finished:
                    done[n] = f.result()
                    del running[n]
    return done
