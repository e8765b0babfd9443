"""Registration with the transformers Auto classes (done by `import orthros`).

    import orthros
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("runs/demo")   # config.json: "model_type": "orthros"

A saved model directory is plain transformers: `config.json` plus safetensors
shards, so any tool that loads through the Auto classes (lm-evaluation-harness'
`hf` model, pipelines, `generate()`) works once `orthros` is imported.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .models import OrthrosConfig, OrthrosForCausalLM
from .models.model import OrthrosModel


def register() -> None:
    """Idempotent: map model_type "orthros" to OrthrosConfig / OrthrosModel / OrthrosForCausalLM."""
    AutoConfig.register(OrthrosConfig.model_type, OrthrosConfig, exist_ok=True)
    AutoModel.register(OrthrosConfig, OrthrosModel, exist_ok=True)
    AutoModelForCausalLM.register(OrthrosConfig, OrthrosForCausalLM, exist_ok=True)


register()
