"""OrthrosConfig: a Llama/Qwen3-shaped config plus the Orthros fields.

Field names follow transformers' Llama / Qwen3 configs so that converted
checkpoints keep their `config.json` vocabulary.
"""

from __future__ import annotations

import copy

try:  # transformers >= 5
    from transformers import PreTrainedConfig
except ImportError:  # pragma: no cover - transformers 4.x
    from transformers import PretrainedConfig as PreTrainedConfig

ATTENTION_KINDS = ("orthros", "full", "swa")
BACKENDS = ("auto", "naive", "chunked", "sdpa", "flex", "triton")  # see orthros.ops
ROPE_TYPES = ("default", "linear", "llama3")
ROUTING_MODES = ("independent", "bound", "base")  # see layers.moe


class OrthrosConfig(PreTrainedConfig):
    """Configuration of an Orthros (or same-code `full` / `swa` baseline) model.

    Orthros fields:
        window_size: sliding window of the base stream; counts the current
            token (key j is visible from t iff t - window_size < j <= t).
        sink_tokens: the window also sees the first `sink_tokens` tokens of
            its document (attention sinks); 0 (the default) for none. A
            converted model's zero-shot quality rests on them (docs/conversion.md#attention-sinks---sink-tokens).
        attention: "orthros" (SWA base stream + full cross-attention output
            stream), "full" (plain causal transformer) or "swa" (sliding
            window only, no output stream).
        scale_offset: per-layer query scale-offset (SO) of each stream;
            False is the paper's "w/o SO" ablation.
        attn_backend: "auto" picks the fastest available op; "naive" is the
            fp32 reference; "flex" / "triton" force a fast path.

    Mixture of experts (transformers' Qwen3-MoE names; `num_experts=0` is a dense model):
        num_experts, num_experts_per_tok (k), moe_intermediate_size: the
            experts of a sparse MLP and each one's SwiGLU width.
        norm_topk_prob: renormalise the top-k softmax weights over the k.
        decoder_sparse_step, mlp_only_layers: layer i is sparse iff
            i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
        shared_expert_intermediate_size: a shared expert (Qwen2-MoE's,
            sigmoid-gated) beside the routed ones; 0 for none.
        output_routing: how an output row picks its experts (docs/moe.md):
            "independent" (its own router), "bound" (its base row's experts,
            its own gate weights over them) or "base" (its base row's
            experts and weights).
        output_router_logits, router_aux_loss_coef: with labels, add
            router_aux_loss_coef x the load-balancing loss (Switch /
            Qwen3-MoE's) to the loss (transformers' names and defaults).
    """

    model_type = "orthros"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 768,
        intermediate_size: int = 2048,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 12,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        max_position_embeddings: int = 8192,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        rope_scaling: dict | None = None,
        qk_norm: bool = False,
        attention_bias: bool = False,
        tie_word_embeddings: bool = False,
        window_size: int = 128,
        sink_tokens: int = 0,
        attention: str = "orthros",
        scale_offset: bool = True,
        attn_backend: str = "auto",
        use_cache: bool = True,
        num_experts: int = 0,
        num_experts_per_tok: int = 8,
        moe_intermediate_size: int = 768,
        norm_topk_prob: bool = False,
        decoder_sparse_step: int = 1,
        mlp_only_layers: list[int] | None = None,
        shared_expert_intermediate_size: int = 0,
        output_routing: str = "independent",
        output_router_logits: bool = False,
        router_aux_loss_coef: float = 0.001,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // max(num_attention_heads, 1)
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = float(rope_theta)
        # transformers keeps RoPE scaling as `rope_parameters` (`rope_scaling` is its deprecated alias)
        self.rope_parameters = copy.deepcopy(rope_scaling)
        self.qk_norm = qk_norm
        self.attention_bias = attention_bias
        self.window_size = window_size
        self.sink_tokens = sink_tokens
        self.attention = attention
        self.scale_offset = scale_offset
        self.attn_backend = attn_backend
        self.use_cache = use_cache
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.norm_topk_prob = norm_topk_prob
        self.decoder_sparse_step = decoder_sparse_step
        self.mlp_only_layers = list(mlp_only_layers or [])
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.output_routing = output_routing
        self.output_router_logits = output_router_logits
        self.router_aux_loss_coef = router_aux_loss_coef
        self.validate()  # before transformers' own checks, so errors name our fields
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""

        def bad(field, msg):
            raise ValueError(f"OrthrosConfig.{field}: {msg} (got {getattr(self, field)!r})")

        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(f, "must be a positive integer")
        if not isinstance(self.window_size, int) or isinstance(self.window_size, bool) or self.window_size < 1:
            bad("window_size", "must be an integer >= 1 (it counts the current token)")
        if not isinstance(self.sink_tokens, int) or isinstance(self.sink_tokens, bool) or self.sink_tokens < 0:
            bad("sink_tokens", "must be an integer >= 0")
        if self.num_attention_heads % self.num_key_value_heads:
            bad("num_key_value_heads", f"must divide num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            bad("head_dim", "must be even for rotary embeddings")
        if self.attention not in ATTENTION_KINDS:
            bad("attention", f"must be one of {ATTENTION_KINDS}")
        if self.attn_backend not in BACKENDS:
            bad("attn_backend", f"must be one of {BACKENDS}")
        if self.hidden_act != "silu":
            bad("hidden_act", "only 'silu' (SwiGLU MLP) is supported")
        for f in ("num_experts", "shared_expert_intermediate_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                bad(f, "must be an integer >= 0")
        if self.num_experts:
            for f in ("num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
                v = getattr(self, f)
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    bad(f, "must be a positive integer")
            if self.num_experts_per_tok > self.num_experts:
                bad("num_experts_per_tok", f"must be <= num_experts={self.num_experts}")
        if not (isinstance(self.router_aux_loss_coef, (int, float)) and self.router_aux_loss_coef >= 0):
            bad("router_aux_loss_coef", "must be a number >= 0")
        if self.output_routing not in ROUTING_MODES:
            bad("output_routing", f"must be one of {ROUTING_MODES}")
        if not self.rms_norm_eps > 0:
            bad("rms_norm_eps", "must be > 0")
        if not self.rope_theta > 0:
            bad("rope_theta", "must be > 0")
        rs = self.rope_scaling
        if rs is not None:
            if not isinstance(rs, dict):
                bad("rope_scaling", "must be a dict or None")
            kind = rs.get("rope_type", rs.get("type", "default"))
            if kind not in ROPE_TYPES:
                bad("rope_scaling", f"rope_type must be one of {ROPE_TYPES}")
            if kind in ("linear", "llama3") and not rs.get("factor", 0) > 0:
                bad("rope_scaling", "needs a positive 'factor'")
            if kind == "llama3":
                for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                    if key not in rs:
                        bad("rope_scaling", f"llama3 scaling needs '{key}'")

    def is_sparse_layer(self, i: int) -> bool:
        """Does layer i have a sparse MLP (Qwen3-MoE's rule)?"""
        return bool(self.num_experts) and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def has_output_stream(self) -> bool:
        return self.attention == "orthros"

    # ----------------------------------------------------------------- presets
    @classmethod
    def from_name(cls, name: str, **overrides) -> "OrthrosConfig":
        """A named size: one of `OrthrosConfig.names()`; keyword overrides win."""
        key = name.lower()
        if key not in PRESETS:
            raise ValueError(f"unknown config name {name!r}; known: {', '.join(sorted(PRESETS))}")
        return cls(**{**PRESETS[key], **overrides})

    @staticmethod
    def names() -> list[str]:
        return sorted(PRESETS)


PRESETS: dict[str, dict] = {
    # CI size: every test and the CPU demo run on it in seconds.
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, window_size=16,
                 max_position_embeddings=4096, tie_word_embeddings=True),
    # CI size of a mixture of experts: "tiny" with 4 experts of which 2 per token.
    "tiny-moe": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, window_size=16,
                     max_position_embeddings=4096, tie_word_embeddings=True, num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "small": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, window_size=64,
                  max_position_embeddings=8192, tie_word_embeddings=True),
    "160m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2560, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4, head_dim=64, window_size=128,
                 max_position_embeddings=32768, tie_word_embeddings=True),
    # the shape of SmolLM2-135M-Instruct, the real model conversions are measured on (docs/conversion.md)
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                         rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2),
    "1.3b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, window_size=128,
                 max_position_embeddings=32768, tie_word_embeddings=False),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192),
                         max_position_embeddings=131072, tie_word_embeddings=False,
                         bos_token_id=128000, eos_token_id=128001),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                     rope_theta=1000000.0, qk_norm=True, max_position_embeddings=40960,
                     tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
                          rope_theta=1000000.0, qk_norm=True, max_position_embeddings=40960,
                          tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True, bos_token_id=151643,
                          eos_token_id=151645),
}
