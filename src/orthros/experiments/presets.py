"""The recall experiment's architectures and presets (sizes, data mix, steps).

Every architecture of one run gets exactly the preset's sizes; the presets
are what `orthros experiment recall --preset NAME` runs (docs/recall.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..eval.mqar import MQARConfig
from ..eval.passkey import PasskeyConfig
from ..models import OrthrosConfig

# Mixture-of-experts variants: every layer sparse, 8 experts, top-2, each expert half the dense
# MLP's width (the same active parameters a token as the dense models), load balancing at
# Qwen3-MoE's coefficient (`Preset.model_config` sets the experts' width from the hidden size)
MOE = dict(num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True,
           output_router_logits=True, router_aux_loss_coef=0.001)
ARCHS = {  # name -> config changes
    "full": dict(attention="full"),
    "swa": dict(attention="swa"),
    "orthros": dict(attention="orthros"),
    "orthros-noso": dict(attention="orthros", scale_offset=False),
    "full-moe": dict(attention="full", **MOE),
    "orthros-moe": dict(attention="orthros", output_routing="independent", **MOE),
    "orthros-moe-bound": dict(attention="orthros", output_routing="bound", **MOE),
    "orthros-moe-base": dict(attention="orthros", output_routing="base", **MOE),
}
DEFAULT_ARCHS = ("full", "swa", "orthros", "orthros-noso")
"""what a run trains unless --archs says otherwise (the MoE variants: `--archs full-moe orthros-moe ...`)"""
LABELS = {"full": "Transformer (full)", "swa": "SWA", "orthros": "Orthros", "orthros-noso": "Orthros w/o SO",
          "full-moe": "MoE Transformer (full)", "orthros-moe": "MoE Orthros (independent)",
          "orthros-moe-bound": "MoE Orthros (bound)", "orthros-moe-base": "MoE Orthros (base)"}


@dataclass
class Preset:
    """One experiment's sizes; every architecture gets exactly these."""

    hidden_size: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    window: int = 32
    steps: int = 500
    lr: float = 1e-3
    warmup: int = 20
    weight_decay: float = 0.1
    attn_backend: str = "auto"
    # ORTHROS_FUSED while training (an explicit environment setting wins); "0": eager
    # row-wise ops, faster for models small enough that a step is bound by the host
    # (benchmarks/recall_steps.py: 9.4 vs 6.9 steps/s for the GPU preset's Orthros).
    row_ops: str | None = None
    # Training MQAR: few pairs over a small vocabulary — what a tiny model learns in
    # a few hundred steps (more pairs or a larger vocabulary lengthen the plateau).
    mqar_train: MQARConfig = field(default_factory=lambda: MQARConfig(seq_len=128, num_kv_pairs=4, vocab_size=32))
    mqar_batch: int = 32
    text_seq_len: int = 256
    text_batch: int = 4
    # Training passkeys: lengths taken in turn, one per step; every step holds
    # passkey_batch x passkey_lengths[0] tokens (a longer length: fewer samples).
    passkey_lengths: list[int] = field(default_factory=lambda: [256])
    passkey_batch: int = 16
    passkey_copy_labels: bool = True
    """also train on the key's second copy inside the needle (a local copy: the same
    copying circuit with a short-range signal); evaluation scores the answer alone"""
    passkey_weight: float = 1.0
    """weight of the passkey loss in the summed loss (MQAR and text weigh 1)"""
    passkey_first: int = 0
    """steps of passkey-only training (at passkey_lengths[0]) before the three tasks mix;
    they count in `steps`"""
    passkey_lengths_late: list[int] = field(default_factory=list)
    """from step `passkey_late_from` on, the training passkey lengths cycle through these
    instead (a length curriculum: long passkeys once the copy is learned on short ones);
    empty: `passkey_lengths` throughout. Tokens a step stay passkey_batch x passkey_lengths[0]."""
    passkey_late_from: int = 0
    text_bytes: int = 4_000_000
    # evaluation
    mqar_eval_lengths: list[int] = field(default_factory=lambda: [256, 512, 1024])
    mqar_eval_samples: int = 128
    passkey: PasskeyConfig = field(default_factory=lambda: PasskeyConfig([256, 512, 1024], [0, 0.25, 0.5, 0.75, 1], 8))
    ppl_seq_len: int = 256
    ppl_tokens: int = 32_768
    batch_size: int = 16
    eval_tasks: tuple = ("mqar", "passkey", "ppl")

    def model_config(self, arch: str) -> OrthrosConfig:
        changes = dict(ARCHS[arch])
        if changes.get("num_experts"):  # k experts a token hold the dense MLP's width between them
            changes["moe_intermediate_size"] = 3 * self.hidden_size // changes["num_experts_per_tok"]
        return OrthrosConfig(vocab_size=256, hidden_size=self.hidden_size, intermediate_size=3 * self.hidden_size,
                             num_hidden_layers=self.layers, num_attention_heads=self.heads,
                             num_key_value_heads=self.kv_heads, head_dim=self.hidden_size // self.heads,
                             window_size=self.window, max_position_embeddings=16384, tie_word_embeddings=True,
                             attn_backend=self.attn_backend, **changes)


PRESETS = {
    # a few seconds: for the tests
    "smoke": Preset(hidden_size=32, window=16, steps=3, warmup=1,
                    mqar_train=MQARConfig(seq_len=64, num_kv_pairs=4, vocab_size=64), mqar_batch=4, text_seq_len=64,
                    text_batch=2, passkey_lengths=[128, 160], passkey_batch=2, text_bytes=200_000,
                    mqar_eval_lengths=[64, 128], mqar_eval_samples=8, passkey=PasskeyConfig([128, 160], [0.0, 1.0], 2),
                    ppl_seq_len=64, ppl_tokens=512),
    # <= 10 minutes on 2 CPU cores: W = 32, MQAR trained at 4 W, tested at 8, 16, 32 W; a few
    # passkey samples (too few for a tiny model to learn the 5-digit copy in 500 steps).
    "cpu": Preset(passkey_batch=4, passkey_copy_labels=False),
    # the same models and budget with passkey training at 128-512 tokens, 4096 tokens a step,
    # with the needle-copy labels, 560 steps: Orthros learns part of the passkey grid (seeds 0
    # and 1), the Transformer's passkey loss never leaves "a digit comes next" (0%, both seeds),
    # and SWA misses MQAR (see docs/recall.md for the recipes tried)
    "cpu-passkey": Preset(steps=560, passkey_lengths=[128, 256, 512], passkey_batch=32),
    # the same with the passkey loss weighted 4x: the Transformer reaches 74% with seed 0 (Orthros
    # 53%, its MQAR lower, every perplexity ~30% higher); with seed 1 neither learns the passkey
    "cpu-passkey-w4": Preset(steps=560, passkey_lengths=[128, 256, 512], passkey_batch=32, passkey_weight=4.0),
    # zoology-style: MQAR only (no text, no passkey), ~2 min per model on 2 CPU cores
    "cpu-mqar": Preset(steps=400, text_batch=0, passkey_batch=0, text_bytes=100_000, eval_tasks=("mqar",)),
    # one GPU, ~9 minutes with --jobs 4: a wider, deeper model, 4x the steps, MQAR trained at 8 W,
    # tested up to 64 W. The naive op: no compilation inside a short run (FlexAttention compiles per
    # shape); eager row-wise ops: a step of a model this small is bound by the host.
    "gpu": Preset(hidden_size=256, layers=4, heads=8, kv_heads=4, window=32, steps=2000, lr=1e-3, warmup=50,
                  attn_backend="naive", mqar_train=MQARConfig(seq_len=256, num_kv_pairs=4, vocab_size=32),
                  mqar_batch=64, text_seq_len=512, text_batch=16, passkey_lengths=[256, 512, 1024],
                  passkey_batch=32,
                  text_bytes=8_000_000, mqar_eval_lengths=[256, 512, 1024, 2048], mqar_eval_samples=256,
                  passkey=PasskeyConfig([512, 1024, 2048], [0, 0.25, 0.5, 0.75, 1], 20), ppl_seq_len=512,
                  ppl_tokens=262_144, batch_size=32, row_ops="0"),
}
