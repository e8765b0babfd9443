"""OrthrosForCausalLM: two residual streams through one stack of blocks.

    embeddings ──► base stream  x_1..x_T   (SWA; makes each layer's K/V)
               └─► output stream x'_t      (t in output positions; queries only,
                                            full causal cross-attention to K/V)
    final norm + LM head on the output stream only.

The same code builds the paper's baselines: `attention="full"` (causal
transformer) and `"swa"` (sliding window only). For those the "output
stream" is just the last layer evaluated at the output positions.

`OrthrosModel.forward` is transformers' base-model call (input ids, mask, cache ->
`last_hidden_state` at every position); the model's own callers (the LM head, generation,
serving) run `OrthrosModel.forward_streams` on a `Layout` they built.

What `output_hidden_states` / `output_attentions` return (transformers' conventions: one
row per input position). A forward that records them makes every input position an
output position (the output rows carry the attentions), runs the reference op
(`ops.naive_attention`) and keeps the requested rows for the logits, which are those of
the plain forward (SPEC invariant 1) up to rounding:

    hidden_states       L+1 tensors [B, T, C]: each position's output-stream row (for
                        "full" / "swa" the base stream), entering each layer, then after
                        the final norm (`logits == lm_head(hidden_states[-1])` at
                        `output_positions`).
    attentions          L tensors [B, H, T, S]: those rows' attention probabilities over
                        the layer's keys (S = cache + T).

The base stream's own, only with `output_base_stream=True` (they are not in transformers'
tuple of fields otherwise):

    base_hidden_states  L tensors [B, T, C]: the base stream entering each layer (what
                        makes its K/V; the last layer's base stream makes K/V only, so
                        there is none after it).
    base_attentions     L-1 tensors [B, H, T, S]: the base rows' probabilities (0 outside
                        the window), every layer but the last.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import logging

from ..layers.attention import OrthrosAttention
from ..layers.mlp import RMSNorm
from ..layers.moe import balance_loss
from ..layers.rope import RotaryEmbedding, rope_inv_freq
from .block import OrthrosBlock, Ropes
from .cache import OrthrosCache
from .compat import GENERATE_CACHE_KEY, OUTPUT_CACHE_FIELD
from .config import OrthrosConfig
from .inputs import IGNORE_INDEX, check_inputs, own_cache, select_outputs
from .layout import Layout, build_layout

logger = logging.get_logger(__name__)


def _cache_alias(cls):
    """The cache under both of transformers' names, `cache` and `past_key_values` (`models.compat`)."""
    other = "past_key_values" if OUTPUT_CACHE_FIELD == "cache" else "cache"
    setattr(cls, other, property(lambda self: getattr(self, OUTPUT_CACHE_FIELD)))
    return cls


@_cache_alias
@dataclass
class OrthrosOutput(CausalLMOutputWithPast):
    """`logits` are [B, N, V] at the output positions; `output_positions` [B, N]
    gives each one's index in the input (-1 where a row has fewer than N).
    See the module docstring for the hidden states and attentions."""

    output_positions: torch.LongTensor | None = None
    base_hidden_states: tuple[torch.Tensor, ...] | None = None
    base_attentions: tuple[torch.Tensor, ...] | None = None
    output_rows: torch.Tensor | None = None  # [B, N, C] what the LM head reads (only with lm_head=False)
    aux_loss: torch.Tensor | None = None  # the MoE load-balancing loss (with labels and output_router_logits)


@_cache_alias
@dataclass
class OrthrosModelOutput(BaseModelOutputWithPast):
    """`last_hidden_state` [B, T, C]: every position's output-stream row after the final norm
    (what the LM head reads). See the module docstring for the hidden states and attentions."""

    base_hidden_states: tuple[torch.Tensor, ...] | None = None
    base_attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class Trace:
    """What one forward records when asked (see the module docstring)."""

    hidden_states: bool = False
    attentions: bool = False
    base: bool = False  # the base stream's too
    base_hidden: list = field(default_factory=list)
    out_hidden: list = field(default_factory=list)
    base_attn: list = field(default_factory=list)
    out_attn: list = field(default_factory=list)

    def fields(self) -> dict:
        """The output fields it fills (None where not asked)."""
        seq = lambda on, xs: tuple(xs) if on else None
        return dict(hidden_states=seq(self.hidden_states, self.out_hidden),
                    attentions=seq(self.attentions, self.out_attn),
                    base_hidden_states=seq(self.hidden_states and self.base, self.base_hidden),
                    base_attentions=seq(self.attentions and self.base, self.base_attn))


@dataclass
class Call:
    """One forward's inputs as `OrthrosModel.forward_streams` takes them (`OrthrosModel.prepare_call`)."""

    embeds: torch.Tensor  # [B, T, C]
    layout: Layout  # its output rows: the requested ones, or every position when traced
    cache: OrthrosCache | None
    trace: Trace | None  # None: nothing recorded
    out_idx: torch.Tensor  # [B, N] the requested output positions
    out_valid: torch.Tensor  # [B, N]


def unused_tensor_pattern(config: OrthrosConfig) -> str:
    """A regular expression for the tensors that checkpoints and adapters written by earlier
    versions hold and this model has no place for: the last layer's base-stream SO (`so_alpha`,
    `so_beta`), which no forward reads (that layer's base stream makes K/V only). Loading skips
    them; whatever values they hold change no result."""
    return rf"(^|\.)layers\.{config.num_hidden_layers - 1}\.self_attn\.so_(alpha|beta)$"


def unused_checkpoint_tensor(name: str, config: OrthrosConfig) -> bool:
    """Whether tensor `name` of a checkpoint or adapter is one `unused_tensor_pattern` describes."""
    return re.search(unused_tensor_pattern(config), name) is not None


class OrthrosPreTrainedModel(PreTrainedModel):
    config_class = OrthrosConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["OrthrosBlock"]

    def post_init(self):
        # transformers' from_pretrained drops these keys without a warning (see `unused_tensor_pattern`);
        # and every SO vector where the config has none: an Orthros checkpoint run as its own
        # baseline (attention="full" / "swa", as a distillation teacher is) or without SO
        self._keys_to_ignore_on_load_unexpected = [unused_tensor_pattern(self.config)]
        if not (self.config.attention == "orthros" and self.config.scale_offset):
            self._keys_to_ignore_on_load_unexpected.append(r"(^|\.)self_attn\.so_(alpha|beta)(_out)?$")
        super().post_init()

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)  # Linear / Embedding normal(0, std), norms to 1
        if isinstance(module, OrthrosAttention) and module.scale_offset:
            for name in ("so_alpha", "so_alpha_out"):
                if hasattr(module, name):
                    init.ones_(getattr(module, name))
            for name in ("so_beta", "so_beta_out"):
                if hasattr(module, name):
                    init.zeros_(getattr(module, name))
        elif isinstance(module, RotaryEmbedding):  # a non-persistent buffer: rebuilt after meta init
            init.copy_(module.inv_freq, rope_inv_freq(*module.spec))


class OrthrosModel(OrthrosPreTrainedModel):
    """Embeddings and blocks, and the final norm of the output stream."""

    def __init__(self, config: OrthrosConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(OrthrosBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        rs = config.rope_scaling
        if rs is not None and rs.get("rope_type", rs.get("type", "default")) == "default":
            rs = None
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, rs)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def new_cache(self) -> OrthrosCache:
        return OrthrosCache(self.config.num_hidden_layers)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: OrthrosCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        cache: OrthrosCache | None = None,
        output_base_stream: bool = False,
        **unused,
    ) -> OrthrosModelOutput | tuple:
        """transformers' base-model call: every input position is an output position (the
        pre-training forward: full causal attention over the cache, O(T^2)), so
        `last_hidden_state` [B, T, C] holds each position's output-stream row after the final
        norm. The arguments are `OrthrosForCausalLM.forward`'s."""
        call = self.prepare_call(input_ids, inputs_embeds, attention_mask, position_ids, cache, past_key_values,
                                 use_cache, output_hidden_states, output_attentions, output_base_stream)
        h = self.forward_streams(call.embeds, call.layout, call.cache, call.trace)
        fields = call.trace.fields() if call.trace is not None else {}
        out = OrthrosModelOutput(last_hidden_state=h, **fields, **{OUTPUT_CACHE_FIELD: call.cache})
        return out if _return_dict(return_dict, self.config) else out.to_tuple()

    def prepare_call(self, input_ids=None, inputs_embeds=None, attention_mask=None, position_ids=None, cache=None,
                     past_key_values=None, use_cache=None, output_hidden_states=None, output_attentions=None,
                     output_base_stream=False, labels=None, logits_to_keep: int | torch.Tensor = 0) -> Call:
        """Check a transformers-style call and turn it into what `forward_streams` takes: the
        embeddings, the `Layout`, the cache (made when `use_cache`; K/V are appended by the
        forward) and, when hidden states or attentions are asked for, a `Trace` (and then every
        position an output position). The output positions: `select_outputs`."""
        if cache is not None and past_key_values is not None and cache is not past_key_values:
            raise ValueError("pass the cache once: as `cache` or as `past_key_values`, not both")
        cache = own_cache(cache if cache is not None else past_key_values, self)
        check_inputs(self.config, input_ids, inputs_embeds, attention_mask, position_ids, labels, cache)
        x = input_ids if input_ids is not None else inputs_embeds
        (B, T), device = x.shape[:2], x.device
        w = self.embed_tokens.weight
        if input_ids is not None and w.device.type not in ("meta", device.type):
            raise ValueError(f"input_ids are on {device}, the model on {w.device}: move them with "
                             f"`.to(model.device)`")
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        if self.training and torch.is_grad_enabled() and any(b.gradient_checkpointing for b in self.layers):
            if cache is not None:
                raise ValueError("gradient checkpointing recomputes every block in the backward pass, which would "
                                 "append its K/V to the cache a second time: train without a cache or disable "
                                 "gradient checkpointing")
            if use_cache:
                logger.warning_once("use_cache=True is incompatible with gradient checkpointing; running without a cache")
                use_cache = False
        if cache is None and use_cache:
            cache = self.new_cache()
        flag = lambda value, name: bool(value if value is not None else getattr(self.config, name, False))
        trace = Trace(flag(output_hidden_states, "output_hidden_states"), flag(output_attentions, "output_attentions"),
                      bool(output_base_stream))
        if trace.attentions and cache is not None and not cache.reference_reads:
            raise ValueError(f"output_attentions needs an OrthrosCache or no cache, not a {type(cache).__name__} "
                             "(its kernels return no attention probabilities)")
        out_idx, out_valid = select_outputs(B, T, device, labels, logits_to_keep)
        traced = trace.hidden_states or trace.attentions
        # Recorded outputs cover every input position (transformers' convention): every position an output row.
        rows = select_outputs(B, T, device) if traced else (out_idx, out_valid)
        layout = build_layout(B, T, device, *rows, attention_mask, position_ids, cache)
        if cache is not None:
            cache.append_tokens(layout.base_doc, layout.next_pos, layout.last_doc, pos=layout.base_pos)
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        return Call(embeds, layout, cache, trace if traced else None, out_idx, out_valid)

    def forward_streams(self, inputs_embeds: torch.Tensor, layout: Layout, cache=None, trace: Trace | None = None,
                        take_outputs: Callable | None = None):
        """The model's own fast path: inputs_embeds [B, T, C] placed by `layout` (its output rows
        [B, N]) -> the output stream after the final norm [B, N, C]. cache: a `models.kv.KVCache`
        (K/V appended; its slots and documents the caller's). trace: records hidden states /
        attention probabilities (`prepare_call` makes it). take_outputs: the output positions'
        rows of a base-stream tensor, [B, T, C] -> [B, N, C] (default: gathered at
        `layout.out_idx`); a context-parallel shard (`Layout.shard`), which holds only some
        positions, passes its own."""
        dtype = inputs_embeds.dtype
        ropes = Ropes(self.rotary(layout.base_pos, dtype), self.rotary(layout.out_pos, dtype))
        hb = inputs_embeds
        gather = take_outputs or (lambda h: h.gather(1, layout.out_idx[..., None].expand(-1, -1, h.shape[-1])))
        two_streams = self.config.has_output_stream
        ho = gather(hb) if two_streams else None
        L = len(self.layers)
        no_outputs = ho is not None and ho.shape[1] == 0 and trace is None
        if no_outputs:  # a prefill chunk without an output position: the base stream only (no empty-tensor ops)
            ho = None
        T = hb.shape[1]
        joined = (trace is None and not layout.shard and ho is not None and T == ho.shape[1]
                  and (T == 1 or layout.pairs) and not torch.is_grad_enabled())
        if joined:
            # A decode step: the tokens' base and output rows travel as one group [B, 2T, C] (T = 1,
            # or a packed decode-only step), so each norm, residual add, projection and attention call
            # runs once for the two. The last layer's base rows are computed too (a few rows cost what
            # fewer do; that layer has no base SO, so they take the output stream's) and dropped.
            hb, ho = torch.cat([hb, ho], 1), None
            ropes.joined = tuple(torch.cat([b, o], 1) for b, o in zip(ropes.base, ropes.out))
            B = hb.shape[0]
            layout.joined_rows = (torch.cat([layout.base_slot.expand(B, T), layout.out_slot], 1),
                                  torch.cat([layout.base_doc, layout.out_doc], 1))
        else:
            layout.joined_rows = None
        # a joined group's output rows are its base rows, in order: their rows of a base-stream tensor
        take = (lambda t: t) if joined else gather  # noqa: E731
        for i, block in enumerate(self.layers):
            last = i == L - 1
            if last and not two_streams:
                ho = gather(hb)  # baselines: the last layer runs at the output positions only
            probs = [] if trace is not None and trace.attentions else None
            if trace is not None and trace.hidden_states:
                if trace.base:
                    trace.base_hidden.append(hb)
                trace.out_hidden.append(ho if ho is not None else gather(hb))
            hb, ho = block(hb, ho, layout, ropes, cache, last, probs=probs, take=take)
            if probs is not None:  # [base rows (all but the last layer), output rows (if a group of their own)]
                if trace.base and not last:
                    trace.base_attn.append(probs[0])
                own = two_streams or last
                trace.out_attn.append(probs[-1] if own else _gather_rows(probs[0], layout.out_idx))
        if joined:
            return self.norm(hb[:, T:])
        if no_outputs:
            return inputs_embeds.new_zeros(inputs_embeds.shape[0], 0, inputs_embeds.shape[-1])
        out = self.norm(ho)
        if trace is not None and trace.hidden_states:
            trace.out_hidden.append(out)
        return out


def _gather_rows(p: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """p: [B, H, T, S] attention probabilities -> the rows idx [B, N]: [B, H, N, S]."""
    B, H, _, S = p.shape
    return p.gather(2, idx[:, None, :, None].expand(B, H, idx.shape[1], S))


class OrthrosForCausalLM(OrthrosPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: OrthrosConfig):
        super().__init__(config)
        self.model = OrthrosModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def new_cache(self) -> OrthrosCache:
        return self.model.new_cache()

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """transformers' `generate()` hook: give it an `OrthrosCache` (every position of
        every layer) instead of its default DynamicCache / sliding / static caches."""
        if model_kwargs.get(GENERATE_CACHE_KEY) is None and generation_config.use_cache is not False:
            impl = generation_config.cache_implementation
            if impl not in (None, "dynamic"):
                raise ValueError(
                    f"cache_implementation={impl!r} is not supported: transformers' generate() runs Orthros on an "
                    "OrthrosCache, which keeps every position (leave cache_implementation unset). The static, "
                    "preallocated cache is orthros.generate.generate(model, ..., fast=True).")
            model_kwargs[GENERATE_CACHE_KEY] = self.new_cache()
            return
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: OrthrosCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        num_items_in_batch: int | torch.Tensor | None = None,
        cache: OrthrosCache | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        output_base_stream: bool = False,
        lm_head: bool = True,
        output_router_logits: bool | None = None,
        **unused,
    ) -> OrthrosOutput | tuple:
        """
        Args:
            input_ids: [B, T] token ids (or `inputs_embeds` [B, T, C]).
            attention_mask: [B, T] or [B, past + T]; 0 marks padding (left or right).
            position_ids: [B, T]; a 0 inside a row starts a new packed document.
            past_key_values / cache: an `OrthrosCache` (created when `use_cache` and
                absent); transformers' two names for it, pass at most one.
            labels: [B, T] next-token targets, shifted inside; -100 = no loss.
            logits_to_keep: which positions are output positions —
                0: all (pre-training), or, when `labels` are given, those whose
                next-token label is not -100 (SFT); k > 0: the last k (k=1 is
                prefill); a 1-D index tensor; a [B, T] bool mask; or a [B, N]
                index tensor padded with -1.
            output_hidden_states / output_attentions: also return hidden states /
                attention probabilities at every input position (which then runs
                every position as an output position, with the reference op; the
                logits stay those of the positions `logits_to_keep` names); default:
                the config's. See the module docstring.
            output_base_stream: with either of them, the base stream's as well
                (`base_hidden_states`, `base_attentions`).
            return_dict: False returns `OrthrosOutput.to_tuple()` (the fields that
                are not None, in order); default: the config's.
            output_router_logits: with `labels`, a MoE model adds router_aux_loss_coef x the
                load-balancing loss over every routing decision (`aux_loss`); default: the
                config's (transformers' name; the router logits themselves are not returned).
            lm_head: False skips the LM head and the loss: `output_rows` [B, N, C] holds
                what the head would read, for a loss that applies it a chunk of rows at a
                time and never holds [B, N, V] logits (`train.distill`).
        """
        call = self.model.prepare_call(input_ids, inputs_embeds, attention_mask, position_ids, cache,
                                       past_key_values, use_cache, output_hidden_states, output_attentions,
                                       output_base_stream, labels, logits_to_keep)
        out_idx, out_valid = call.out_idx, call.out_valid
        want = output_router_logits if output_router_logits is not None else self.config.output_router_logits
        moes = [b.mlp for b in self.model.layers if b.sparse] if labels is not None and want else []
        for m in moes:
            m.balance = []
        try:
            h = self.model.forward_streams(call.embeds, call.layout, call.cache, call.trace)
            records = [m.balance for m in moes if m.balance]
        finally:
            for m in moes:
                m.balance = None
        if moes and self.training and torch.is_grad_enabled() and records and not records[0][0][0].requires_grad:
            raise ValueError("the load-balancing loss gets no gradient under reentrant activation checkpointing "
                             "(its forward runs without autograd): use non-reentrant checkpointing "
                             "(gradient_checkpointing_kwargs={'use_reentrant': False}, as orthros train does)")
        aux = balance_loss(records, self.config.num_experts) if moes else None
        if call.trace is not None:  # every position ran: the requested rows make the logits
            h = h.gather(1, out_idx[..., None].expand(-1, -1, h.shape[-1]))
        if not lm_head:
            out = OrthrosOutput(output_positions=torch.where(out_valid, out_idx, -1), output_rows=h, aux_loss=aux,
                                **(call.trace.fields() if call.trace is not None else {}),
                                **{OUTPUT_CACHE_FIELD: call.cache})
            return out if _return_dict(return_dict, self.config) else out.to_tuple()
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            T = labels.shape[1]
            nxt = (out_idx + 1).clamp_max(T - 1)
            target = torch.where(out_valid & (out_idx + 1 < T), labels.gather(1, nxt), IGNORE_INDEX)
            loss = lm_loss(logits, target, num_items_in_batch)
            if aux is not None:
                loss = loss + self.config.router_aux_loss_coef * aux
        fields = call.trace.fields() if call.trace is not None else {}
        out = OrthrosOutput(loss=loss, logits=logits, output_positions=torch.where(out_valid, out_idx, -1), **fields,
                            aux_loss=aux, **{OUTPUT_CACHE_FIELD: call.cache})
        return out if _return_dict(return_dict, self.config) else out.to_tuple()


def _return_dict(value: bool | None, config) -> bool:
    return value if value is not None else getattr(config, "return_dict", True)


def lm_loss(logits: torch.Tensor, target: torch.Tensor, num_items: int | torch.Tensor | None = None):
    """Mean cross-entropy over targets != -100; 0 (with a graph) when there are none."""
    total = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    n = (target != IGNORE_INDEX).sum() if num_items is None else num_items
    return total / (n.clamp_min(1) if torch.is_tensor(n) else max(n, 1))
