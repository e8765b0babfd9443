
from .train_helpers import tiny_cfg  # noqa: F401  (fixture)
