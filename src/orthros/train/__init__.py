"""Training: pre-training, continued pre-training and SFT, one process to torchrun/FSDP2."""

from .config import TrainConfig, build_config
from .trainer import NonFiniteLossError, train

__all__ = ["TrainConfig", "build_config", "train", "NonFiniteLossError"]
