from .cache import OrthrosCache
from .config import OrthrosConfig
from .model import OrthrosForCausalLM, OrthrosModel, OrthrosOutput

__all__ = ["OrthrosConfig", "OrthrosForCausalLM", "OrthrosModel", "OrthrosCache", "OrthrosOutput"]
