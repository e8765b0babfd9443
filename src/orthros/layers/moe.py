"""The sparse MLP (mixture of experts), Qwen3-MoE's layout: a linear router, top-k SwiGLU experts,
and optionally a shared expert (Qwen2-MoE's, behind a sigmoid gate).

Routing is split from the expert computation so that an output row may take its experts from
its base row (`OrthrosConfig.output_routing`, docs/moe.md):

    route(x)            x [R, C] -> Routing(weights [R, k], experts [R, k])
    rebind(x, chosen)   x's own gate weights over the experts `chosen` [R, k], renormalised
    top(logits)         the experts of rows whose router logits are made: [R, k]
    forward(x, r)       x [*, C] -> [*, C], sum_k weights * expert_k(x) (+ shared expert)

For a few rows (a decode step) on CUDA the experts run as one fused Triton step (`ops.moe`): each
chosen expert's weights read once for all the rows routed to it, no host sync (CUDA graphs
capture it). Otherwise they run as a plain loop (each expert on the rows that chose it). Where
no host read of the routing may happen and the fused step does not apply (torch.compile), every
expert runs on every row with weight 0 where it was not chosen: the same sum, E times the work.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.moe import MAX_ROWS, expert_tables, fused_moe
from ..ops.splitkv.common import triton_available
from ..ops.tracing import exporting
from .mlp import SwiGLU


def _traced() -> bool:
    """Inside torch.compile / torch.export or a CUDA graph capture: no host reads of the routing."""
    c = torch.compiler
    if c.is_compiling() or exporting():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class Routing(NamedTuple):
    weights: torch.Tensor  # [R, k] gate weight of each chosen expert (fp32)
    experts: torch.Tensor  # [R, k] expert indices


def balance_loss(layers: list[list], num_experts: int) -> torch.Tensor:
    """Switch Transformer's load-balancing loss as transformers' Qwen3-MoE computes it over layers:
    E * sum_e f_e * P_e, f_e the share of top-k assignments to expert e and P_e its mean router
    probability, each the mean over layers of that layer's share. `layers`: per sparse layer, the
    (probs [..., E], experts [..., k], rows that count [...] bool) of its routing decisions (a
    layer's base and output rows pooled: equal rows give equal shares, so at W >= T this is the
    source model's loss). k for a perfect balance."""
    f = p = 0.0
    for records in layers:
        kept = [(pr[m], e[m]) for pr, e, m in records]
        rows = max(sum(pr.shape[0] for pr, _ in kept), 1)
        f = f + sum(torch.bincount(e.reshape(-1), minlength=num_experts).float() for _, e in kept) / rows
        p = p + sum(pr.sum(0) for pr, _ in kept) / rows
    n = max(len(layers), 1)
    return num_experts * ((f / n) * (p / n)).sum()


class SparseMoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        c = config
        self.top_k, self.norm_topk_prob = c.num_experts_per_tok, c.norm_topk_prob
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(SwiGLU(c.hidden_size, c.moe_intermediate_size) for _ in range(c.num_experts))
        self.fused: bool | None = None  # the fused step for few rows (ops.moe): None = on CUDA
        self.balance: list | None = None  # while a list, each routing decision's (probs, experts) lands here
        self._tables, self._tables_key = None, None
        if c.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(c.hidden_size, c.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)

    def probs(self, x: torch.Tensor | None, logits: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., C] -> the router's softmax over all experts [..., E] (fp32); from the router's
        `logits` [..., E] instead, where a caller made them for more rows at once."""
        return F.softmax((self.gate(x) if logits is None else logits).float(), dim=-1)

    def route(self, x: torch.Tensor | None, logits: torch.Tensor | None = None) -> Routing:
        """x [..., C] (or its router `logits` [..., E], made already) -> its top-k experts: the
        softmax over all experts, top k, renormalised over those k when `norm_topk_prob`
        (Qwen3-MoE). Renormalised, that is the softmax of the k largest logits, computed so: two
        kernels fewer a layer, the same weights up to fp32 rounding."""
        logits = (self.gate(x) if logits is None else logits).float()
        if self.norm_topk_prob:
            top, idx = logits.topk(self.top_k, dim=-1)
            return Routing(F.softmax(top, dim=-1), idx)
        w, idx = F.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
        return Routing(w, idx)

    def top(self, logits: torch.Tensor) -> torch.Tensor:
        """The k experts with the largest router `logits` [..., E] -> [..., k] (`route`'s choice)."""
        return logits.topk(self.top_k, dim=-1).indices

    def rebind(self, x: torch.Tensor | None, chosen: torch.Tensor, logits: torch.Tensor | None = None) -> Routing:
        """x [..., C] on the experts `chosen` [..., k] (another row's choice): x's own router
        logits over them (or `logits` [..., E], made already), softmax-renormalised over those k."""
        logits = self.gate(x) if logits is None else logits
        return Routing(F.softmax(logits.float().gather(-1, chosen), dim=-1), chosen)

    def forward(self, x: torch.Tensor, r: Routing | None = None) -> torch.Tensor:
        """x [..., C] -> [..., C]; `r` (over x's rows) from `route` / `rebind`, or x's own."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if r is None:
            r = self.route(x)
        w, idx = r.weights.reshape(-1, self.top_k), r.experts.reshape(-1, self.top_k)
        tables = self._fused_tables(x)
        if tables is not None:
            out = fused_moe(x, w, idx, tables, self.experts[0].gate_proj.out_features)
        elif _traced():
            out = self._dense(x, w, idx)
        else:
            out = torch.zeros_like(x)
            for e in idx.unique().tolist():
                row, slot = (idx == e).nonzero(as_tuple=True)
                y = self.experts[e](x[row]) * w[row, slot, None].to(x.dtype)
                out.index_add_(0, row, y)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)

    def _fused_tables(self, x: torch.Tensor):
        """The experts' address tables for the fused step (`ops.moe`), or None where the loop runs:
        more than MAX_ROWS rows (a prefill), autograd, torch.compile, no Triton, or off CUDA unless
        `fused` is set. Built on first use (outside any graph capture) and again when the weights
        move."""
        use = self.fused if self.fused is not None else x.is_cuda
        if (not use or x.shape[0] > MAX_ROWS or (torch.is_grad_enabled() and x.requires_grad)
                or torch.compiler.is_compiling() or not triton_available()):
            return None
        w = self.experts[0].gate_proj.weight
        key = (x.device, w.device, w.data_ptr(), w.dtype)
        if self._tables_key != key:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return None  # the tables' copy to the device cannot be captured: the dense sum runs
            self._tables, self._tables_key = expert_tables(self.experts, x.device), key
        return self._tables

    def _dense(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The same sum with no shape that depends on the routing (torch.compile, CUDA graphs):
        every expert on every row, weighted 0 where the row did not choose it."""
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            we = (w * (idx == e)).sum(-1, keepdim=True).to(x.dtype)
            out = out + expert(x) * we
        return out
