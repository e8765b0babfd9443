"""One Orthros layer for both streams (`OrthrosBlock`): pre-norm attention over the layer's
cache, then the MLP (dense SwiGLU, or the sparse MoE with the output rows routed by
`output_routing`). A decode pair, a prompt chunk, a training row: every phase runs this forward
on the `Layout` its caller built (`models.layout`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.modeling_layers import GradientCheckpointingLayer

from ..layers.attention import OrthrosAttention, rows
from ..layers.mlp import RMSNorm, SwiGLU
from ..layers.moe import Routing, SparseMoE
from ..ops.masks import PAD_DOC
from .config import OrthrosConfig

MLP_CHUNK = 1 << 16  # rows per MLP call of a long forward without autograd (`OrthrosBlock._mlp_chunks`)


class OrthrosBlock(GradientCheckpointingLayer):
    """One layer for both streams. A `GradientCheckpointingLayer`, so transformers'
    `gradient_checkpointing_enable()` recomputes it in the backward pass."""

    def __init__(self, config: OrthrosConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = OrthrosAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sparse = config.is_sparse_layer(layer_idx)
        self.mlp = SparseMoE(config) if self.sparse else SwiGLU(config.hidden_size, config.intermediate_size)
        self.output_routing = config.output_routing

    def forward(self, hb, ho, layout, ropes, cache=None, last: bool = False, probs: list | None = None,
                take: Callable | None = None):
        """hb: [B, T, C] base stream; ho: [B, N, C] output stream, or None. Or both streams as one
        group of rows, hb [B, T + N, C] (base rows first; `Ropes.joined` set), ho None.
        In the last layer a base stream alone only makes K/V; its output is None.
        probs: a list that receives the attention probabilities (see `OrthrosAttention`).
        take: the output positions' rows of a base-stream tensor (`forward_streams`' gather: a
        context-parallel shard's fetches them from the rank that holds them).
        -> (hb, ho) after the layer."""
        hs = [hb] if ho is None else [hb, ho]
        T = ropes.base[0].shape[1]
        n_base = [T] + [0] * (len(hs) - 1)
        rope = [ropes.joined if ropes.joined is not None else ropes.base] + [ropes.out] * (len(hs) - 1)
        xs = [self.input_layernorm(h) for h in hs]
        attn = self.self_attn(xs, n_base, layout, rope, ropes.base, cache, skip_base=last, probs=probs)
        del xs  # long rows: free before the MLP's activations
        hs = [None if a is None else self.post_attention_layernorm.add_norm(h, a) for h, a in zip(hs, attn)]
        del attn
        if self.sparse:
            return self._moe(hs, layout, T, last, take)
        mlp = iter(rows(self.mlp, [h[1] for h in hs if h is not None and not _chunked(h[0])], layout.shard))
        out = [None if h is None else self._mlp_chunks(*h) if _chunked(h[0]) else h[0] + next(mlp) for h in hs]
        return out[0], (out[1] if len(out) > 1 else None)

    def _moe(self, hs, layout, T, last, take=None):
        """The sparse MLP of both streams, the output rows routed by `output_routing` (docs/moe.md).
        hs: [(h, x)] as in `forward` (a joined group: base rows [:T], output rows [T:]).
        In the last layer the base stream makes K/V only (it has no MLP input), so there the output
        rows route themselves in every mode."""
        mlp, mode = self.mlp, "independent" if last else self.output_routing
        joined = len(hs) == 1 and hs[0] is not None and hs[0][1].shape[1] > T
        if joined:  # the router's logits made once for both streams' rows
            xb, xo = hs[0][1][:, :T], hs[0][1][:, T:]
            logits = mlp.gate(hs[0][1]).float()
            lb, lo = logits[:, :T], logits[:, T:]
        else:
            xb = None if hs[0] is None else hs[0][1]
            xo = hs[1][1] if len(hs) > 1 else None
            lb = None if xb is None else mlp.gate(xb).float()
            lo = None if xo is None or mode == "base" else mlp.gate(xo).float()
        if take is None:  # (not `take or ...`: dynamo cannot branch on a function's truth)
            take = lambda t: t.gather(1, layout.out_idx[..., None].expand(-1, -1, t.shape[-1]))  # noqa: E731
        # While the load-balancing loss is wanted (training), each routing decision is recorded as
        # (probs, experts, rows that count). Wherever autograd runs, the router's softmax over all
        # experts is made whether it is recorded or not, so a checkpointed block's recomputation
        # (which records nothing) saves what its forward saved; a decode step skips it.
        bal, keep = mlp.balance, mlp.balance is not None or torch.is_grad_enabled()

        def record(logits, experts, valid):
            if keep:
                probs = mlp.probs(None, logits=logits)
                if bal is not None:
                    bal.append((probs, experts, valid))

        if joined and mode == "bound" and mlp.norm_topk_prob:
            # Each row's weights: the softmax of its own logits over the base row's k experts (for the
            # base row that is `route`'s): one gather and one softmax for the group, no concatenation
            # of weights.
            eb = mlp.top(lb)
            record(lb, eb, layout.base_doc != PAD_DOC)
            e = torch.cat([eb, take(eb)], 1)
            h, x = hs[0]
            return h + mlp(x, Routing(F.softmax(logits.gather(-1, e), dim=-1), e)), None
        rb = ro = None
        if xb is not None:
            rb = mlp.route(None, logits=lb)  # [B, T, k]
            record(lb, rb.experts, layout.base_doc != PAD_DOC)
        if xo is not None:
            if mode == "independent":  # rows routed by their own choice (bound / base reuse the base row's)
                ro = mlp.route(None, logits=lo)
                record(lo, ro.experts, layout.out_valid)
            else:
                chosen = take(rb.experts)  # [B, N, k]: the experts of each output row's base row
                ro = mlp.rebind(None, chosen, logits=lo) if mode == "bound" else Routing(take(rb.weights), chosen)
        if joined:
            h, x = hs[0]
            if last:  # the base rows run only to keep the pair one group, then are dropped: they take
                rb = ro  # their output rows' experts, so the step reads no expert for them alone
            r = Routing(*(torch.cat([b, o], 1) for b, o in zip(rb, ro)))
            return h + mlp(x, r), None
        out = [None if h is None else h[0] + mlp(h[1], r) for h, r in zip(hs, [rb, ro])]
        return out[0], (out[1] if len(out) > 1 else None)

    def _mlp_chunks(self, h, x):
        """h + MLP(x) [B, R, C] in row chunks of MLP_CHUNK, added into h in place: a long forward
        without autograd (a context-parallel shard runs its whole length at once) keeps its
        [rows, intermediate] activations bounded."""
        for s in range(0, h.shape[1], MLP_CHUNK):
            h[:, s:s + MLP_CHUNK] += self.mlp(x[:, s:s + MLP_CHUNK])
        return h


def _chunked(h: torch.Tensor) -> bool:
    """Does a group's MLP run in row chunks (`OrthrosBlock._mlp_chunks`)?"""
    return not torch.is_grad_enabled() and h.shape[1] > MLP_CHUNK


@dataclass
class Ropes:
    """(cos, sin) of a forward's rows: base positions, output positions, and, when both streams travel
    as one group of rows (a decode step), that group's (base rows, then output rows)."""

    base: tuple
    out: tuple
    joined: tuple | None = None
