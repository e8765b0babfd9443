"""Fused elementwise work of a layer: RMSNorm (with the residual add before it),
query/key preparation, SwiGLU's gate.

Eager PyTorch runs each of these as 3-8 kernels over the activations (fp32
upcasts, the rotate-half concatenation of RoPE, SO's multiply-add); on long
prefills and in training those passes cost about a fifth of the layer. On
CUDA, for inputs of at least `FUSE_MIN` elements, each runs fused: without
autograd (prefill) as a hand-written Triton kernel (`ops/rowwise.py`), with
autograd as one `torch.compile`d function with dynamic shapes (one generated
kernel forward and one backward, whatever the sequence length). Small inputs
(decoding) stay eager, where a fused call's overhead costs more than it
saves; a compiled decode step traces the plain functions anyway.

`ORTHROS_FUSED`: `0` eager everywhere; `1` compiled for every input and
device; `triton` the Triton kernels for every input, and with autograd too
where one has a backward (`ops/rowwise_grad.py`: norms and query/key
preparation; the tests run them on CPU under the interpreter); `compile`
compiled on large CUDA inputs, never the Triton kernels.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.nn.functional as F

from ..ops import triton_available
from ..ops.tracing import exporting
from .rope import apply_rope

FUSE_MIN = 1 << 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm: normalise in fp32, round, then scale."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def heads(x, cos, sin, n_heads: int, head_dim: int, alpha=None, beta=None, norm_weight=None, eps: float = 0.0):
    """[B, M, H*D] projection -> SO (x * alpha + beta) -> [B, M, H, D] -> head norm -> RoPE."""
    if alpha is not None:
        x = x * alpha + beta
    x = x.unflatten(-1, (n_heads, head_dim))
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    return apply_rope(x, cos, sin)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(h, rms_norm(h)) for h = x + residual: the residual add and the next norm, one pass."""
    h = x + residual
    return h, rms_norm(h, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@functools.cache
def _compiled(fn):
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # one graph per dtype / grad mode / rank
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 256))
    return torch.compile(fn, dynamic=True, fullgraph=True)


def _mode() -> str | None:
    return os.environ.get("ORTHROS_FUSED")


MODES = ("0", "1", "triton", "compile")


@contextlib.contextmanager
def fused_mode(mode: str | None):
    """Run the block with `ORTHROS_FUSED=mode` unless the environment sets it already
    (an explicit setting wins); None changes nothing."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"ORTHROS_FUSED mode must be one of {MODES} or None, got {mode!r}")
    if mode is None or _mode() is not None:
        yield
        return
    os.environ["ORTHROS_FUSED"] = mode
    try:
        yield
    finally:
        os.environ.pop("ORTHROS_FUSED", None)


def _dtypes_match(x, tensors) -> bool:
    return (x.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and all(t.dtype == x.dtype and t.device == x.device for t in tensors))


def fused(fn, kernel=None, params=lambda *a, **k: (), train_kernel=None, no_grad_args=lambda *a, **k: (),
          row_params: bool = False):
    """`fn`, run as a Triton `kernel` (no autograd), as `train_kernel` (Triton forward and
    backward, where one exists) or compiled, where fusion pays off (see the module docstring).
    `params(*args)`: the parameter tensors the kernels read per feature (they must be 1-D, or
    2-D, one per row, where `row_params` says `kernel` takes that);
    `no_grad_args(*args)`: inputs `train_kernel` gives no gradient (they must not need one)."""

    @functools.wraps(fn)
    def call(x, *args, **kwargs):
        mode = _mode()
        if mode == "0" or torch.compiler.is_compiling() or exporting():
            return fn(x, *args, **kwargs)  # (export: no size test, no kernel launch in the traced program)
        if mode == "1":
            return _compiled(fn)(x, *args, **kwargs)
        large = x.is_cuda and x.numel() >= FUSE_MIN
        if (large or mode == "triton") and mode != "compile" and triton_available():
            ps = [p for p in params(x, *args, **kwargs) if p is not None]
            tensors = [t for t in (x, *args, *kwargs.values()) if torch.is_tensor(t)]
            per_feature = all(p.dim() == 1 for p in ps)
            if (per_feature or row_params and all(p.dim() <= 2 for p in ps)) and _dtypes_match(x, tensors):
                grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
                if not grad and kernel is not None:
                    return kernel(x, *args, **kwargs)
                if grad and per_feature and train_kernel is not None and mode == "triton" and not any(
                        t is not None and t.requires_grad for t in no_grad_args(x, *args, **kwargs)):
                    return train_kernel(x, *args, **kwargs)
        if large:
            return _compiled(fn)(x, *args, **kwargs)
        return fn(x, *args, **kwargs)

    return call


def _rowwise():
    from ..ops import rowwise

    return rowwise


def _grad():
    from ..ops import rowwise_grad

    return rowwise_grad


fused_rms_norm = fused(rms_norm, lambda x, w, eps: _rowwise().rms_norm(x, w, eps), lambda x, w, eps: (w,),
                       train_kernel=lambda x, w, eps: _grad().rms_norm_autograd(x, w, eps))
fused_add_rms_norm = fused(add_rms_norm, lambda x, r, w, eps: _rowwise().rms_norm(x, w, eps, residual=r),
                           lambda x, r, w, eps: (w,),
                           train_kernel=lambda x, r, w, eps: _grad().add_rms_norm_autograd(x, r, w, eps))
fused_heads = fused(heads, lambda *a, **k: _rowwise().heads(*a, **k),
                    lambda x, cos, sin, n, d, alpha=None, beta=None, w=None, eps=0.0: (alpha, beta, w),
                    train_kernel=lambda *a, **k: _grad().heads_autograd(*a, **k),
                    no_grad_args=lambda x, cos, sin, *a, **k: (cos, sin), row_params=True)
fused_silu_mul = fused(silu_mul, lambda g, u: _rowwise().silu_mul(g, u))
