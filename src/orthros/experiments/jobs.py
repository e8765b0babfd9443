"""Independent jobs (one per architecture) in parallel worker processes.

Training a model of a few million parameters on a GPU is bound by the host:
each step issues thousands of small kernels, and the GPU idles between them.
Several models trained side by side, one process each, fill it; each job is
seeded on its own, so its result does not depend on what runs beside it.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor


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
