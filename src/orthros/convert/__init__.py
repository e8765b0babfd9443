"""Checkpoint conversion: Llama 3.x / Qwen3 (Hugging Face directories) -> Orthros."""

from .hf import convert_checkpoint, orthros_config

__all__ = ["convert_checkpoint", "orthros_config"]
