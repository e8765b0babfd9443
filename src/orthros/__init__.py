"""Orthros: sliding-window reading, full cross-attention answering."""

from . import hf as _hf  # registers OrthrosConfig / OrthrosForCausalLM with the transformers Auto classes
from .models import OrthrosCache, OrthrosConfig, OrthrosForCausalLM, OrthrosModel

__version__ = "0.1.0"
__all__ = ["OrthrosConfig", "OrthrosForCausalLM", "OrthrosModel", "OrthrosCache"]
