"""`ops.tracing.exporting`: True under torch.export only. torch.compile must keep the kernels: Dynamo in
torch 2.11 answers `torch.compiler.is_exporting()` with True inside every trace, and a compiled decode step
then ran the reference attention over a whole low-bit cache."""

import torch
from torch import nn

from orthros.ops.tracing import exporting


def _plus_one_if_exporting(x):
    return x + (1 if exporting() else 0)


class _Probe(nn.Module):
    def forward(self, x):
        return _plus_one_if_exporting(x)


def test_exporting_is_false_in_eager_and_compiled_code_and_true_under_export():
    x = torch.zeros(2)
    assert not exporting()
    assert _plus_one_if_exporting(x).sum() == 0
    assert torch.compile(_plus_one_if_exporting, backend="eager", fullgraph=True)(x).sum() == 0
    ep = torch.export.export(_Probe(), (x,))
    assert ep.module()(x).sum() == 2


def test_a_public_flag_folded_to_true_does_not_make_a_compiled_step_an_export(monkeypatch):
    # what Dynamo in torch 2.11 answers for is_exporting() inside torch.compile's trace
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    assert not exporting()
    from orthros.ops.splitkv import common

    monkeypatch.setattr(common, "interpreting", lambda: True)  # the kernel's CPU twin, as on a GPU
    monkeypatch.setattr(common, "triton_available", lambda: True)
    q = torch.zeros(1, 2, 4, 8)
    assert common.splitkv_takes(q, 2, "triton")
    monkeypatch.setattr(torch.compiler, "_is_exporting_flag", True)  # torch.export's own flag
    assert exporting() and not common.splitkv_takes(q, 2, "triton")
