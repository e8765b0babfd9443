"""Run under TRITON_INTERPRET=1 (see test_fused.py): the row-wise Triton kernels against
the eager functions they replace, on odd sizes, and a whole model's no-grad forward."""

import os

import torch

from orthros.layers import fused
from orthros.ops import rowwise, rowwise_grad
from tests.conftest import make_model, rel_err


def check_kernels(dtype, tol, device="cpu"):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(device, dtype)
    for rows, N in ((7, 96), (3, 130), (1, 8)):
        x, res, w = r(rows, N), r(rows, N), r(N)
        assert rel_err(rowwise.rms_norm(x, w, 1e-6), fused.rms_norm(x, w, 1e-6)) < tol
        h, y = rowwise.rms_norm(x, w, 1e-6, residual=res)
        h_ref, y_ref = fused.add_rms_norm(x, res, w, 1e-6)
        assert rel_err(h, h_ref) < tol and rel_err(y, y_ref) < tol
        assert rel_err(rowwise.silu_mul(x, res), fused.silu_mul(x, res)) < tol
    for B, M, H, D in ((2, 5, 3, 10), (1, 4, 4, 16)):
        x = r(B, M, H * D)
        pos = torch.randint(0, 50, (B, M), generator=g).to(device)
        from orthros.layers.rope import RotaryEmbedding

        cos, sin = RotaryEmbedding(D, 10000.0).to(device)(pos, dtype)
        a, b, nw = r(H * D), r(H * D), r(D)
        for so in ((None, None), (a, b)):
            for norm in (None, nw):
                out = rowwise.heads(x, cos, sin, H, D, *so, norm, 1e-6)
                ref = fused.heads(x, cos, sin, H, D, *so, norm, 1e-6)
                assert out.shape == ref.shape and rel_err(out, ref) < tol, (so[0] is None, norm is None)
        # SO per row (a decode pair: base rows, then output rows, each stream its own)
        ar, br = r(M, H * D), r(M, H * D)
        for norm in (None, nw):
            out = rowwise.heads(x, cos, sin, H, D, ar, br, norm, 1e-6)
            assert rel_err(out, fused.heads(x, cos, sin, H, D, ar, br, norm, 1e-6)) < tol, ("per-row SO", norm is None)
        # cos / sin broadcast over the batch
        out = rowwise.heads(x, cos[:1], sin[:1], H, D)
        assert rel_err(out, fused.heads(x, cos[:1], sin[:1], H, D)) < tol


def check_heads_backward(device="cpu"):
    """The Triton backward of the query/key preparation against eager autograd (fp32)."""
    from orthros.layers.rope import RotaryEmbedding

    g = torch.Generator().manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=g).to(device).requires_grad_()
    for B, M, H, D in ((2, 5, 3, 10), (1, 37, 4, 16), (2, 130, 2, 8)):
        cos, sin = RotaryEmbedding(D, 10000.0).to(device)(torch.randint(0, 50, (B, M), generator=g).to(device),
                                                          torch.float32)
        for so in (False, True):
            for norm in (False, True):
                x, a, b, w = r(B, M, H * D), r(H * D) if so else None, r(H * D) if so else None, r(D) if norm else None
                dy = torch.randn(B, M, H, D, generator=g).to(device)
                ps = [t for t in (x, a, b, w) if t is not None]
                ref = torch.autograd.grad(fused.heads(x, cos, sin, H, D, a, b, w, 1e-6), ps, dy)
                got = torch.autograd.grad(rowwise_grad.heads_autograd(x, cos, sin, H, D, a, b, w, 1e-6), ps, dy)
                for name, p, q in zip("x a b w".split(), got, ref):
                    assert rel_err(p, q) < 1e-5, ((B, M, H, D), so, norm, name)


def check_norm_backward(device="cpu"):
    """The Triton backward of RMSNorm and of residual add + RMSNorm against eager autograd (fp32),
    with the gradient reaching the norm's output, the sum h, or both."""
    g = torch.Generator().manual_seed(4)
    r = lambda *s: torch.randn(*s, generator=g).to(device)
    for shape in ((7, 96), (2, 3, 130), (600, 16)):
        N = shape[-1]
        x, res, w = r(*shape).requires_grad_(), r(*shape).requires_grad_(), r(N).requires_grad_()
        dy, dh = r(*shape), r(*shape)
        ref = torch.autograd.grad(fused.rms_norm(x, w, 1e-6), (x, w), dy)
        got = torch.autograd.grad(rowwise_grad.rms_norm_autograd(x, w, 1e-6), (x, w), dy)
        for name, a, b in zip("xw", got, ref):
            assert rel_err(a, b) < 1e-5, (shape, "norm", name)
        for use in ("both", "y", "h"):
            outs = []
            for f in (fused.add_rms_norm, rowwise_grad.add_rms_norm_autograd):
                h, y = f(x, res, w, 1e-6)
                loss = ((h * dh).sum() if use != "y" else 0) + ((y * dy).sum() if use != "h" else 0)
                outs.append(torch.autograd.grad(loss, (x, res, w), allow_unused=True, materialize_grads=True))
            for name, a, b in zip(("x", "res", "w"), outs[1], outs[0]):
                assert rel_err(a, b) < 1e-5 or (b.abs().max() == 0 and a.abs().max() == 0), (shape, use, name)


def check_training_step():
    """A model's loss and every gradient with the Triton kernels (mode "triton") vs eager."""
    for qk_norm in (False, True):
        model = make_model("orthros", window=8, qk_norm=qk_norm)
        ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
        grads = []
        for mode in ("0", "triton"):
            os.environ["ORTHROS_FUSED"] = mode
            model.zero_grad()
            model(ids, labels=ids).loss.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        assert grads[0].keys() == grads[1].keys()
        for n in grads[0]:
            assert rel_err(grads[1][n], grads[0][n]) < 1e-4, (qk_norm, n)


def check_model():
    for qk_norm in (False, True):
        model = make_model("orthros", window=8, qk_norm=qk_norm).eval()
        for T in (40, 20, 1):  # separate streams; short streams projected together (sliced views); a decode pair
            ids = torch.randint(0, model.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                os.environ["ORTHROS_FUSED"] = "0"
                ref = model(ids).logits
                os.environ["ORTHROS_FUSED"] = "triton"
                out = model(ids).logits
            assert rel_err(out, ref) < 1e-5, (qk_norm, T)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check_kernels(torch.float32, 1e-6)
    check_kernels(torch.float16, 2e-3)
    check_model()
    check_heads_backward()
    check_norm_backward()
    check_training_step()
    print("ok")
