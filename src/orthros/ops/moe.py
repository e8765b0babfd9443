"""The fused mixture-of-experts step for a few rows (decode): each chosen expert's weights are read
once per step, for every row routed to it.

    fused_moe(x, weights, experts, tables) -> [R, C]     tables = expert_tables(moe, device)

The (row, slot) pairs are sorted by expert on the device; a run of pairs with one expert is a
segment. A program per (segment, output tile) loads that expert's weight tile once and applies it
to all the segment's rows. Two kernels: gate / up with SwiGLU into h [R*k, I], then down, times
the routing weight, into y [R*k, C]; a row's k contributions are summed in slot order
(deterministic). No host sync and static shapes: a decode step with it is captured in a CUDA
graph. The experts stay separate `nn.Linear` modules: the kernels find them through tables of
their weights' addresses (`expert_tables`).

`fused_moe_ref` is the same computation as a plain PyTorch loop over the experts (the reference).
`fused_moe_with` runs the same step at any launch settings (`MoELaunch`): for benchmarks
(benchmarks/moe_sweep.py), not for production code.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

MAX_ROWS = 256
"""Rows one call takes (a decode step's rows: batch x 2 for Orthros, up to batch 128); more (a
prefill) go the loop's way. A segment's rows go through the kernels up to 64 at a time."""


def expert_tables(experts, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """int64 [E] tables of the gate, up and down weights' addresses (every expert a SwiGLU with
    `gate_proj`, `up_proj`, `down_proj`; weights contiguous, one dtype), and one of the weights
    (what tells the kernels their dtype)."""
    ws = [(e.gate_proj.weight, e.up_proj.weight, e.down_proj.weight) for e in experts]
    if any(not w.is_contiguous() or w.dtype != ws[0][0].dtype or w.device != ws[0][0].device for t in ws for w in t):
        raise ValueError("fused MoE: every expert weight must be contiguous, of one dtype, on one device")
    ptrs = (torch.tensor([t[j].data_ptr() for t in ws], dtype=torch.int64, device=device) for j in range(3))
    return (*ptrs, ws[0][0])


def _segments(weights: torch.Tensor, experts: torch.Tensor):
    """The pairs sorted by expert: (expert, row, weight, order) of each sorted pair and (start,
    count) of each segment, padded to R*k (count 0 past the last segment); device ops only."""
    R, k = experts.shape
    P = R * k
    e_sorted, order = torch.sort(experts.reshape(-1), stable=True)
    rows = torch.div(order, k, rounding_mode="floor").to(torch.int32)
    w_sorted = weights.reshape(-1).float()[order]
    first = torch.ones(P, dtype=torch.bool, device=experts.device)
    first[1:] = e_sorted[1:] != e_sorted[:-1]
    seg = torch.cumsum(first, 0) - 1
    pos = torch.arange(P, device=experts.device, dtype=torch.int32)
    start = torch.zeros(P + 1, dtype=torch.int32, device=experts.device)
    start.scatter_(0, torch.where(first, seg, P), pos)  # non-first pairs all land in the spare slot P
    count = torch.zeros(P + 1, dtype=torch.int32, device=experts.device)
    count.scatter_add_(0, seg, torch.ones_like(pos))
    return e_sorted.to(torch.int32), rows, w_sorted, order, start[:P], count[:P]


class MoELaunch(NamedTuple):
    """The kernels' tiles: a segment's rows a pass (>= 16, the dot's least), the gate / up kernel's
    output columns a program and its reduction tile over C, the down kernel's output columns a
    program and its reduction tile over I; warps and pipeline stages (None: Triton's default)."""
    block_m: int
    up_i: int = 64
    up_c: int = 64
    down_c: int = 64
    down_i: int = 64
    warps: int | None = None
    stages: int | None = None


def launch_for(rows: int) -> MoELaunch:
    """The launch `fused_moe` uses for `rows` rows: the best settings `benchmarks/moe_sweep.py` found
    on an H100 for qwen3-30b-a3b's experts (`benchmarks/results/moe/moe-sweep-*.json`). One sequence's
    decode rows (1, or a pair) take wide C / narrow I tiles in the up projection and narrow C tiles
    in the down projection: 21% less time than the tiles that suit 8 rows. Past 16 rows (measured at
    32 and 64), wider C tiles in the down projection save 6-8%."""
    if rows == 1:
        return MoELaunch(16, up_i=16, up_c=128, down_c=32, down_i=64)
    if rows == 2:
        return MoELaunch(16, up_i=32, up_c=256, down_c=32, down_i=64)
    block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
    return MoELaunch(block_m, up_i=64 if block_m <= 32 else 32, up_c=64, down_c=128 if rows > 16 else 64, down_i=64)


def fused_moe(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, tables, intermediate: int,
              fp32_dots: bool | None = None) -> torch.Tensor:
    """sum_k weights[r, k] * SwiGLU_{experts[r, k]}(x[r]) for x [R, C] (R <= MAX_ROWS), weights
    [R, k], experts [R, k] (int), `tables` from `expert_tables`, `intermediate` the experts' width.
    x may be of another dtype than the weights (it is cast to theirs). fp32_dots: exact fp32 dots
    (default: for fp32 weights)."""
    return fused_moe_with(x, weights, experts, tables, intermediate, launch_for(x.shape[0]), fp32_dots)


def fused_moe_with(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, tables, intermediate: int,
                   launch: MoELaunch, fp32_dots: bool | None = None) -> torch.Tensor:
    """`fused_moe` at the given launch settings (benchmarks)."""
    from .moe_kernels import moe_down, moe_up

    R, C = x.shape
    if R > MAX_ROWS:
        raise ValueError(f"fused MoE takes at most {MAX_ROWS} rows, got {R}")
    if launch.block_m < 16 or launch.block_m & (launch.block_m - 1):
        raise ValueError(f"fused MoE: block_m must be a power of two >= 16, got {launch.block_m}")
    k = experts.shape[1]
    P, I = R * k, intermediate
    gate, up, down, w0 = tables
    e_sorted, rows, w_sorted, order, start, count = _segments(weights, experts)
    x = x.contiguous()
    ieee = w0.dtype == torch.float32 if fp32_dots is None else fp32_dots
    opts = {name: v for name, v in (("num_warps", launch.warps), ("num_stages", launch.stages)) if v is not None}
    h = torch.empty(P, I, device=x.device, dtype=x.dtype)
    moe_up[(P, -(-I // launch.up_i))](x, x.stride(0), gate, up, w0, e_sorted, rows, start, count, h, C, I,
                                      BLOCK_M=launch.block_m, BLOCK_I=launch.up_i, BLOCK_C=launch.up_c, IEEE=ieee,
                                      **opts)
    y = torch.empty(P, C, device=x.device, dtype=torch.float32)
    moe_down[(P, -(-C // launch.down_c))](h, down, w0, e_sorted, w_sorted, start, count, y, C, I,
                                          BLOCK_M=launch.block_m, BLOCK_C=launch.down_c, BLOCK_I=launch.down_i,
                                          IEEE=ieee, **opts)
    y = torch.empty_like(y).index_copy_(0, order, y)  # back to (row, slot) order
    return y.view(R, k, C).sum(1).to(x.dtype)


def fused_moe_ref(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, modules) -> torch.Tensor:
    """The same sum as a loop: every (row, slot) through its expert in fp32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for r in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = modules[int(experts[r, j])]
            xr = x[r].float()
            h = F.silu(xr @ e.gate_proj.weight.float().T) * (xr @ e.up_proj.weight.float().T)
            out[r] += weights[r, j].float() * (h @ e.down_proj.weight.float().T)
    return out
