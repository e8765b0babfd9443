"""The communication of context parallelism: shards, halos, log-sum-exp merges.

A prompt of T tokens is cut into contiguous shards, one per rank of a
context-parallel (CP) group. Two patterns move data between ranks:

    halo_exchange — a rank's base-stream queries see keys up to W - 1 slots
                    before its shard; they live on the previous rank, or on
                    several previous ranks when shards are shorter than
                    W - 1. Each earlier rank sends exactly the slice a later
                    rank needs (point-to-point, one message per pair). With
                    no window (the full-attention baseline) the halo is the
                    whole prefix: an all-gather written as point-to-point.
    gather_merge  — every rank attends the same few queries to its own keys
                    and returns (o, lse); one all-gather of [B, M, H, D + 1]
                    and a log-sum-exp merge give every rank the exact output

                        lse = logsumexp_r lse_r,  o = sum_r exp(lse_r - lse) o_r

`spawn` runs a function on N local processes (gloo on CPU, NCCL on GPUs)
without torchrun: tests and CPU checks of the benchmark use it.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ops.lse import lse_merge

# torch >= 2.13 renames all_gather_into_tensor (same arguments)
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CPGroup:
    """This process's place in a context-parallel group.

    group: the process group (None = the default, whole world).
    bounds: [(start, end)] of every rank's shard of the current prompt,
        set by `with_shards`; global slots, contiguous, in rank order.
    """

    group: object = None
    bounds: tuple = ()

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    @property
    def last(self) -> bool:
        return self.rank == self.world - 1

    def global_rank(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def with_shards(self, bounds) -> "CPGroup":
        return CPGroup(self.group, tuple(bounds))


def shard_bounds(T: int, world: int, sizes=None) -> list[tuple[int, int]]:
    """Contiguous [start, end) per rank. Default: as even as possible (the first
    T % world ranks get one token more); `sizes` (one int >= 1 per rank) sets them."""
    if sizes is None:
        if T < world:
            raise ValueError(f"a prompt of {T} tokens cannot be split over {world} ranks (need >= 1 token each)")
        sizes = [T // world + (r < T % world) for r in range(world)]
    sizes = [int(s) for s in sizes]
    if len(sizes) != world or any(s < 1 for s in sizes) or sum(sizes) != T:
        raise ValueError(f"shard_sizes must be {world} integers >= 1 summing to the prompt length {T}, got {sizes}")
    ends = torch.tensor(sizes).cumsum(0).tolist()
    return [(e - s, e) for s, e in zip(sizes, ends)]


def balanced_bounds(T: int, world: int, crossover: float) -> list[tuple[int, int]]:
    """Contiguous shards of equal estimated cost when a token at position t costs
    1 + t / crossover (linear layers + causal attention over t keys): the shards of a
    full-attention Transformer get shorter towards the end. crossover = inf gives
    even shards (Orthros: every token costs the same)."""
    if crossover == float("inf"):
        return shard_bounds(T, world)
    cost = lambda t: t + t * t / (2 * crossover)  # cumulative cost of positions [0, t)
    total, cuts = cost(T), [0]
    for r in range(1, world):
        lo, hi = cuts[-1] + 1, T - (world - r)
        want = total * r / world
        while lo < hi:  # first t with cost(t) >= want
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if cost(mid) < want else (lo, mid)
        cuts.append(lo)
    cuts.append(T)
    return shard_bounds(T, world, [b - a for a, b in zip(cuts, cuts[1:])])


def halo_exchange(xs, cp: CPGroup, span: int | None):
    """The `span` slots before this rank's shard (all earlier slots if None).

    xs: tensors [B, n, *, d_i] of this rank's shard (n = its shard length), e.g. (k, v);
        they travel packed in one message per pair of ranks.
    Returns the same tuple of [B, h, *, d_i] with h = min(span, start): global slots
    [start - h, start), gathered from as many earlier ranks as they span.
    """
    xs = tuple(xs)
    bounds, r = cp.bounds, cp.rank
    a, b = bounds[r]
    splits = [x.shape[-1] for x in xs]
    lo = 0 if span is None else max(0, a - span)
    sends = []  # (later rank, first global slot it needs from this shard)
    for q in range(r + 1, cp.world):
        s = max(0 if span is None else bounds[q][0] - span, a)
        if s < b:
            sends.append((q, s))
    recvs = [(p, max(lo, bounds[p][0]), bounds[p][1]) for p in range(r) if max(lo, bounds[p][0]) < bounds[p][1]]
    ops, bufs = [], []
    if sends:
        first = min(s for _, s in sends)
        packed = torch.cat([x[:, first - a:] for x in xs], dim=-1)  # only the tail anyone needs
        for q, s in sends:
            ops.append(dist.P2POp(dist.isend, packed[:, s - first:].contiguous(), cp.global_rank(q), cp.group))
    ref = xs[0]
    for p, s, e in recvs:
        buf = ref.new_empty((ref.shape[0], e - s, *ref.shape[2:-1], sum(splits)))
        bufs.append(buf)
        ops.append(dist.P2POp(dist.irecv, buf, cp.global_rank(p), cp.group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    if not bufs:
        return tuple(x[:, :0] for x in xs)
    halo = torch.cat(bufs, dim=1) if len(bufs) > 1 else bufs[0]
    return tuple(halo.split(splits, dim=-1))


def gather_merge(o: torch.Tensor, lse: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """Merge every rank's partial attention (o [B, M, H, D], lse [B, M, H]) into the
    exact output [B, M, H, D] (fp32), identical on every rank: one all-gather."""
    part = torch.cat([o.float(), lse.float()[..., None]], dim=-1).contiguous()
    if cp.world == 1:
        return part[..., :-1]
    parts = part.new_empty((cp.world * part.shape[0], *part.shape[1:]))  # rank-concatenated on dim 0
    all_gather(parts, part, group=cp.group)
    parts = parts.view(cp.world, *part.shape)
    return lse_merge(parts[..., :-1], parts[..., -1])[0]


# ------------------------------------------------------------------- launching
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, backend: str, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, world: int, *args, backend: str = "gloo", start_method: str = "spawn"):
    """Run fn(rank, world, *args) on `world` local processes in one process group
    (what torchrun does, without a launcher). fn must be importable (module level).
    start_method="fork" skips re-importing torch in every child (CPU only)."""
    import torch.multiprocessing as mp

    mp.start_processes(_entry, args=(world, free_port(), backend, fn, args), nprocs=world, join=True,
                       start_method=start_method)


def init_from_env(device: str = "auto") -> tuple[CPGroup, torch.device]:
    """Join the torchrun group (RANK / WORLD_SIZE / LOCAL_RANK), NCCL on GPUs, gloo on CPU."""
    use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        if not torch.cuda.is_available():
            raise ValueError("device is cuda but no CUDA device is available")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=dev if use_cuda else None)
    return CPGroup(), dev
