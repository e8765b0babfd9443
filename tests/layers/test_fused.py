"""The fused (compiled) elementwise ops compute what the eager ones do: forward and gradients."""

import pytest
import torch

from orthros.layers import fused
from tests.conftest import DEVICE, make_model, rel_err, run_triton_interpreted


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


def test_add_norm_matches_add_then_norm(monkeypatch):
    monkeypatch.setenv("ORTHROS_FUSED", "1")
    x, r, w = torch.randn(3, 5, 16), torch.randn(3, 5, 16), torch.randn(16)
    h, y = fused.fused_add_rms_norm(x, r, w, 1e-6)
    assert rel_err(h, x + r) < 1e-6 and rel_err(y, fused.rms_norm(x + r, w, 1e-6)) < 1e-6


def test_no_kernel_without_a_backward_under_autograd(monkeypatch):
    """Mode "triton": an op with no backward kernel (SwiGLU's gate) that needs a gradient runs eagerly."""
    monkeypatch.setenv("ORTHROS_FUSED", "triton")
    calls = []
    monkeypatch.setattr(fused, "_rowwise", lambda: calls.append(1) or pytest.fail("kernel called with autograd"))
    g, u = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    fused.fused_silu_mul(g, u).sum().backward()
    assert g.grad is not None and calls == []


def test_rowwise_kernels_triton_interpreter():
    """The Triton row-wise kernels (norm, add + norm, SO/norm/RoPE, SwiGLU gate) against the
    eager functions, their backward kernels against autograd, and a model's forward and
    training gradients through them, under TRITON_INTERPRET=1 on CPU."""
    r = run_triton_interpreted("-m", "tests.layers.rowwise_cases", timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA (the interpreter test covers the kernels on CPU)")
def test_rowwise_kernels_cuda():
    from tests.layers.rowwise_cases import check_heads_backward, check_kernels, check_norm_backward

    check_kernels(torch.float32, 1e-6, "cuda")
    check_kernels(torch.bfloat16, 1e-2, "cuda")
    check_heads_backward("cuda")
    check_norm_backward("cuda")


def test_fused_mode_context(monkeypatch):
    """A preset's ORTHROS_FUSED applies inside the block only, and never over an explicit setting."""
    import os

    from orthros.layers.fused import fused_mode

    monkeypatch.delenv("ORTHROS_FUSED", raising=False)
    with fused_mode("0"):
        assert os.environ["ORTHROS_FUSED"] == "0"
    assert "ORTHROS_FUSED" not in os.environ
    monkeypatch.setenv("ORTHROS_FUSED", "triton")
    with fused_mode("0"):
        assert os.environ["ORTHROS_FUSED"] == "triton"
    with fused_mode(None):
        assert os.environ["ORTHROS_FUSED"] == "triton"
    with pytest.raises(ValueError, match="ORTHROS_FUSED"):
        with fused_mode("fast"):
            pass
