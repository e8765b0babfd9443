"""Deterministic, resumable batches with a background thread, so the GPU never waits.

Step `s` of a run reads the global batch `s` of a fixed schedule: each
epoch is a seeded permutation of the packed rows, cut into global batches
of `G = micro_batch * grad_accum * world_size` rows (the tail is dropped).
Rank `r` takes its own contiguous share, split into `grad_accum`
micro-batches. The schedule depends only on (rows, G, seed), so the data
position is one integer (steps consumed) and resuming, or changing the
number of processes at the same global batch, reads the same rows.
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import torch

from .packing import PackedRows


class BatchLoader:
    def __init__(self, rows: PackedRows, micro_batch: int, grad_accum: int = 1, rank: int = 0, world: int = 1,
                 seed: int = 0, prefetch: int = 4, pin_memory: bool = False):
        self.rows, self.B, self.A, self.rank, self.world = rows, micro_batch, grad_accum, rank, world
        self.G = micro_batch * grad_accum * world
        if len(rows) < self.G:
            raise ValueError(f"the training data packs into {len(rows)} rows of {rows.seq_len} tokens, fewer than "
                             f"one global batch of {self.G} rows (train.batch_size={micro_batch} x "
                             f"train.grad_accum={grad_accum} x {world} processes); add data or lower them")
        self.steps_per_epoch = len(rows) // self.G
        self.seed, self.prefetch, self.pin = seed, prefetch, pin_memory
        self.step = 0  # global batches handed out
        self.wait_s = 0.0  # time the consumer spent blocked on the queue
        self._epoch_perm: tuple[int, np.ndarray] | None = None
        self._q: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # --------------------------------------------------------------- schedule
    def _perm(self, epoch: int) -> np.ndarray:
        if self._epoch_perm is None or self._epoch_perm[0] != epoch:
            self._epoch_perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.rows)))
        return self._epoch_perm[1]

    def make_step(self, step: int) -> tuple[list[dict[str, np.ndarray]], int]:
        """This rank's micro-batches of global batch `step` (numpy), and their target count.

        Only numpy here: this runs in the loader thread, which thus never
        touches torch state; `next` makes the tensors in the caller's thread."""
        epoch, k = divmod(step, self.steps_per_epoch)
        share = self.B * self.A
        start = k * self.G + self.rank * share
        idx = self._perm(epoch)[start : start + share]
        micro = [self.rows.arrays(idx[i * self.B : (i + 1) * self.B]) for i in range(self.A)]
        return micro, sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in micro)

    def _tensors(self, item):
        micro, n = item
        micro = [{k: torch.from_numpy(v) for k, v in mb.items()} for mb in micro]
        if self.pin:
            micro = [{k: v.pin_memory() for k, v in mb.items()} for mb in micro]
        return micro, n

    # ---------------------------------------------------------------- threads
    def _produce(self, first: int) -> None:
        s = first
        while not self._stop.is_set():
            item = self.make_step(s)
            while not self._stop.is_set():
                try:
                    self._q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            s += 1

    def next(self) -> tuple[list[dict[str, torch.Tensor]], int]:
        if self.prefetch <= 0:
            item = self.make_step(self.step)
        else:
            if self._thread is None:
                self._q = queue.Queue(maxsize=self.prefetch)
                self._stop.clear()
                self._thread = threading.Thread(target=self._produce, args=(self.step,), daemon=True)
                self._thread.start()
            t = time.perf_counter()
            item = self._q.get()
            self.wait_s += time.perf_counter() - t
        self.step += 1
        return self._tensors(item)

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"step": self.step, "rows": len(self.rows), "global_batch": self.G, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("rows", len(self.rows)), ("global_batch", self.G), ("seed", self.seed)):
            if state.get(key) != mine:
                raise ValueError(f"cannot resume the data position: the checkpoint's {key} was {state.get(key)}, "
                                 f"this run has {mine} (same data, global batch and seed are needed)")
        self.close()
        self.step = int(state["step"])
