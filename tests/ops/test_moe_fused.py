"""The fused MoE decode step (`ops.moe`) against the loop over experts, the cases of moe_cases.py
under TRITON_INTERPRET=1 on CPU (on a GPU: `python -m tests.ops.moe_cases`)."""

import pytest

from ..conftest import run_triton_interpreted
from .moe_cases import CASES


@pytest.mark.parametrize("case", list(CASES))
def test_fused_moe_triton_interpreter(case):
    r = run_triton_interpreted("-m", "tests.ops.moe_cases", case, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr[-3000:]


def test_segments_are_runs_of_one_expert():
    """The device-side sort: each segment one expert, starts and counts covering every pair once."""
    import torch

    from orthros.ops.moe import _segments

    experts = torch.tensor([[3, 1], [1, 0], [3, 2], [0, 1]])
    weights = torch.rand(4, 2)
    e, rows, w, order, start, count = _segments(weights, experts)
    assert e.tolist() == sorted(experts.flatten().tolist())
    assert count.tolist() == [2, 3, 1, 2, 0, 0, 0, 0]
    assert start[:4].tolist() == [0, 2, 5, 6]
    assert torch.equal(rows.long(), order // 2) and torch.equal(w, weights.flatten()[order])
