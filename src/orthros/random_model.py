"""Models with random weights made directly on their device (serving a preset, benchmarks)."""

from __future__ import annotations

import torch

from .models import OrthrosConfig, OrthrosForCausalLM


def made_on(device, dtype, cls, config):
    """`cls(config)` with its random weights drawn directly on `device` in `dtype`, in eval mode."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(prev)
    return model.to(device=device, dtype=dtype).eval()


def build_model(config: OrthrosConfig, device, dtype) -> OrthrosForCausalLM:
    """Random weights (the init's normal draws) made directly on the device in `dtype`."""
    return made_on(device, dtype, OrthrosForCausalLM, config)
