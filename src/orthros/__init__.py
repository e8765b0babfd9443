"""Orthros: sliding-window reading, full cross-attention answering."""

from .models import OrthrosCache, OrthrosConfig, OrthrosForCausalLM, OrthrosModel

__version__ = "0.1.0"
__all__ = ["OrthrosConfig", "OrthrosForCausalLM", "OrthrosModel", "OrthrosCache"]
