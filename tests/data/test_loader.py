"""The batch schedule: deterministic, resumable, split across processes without overlap."""

import pytest
import torch

from orthros.data.loader import BatchLoader
from orthros.data.packing import pack_documents


def rows(n=40, T=8):
    return pack_documents([list(range(i, i + 5)) for i in range(n)], seq_len=T)


def ids(micro):
    return torch.cat([mb["input_ids"] for mb in micro]).tolist()


def test_ranks_split_the_single_process_batch():
    r = rows()
    one = BatchLoader(r, micro_batch=4, grad_accum=2, prefetch=0)
    ranks = [BatchLoader(r, micro_batch=2, grad_accum=2, rank=k, world=2, prefetch=0) for k in range(2)]
    for _ in range(7):  # crosses an epoch boundary (25 rows // 8 = 3 steps per epoch)
        a, _ = one.next()
        parts = [ld.next()[0] for ld in ranks]
        assert sorted(ids(a)) == sorted(ids(parts[0]) + ids(parts[1]))
        assert not set(map(tuple, ids(parts[0]))) & set(map(tuple, ids(parts[1])))


def test_prefetch_thread_resume_and_wait_time():
    r = rows()
    plain = BatchLoader(r, 3, prefetch=0, seed=5)
    threaded = BatchLoader(r, 3, prefetch=3, seed=5)
    seq = [ids(plain.next()[0]) for _ in range(10)]
    assert [ids(threaded.next()[0]) for _ in range(10)] == seq
    assert threaded.wait_s >= 0
    threaded.close()
    resumed = BatchLoader(r, 3, prefetch=2, seed=5)
    plain2 = BatchLoader(r, 3, prefetch=0, seed=5)
    for _ in range(4):
        plain2.next()
    resumed.load_state_dict(plain2.state_dict())
    assert [ids(resumed.next()[0]) for _ in range(6)] == seq[4:]
    resumed.close()
    with pytest.raises(ValueError, match="global_batch"):
        BatchLoader(r, 2, prefetch=0, seed=5).load_state_dict(plain2.state_dict())


def test_targets_counted_and_too_small():
    r = rows()
    micro, n = BatchLoader(r, 2, grad_accum=2, prefetch=0).next()
    assert n == sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in micro) > 0
    with pytest.raises(ValueError, match="fewer than one global batch"):
        BatchLoader(r, micro_batch=len(r) + 1)
