"""The fused MoE step (`ops.moe`) against the fp32 loop over experts. Run under TRITON_INTERPRET=1
on CPU (test_moe_fused.py), or as is on a GPU (`python -m tests.ops.moe_cases [CASE]`)."""

import os
import sys

import torch

from orthros import OrthrosConfig
from orthros.generate import decode_one_token, prefill
from orthros.layers.moe import SparseMoE
from orthros.ops.moe import MAX_ROWS, MoELaunch, expert_tables, fused_moe, fused_moe_ref, fused_moe_with

DEVICE = torch.device("cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def sums_match_the_loop():
    """Every row count up to a tile and past one (1 and 2: a decode step's own launches), k = 1 / 2 / 4,
    widths that are not whole tiles, rows sharing an expert (a segment of several rows), every row on
    one expert; fp32 (and bf16 on a GPU)."""
    dtypes = (torch.float32,) + ((torch.bfloat16,) if DEVICE.type == "cuda" else ())
    for dtype in dtypes:
        for R, k, E, C, I in ((1, 2, 4, 64, 32), (2, 2, 8, 96, 40), (3, 2, 8, 96, 40), (17, 4, 8, 72, 48),
                                (64, 1, 5, 64, 96), (80, 2, 4, 32, 24)):  # past one 64-row tile: a segment in passes
            torch.manual_seed(R)
            cfg = OrthrosConfig.from_name("tiny-moe", num_experts=E, num_experts_per_tok=k, hidden_size=C,
                                          moe_intermediate_size=I)
            moe = SparseMoE(cfg).to(DEVICE, dtype)
            x = torch.randn(R, C, device=DEVICE, dtype=dtype)
            r = moe.route(x)
            for idx in (r.experts, torch.full_like(r.experts, E - 1)):
                got = fused_moe(x, r.weights, idx, expert_tables(moe.experts, DEVICE), I)
                ref = fused_moe_ref(x, r.weights, idx, moe.experts)
                assert got.dtype == dtype and got.shape == (R, C)
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                assert rel(got, ref) < tol, (dtype, R, k, rel(got, ref))
    # other launch settings (benchmarks' sweeps): tiles narrower and wider than the defaults, a segment
    # in passes of 16 rows, widths that are not whole tiles
    torch.manual_seed(2)
    cfg = OrthrosConfig.from_name("tiny-moe", num_experts=8, num_experts_per_tok=2, hidden_size=96,
                                  moe_intermediate_size=40)
    moe = SparseMoE(cfg).to(DEVICE)
    x = torch.randn(20, 96, device=DEVICE)
    r = moe.route(x)
    for idx in (r.experts, torch.full_like(r.experts, 3)):  # every row on one expert: 40 pairs, 3 passes of 16
        ref = fused_moe_ref(x, r.weights, idx, moe.experts)
        for launch in (MoELaunch(16, up_i=16, up_c=32, down_c=32, down_i=16, warps=2),
                       MoELaunch(32, up_i=128, up_c=128, down_c=128, down_i=64, stages=2)):
            got = fused_moe_with(x, r.weights, idx, expert_tables(moe.experts, DEVICE), 40, launch)
            assert rel(got, ref) < 1e-5, (launch, rel(got, ref))
    try:
        fused_moe_with(x, r.weights, r.experts, expert_tables(moe.experts, DEVICE), 40, MoELaunch(8))
        raise AssertionError("block_m 8 was taken")
    except ValueError as e:
        assert "block_m" in str(e)
    # rows of another dtype than the weights (fp64 rows here; bf16 rows over fp32 weights under autocast)
    torch.manual_seed(1)
    cfg = OrthrosConfig.from_name("tiny-moe")
    moe = SparseMoE(cfg).to(DEVICE)
    x = torch.randn(3, cfg.hidden_size, device=DEVICE, dtype=torch.float64)
    r = moe.route(x.float())
    got = fused_moe(x, r.weights, r.experts, expert_tables(moe.experts, DEVICE), cfg.moe_intermediate_size)
    assert got.dtype == torch.float64
    assert rel(got, fused_moe_ref(x, r.weights, r.experts, moe.experts)) < 1e-5


def the_layer_uses_it_for_few_rows():
    """SparseMoE with the fused step (forced on the CPU) equals its loop, its shared expert
    included; more than MAX_ROWS rows or autograd take the loop."""
    import orthros.layers.moe as moe_mod

    torch.manual_seed(0)
    cfg = OrthrosConfig.from_name("tiny-moe", shared_expert_intermediate_size=24)
    moe = SparseMoE(cfg).to(DEVICE)
    calls = []
    real = moe_mod.fused_moe
    moe_mod.fused_moe = lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k)
    try:
        x = torch.randn(2, 5, cfg.hidden_size, device=DEVICE)
        with torch.no_grad():
            loop = moe(x)
            moe.fused = True
            fused = moe(x)
            moe(torch.randn(MAX_ROWS + 1, cfg.hidden_size, device=DEVICE))  # a prefill's rows: the loop
        assert calls == [10], calls
        assert rel(fused, loop) < 1e-5
        moe(x.requires_grad_()).sum().backward()  # training: the loop
        assert calls == [10]
    finally:
        moe_mod.fused_moe = real


def decode_equals_prefill_with_it():
    """A tiny MoE model decoding with the fused step (every routing mode) gives the logits of a
    whole forward at each position."""
    from tests.conftest import make_model

    for routing in ("independent", "bound", "base"):
        model = make_model(window=3, base="tiny-moe", output_routing=routing).to(DEVICE)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "fused"):
                layer.mlp.fused = True
        ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
        with torch.no_grad():
            full = model(ids).logits[0]
            logits, cache = prefill(model, ids[:, :5])
            steps = [logits[0]]
            for t in range(5, 8):
                steps.append(decode_one_token(model, ids[:, t], None, cache)[0])
        got = torch.stack(steps)
        assert rel(got, full[4:8]) < 1e-5, (routing, rel(got, full[4:8]))


CASES = {"sums": sums_match_the_loop, "layer": the_layer_uses_it_for_few_rows, "decode": decode_equals_prefill_with_it}


if __name__ == "__main__":
    for name in sys.argv[1:] or CASES:
        CASES[name]()
    print("ok")
