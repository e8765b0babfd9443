"""Distil a converted model from a frozen teacher: `orthros train` with a `distill` section.

    orthros distill configs/distill-smollm2.yaml
    orthros distill configs/distill-smollm2.yaml --model.trainable lora+so --optim.lora_lr 1e-3
    orthros distill configs/distill-smollm2.yaml --resume           # continue the newest checkpoint
    torchrun --nproc_per_node 8 -m orthros distill CONFIG           # FSDP2, the teacher on every process

Every `orthros train` option applies; `distill.teacher` is required. The loss is
distill.ce x CE + distill.kl x KL(teacher || student) + distill.align x per-layer
K/V or hidden-state MSE (see orthros.train.distill).
"""

from __future__ import annotations

from .cli import add_arguments  # noqa: F401  (the same options as orthros train)
from .cli import run as _run


def run(args) -> int:
    return _run(args, need_teacher=True)
