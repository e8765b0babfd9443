"""Rotary position embeddings (default, linear and Llama-3 scaling), HF layout."""

from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, matching transformers' rope init."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wl, high_wl = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        inv = torch.where(medium, smoothed, scaled)
    return inv.float()


class RotaryEmbedding(torch.nn.Module):
    """cos / sin tables for arbitrary integer positions, computed on the fly in fp32."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.spec = (head_dim, theta, scaling)
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def forward(self, pos: torch.Tensor, dtype: torch.dtype):
        """pos: [B, T] integer positions -> cos, sin: [B, T, 1, D]."""
        freqs = pos.to(torch.float32)[..., None] * self.inv_freq.to(pos.device)
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; the rotate-half convention of transformers' Llama."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
