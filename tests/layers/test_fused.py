"""The fused (compiled) elementwise ops compute what the eager ones do: forward and gradients."""

import pytest
import torch

from orthros.layers import fused
from tests.conftest import DEVICE, make_model, rel_err


def _grads(model, ids, labels):
    model.zero_grad()
    out = model(ids, labels=labels)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("qk_norm", [False, True])
def test_fused_model_matches_eager(monkeypatch, qk_norm):
    model = make_model("orthros", window=8, qk_norm=qk_norm)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=g).to(DEVICE)
    monkeypatch.setenv("ORTHROS_FUSED", "0")
    ref_logits, ref_grads = _grads(model, ids, ids)
    monkeypatch.setenv("ORTHROS_FUSED", "1")
    logits, grads = _grads(model, ids, ids)
    assert rel_err(logits, ref_logits) < 1e-5
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        assert rel_err(grads[n], ref_grads[n]) < 1e-4, n


def test_fusion_applies_only_to_large_cuda_inputs(monkeypatch):
    monkeypatch.delenv("ORTHROS_FUSED", raising=False)
    calls = []
    monkeypatch.setattr(fused, "_compiled", lambda fn: calls.append(fn) or fn)
    x, w = torch.randn(4, 8), torch.ones(8)
    fused.fused_rms_norm(x, w, 1e-6)
    assert calls == []  # CPU: eager
    monkeypatch.setenv("ORTHROS_FUSED", "1")
    fused.fused_rms_norm(x, w, 1e-6)
    assert calls == [fused.rms_norm]
    monkeypatch.setenv("ORTHROS_FUSED", "0")
    fused.fused_rms_norm(x, w, 1e-6)
    assert len(calls) == 1
