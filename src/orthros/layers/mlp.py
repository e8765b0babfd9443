"""RMSNorm and the SwiGLU MLP, shared by both residual streams."""

from __future__ import annotations

import torch
from torch import nn

from .fused import fused_add_rms_norm, fused_rms_norm, fused_silu_mul


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_rms_norm(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor):
        """(h, norm(h)) for h = x + residual, in one pass where fused."""
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused_silu_mul(self.gate_proj(x), self.up_proj(x)))
