"""Mixture of experts: the sparse MLP, the output rows' routing modes (docs/moe.md), and SPEC §2's
invariants in every mode on a tiny MoE config."""

import pytest
import torch

from orthros import OrthrosConfig, OrthrosForCausalLM
from orthros.generate import decode_one_token, prefill
from orthros.layers.moe import SparseMoE

from ..conftest import DEVICE, make_model, rel_err

TOL = 1e-5
MODES = ("independent", "bound", "base")


def moe_model(attention="orthros", window=16, routing="independent", **overrides):
    return make_model(attention, window=window, base="tiny-moe", output_routing=routing, **overrides)


def ids_for(T, B=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, T), generator=g).to(DEVICE)


def test_dense_config_has_no_experts():
    cfg = OrthrosConfig.from_name("tiny")
    assert cfg.num_experts == 0 and not any(cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers))
    names = OrthrosForCausalLM(cfg).state_dict().keys()
    assert not any("experts" in n or "mlp.gate." in n for n in names)


def test_named_moe_size_and_sparse_layers():
    cfg = OrthrosConfig.from_name("qwen3-30b-a3b")
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (128, 8, 768)
    cfg = OrthrosConfig.from_name("tiny-moe", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [cfg.is_sparse_layer(i) for i in range(4)] == [False, True, False, False]
    with pytest.raises(ValueError, match="output_routing"):
        OrthrosConfig.from_name("tiny-moe", output_routing="sideways")
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        OrthrosConfig.from_name("tiny-moe", num_experts_per_tok=5)


@pytest.mark.parametrize("norm, shared", [(True, 0), (False, 24)])
def test_sparse_mlp_matches_its_definition(norm, shared):
    """Each row: sum over its top-k experts of weight * SwiGLU_e(x) (+ the gated shared expert)."""
    torch.manual_seed(0)
    cfg = OrthrosConfig.from_name("tiny-moe", norm_topk_prob=norm, shared_expert_intermediate_size=shared)
    moe = SparseMoE(cfg)
    x = torch.randn(3, 5, cfg.hidden_size)
    probs = torch.softmax(moe.gate(x), -1)
    ref = torch.zeros_like(x)
    for b in range(3):
        for t in range(5):
            w, idx = probs[b, t].topk(cfg.num_experts_per_tok)
            w = w / w.sum() if norm else w
            ref[b, t] = sum(wi * moe.experts[int(e)](x[b, t]) for wi, e in zip(w, idx))
            if shared:
                ref[b, t] += torch.sigmoid(moe.shared_expert_gate(x[b, t])) * moe.shared_expert(x[b, t])
    assert rel_err(moe(x), ref) < TOL
    # traced (a compiled or captured decode step): no host read of the routing, the same sum
    traced = torch.compile(moe, backend="eager", fullgraph=True)
    assert rel_err(traced(x), ref) < TOL


@pytest.mark.parametrize("attention, routing", [("orthros", m) for m in MODES] + [("full", "independent"),
                                                                                   ("swa", "bound")])
@pytest.mark.parametrize("T, W", [(9, 3), (40, 1)])
def test_all_phases_agree(attention, routing, T, W):
    """SPEC invariant 1 in every routing mode: pre-training, SFT, prefill, chunked prefill and
    decode give the same logits (in a decode pair the output row's base row is the pair's)."""
    model = moe_model(attention, window=W, routing=routing)
    ids = ids_for(T, seed=T)
    ref = model(ids).logits[0]
    labels = ids.clone()
    labels[:, : T // 2 + 1] = -100
    out = model(ids, labels=labels)
    assert rel_err(out.logits[0], ref[out.output_positions[0]]) < TOL and torch.isfinite(out.loss)
    for t in (0, T // 3, T - 1):
        assert rel_err(model(ids[:, : t + 1], logits_to_keep=1).logits[0, -1], ref[t]) < TOL, t
    for chunk in (1, 4, 64):
        start = T // 2
        logits, cache = prefill(model, ids[:, :start], chunk_size=chunk)
        assert rel_err(logits[0], ref[start - 1]) < TOL, chunk
        for t in range(start, T):
            assert rel_err(decode_one_token(model, ids[:, t], None, cache)[0], ref[t]) < TOL, (chunk, t)


def test_modes_agree_when_window_covers_sequence_and_differ_otherwise():
    """With W >= T and SO at identity an output row equals its base row, so every mode routes
    alike (and Orthros is the full transformer); with a short window the modes differ."""
    ids = ids_for(24, B=2)
    full = moe_model("full", window=24)(ids).logits
    for routing in MODES:
        assert rel_err(moe_model(window=24, routing=routing, perturb_so=False)(ids).logits, full) < TOL
    short = [moe_model(window=2, routing=r)(ids).logits for r in MODES]
    assert rel_err(short[0], short[1]) > 1e-4 and rel_err(short[1], short[2]) > 1e-4


@pytest.mark.parametrize("routing", ["bound", "base"])
def test_output_rows_use_their_base_rows_experts(routing, monkeypatch):
    seen = []
    orig = SparseMoE.forward
    monkeypatch.setattr(SparseMoE, "forward", lambda self, x, r=None: seen.append(r) or orig(self, x, r))
    model = moe_model(window=3, routing=routing)
    model(ids_for(11))  # every position an output position: output row t's base row is row t
    base, out = seen[0], seen[1]  # layer 0 (the last layer routes the output rows themselves)
    assert torch.equal(base.experts, out.experts)
    assert torch.allclose(out.weights.sum(-1), torch.ones(1, 11, device=out.weights.device))
    assert torch.equal(base.weights, out.weights) == (routing == "base")


@pytest.mark.parametrize("routing", MODES)
def test_padding_and_gradients_are_finite(routing):
    model = moe_model(window=1, routing=routing).train()
    ids = ids_for(13, B=2)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    out = model(ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.logits).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("routing", ["bound", "base"])
def test_padded_batch_and_fast_decode_equal_a_row_alone(routing):
    """A left-padded row computes what it computes alone, in one forward and through the
    preallocated cache's decode step (`decode_one_token_fast`, its own layout)."""
    from orthros.generate import decode_one_token_fast, new_static_cache

    model = moe_model(window=3, routing=routing)
    ids = ids_for(15, B=2)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    alone = model(ids[:1, 4:]).logits[0]
    assert rel_err(model(ids, attention_mask=mask).logits[0, 4:], alone) < TOL
    cache = new_static_cache(model, 1, 32)
    logits, cache = prefill(model, ids[:1, 4:8], cache=cache)
    for t in range(8, 15):
        logits = decode_one_token_fast(model, ids[:1, t], cache)
        assert rel_err(logits[0], alone[t - 4]) < TOL, t


@pytest.mark.parametrize("routing", MODES)
def test_load_balancing_loss_counts_the_rows_that_route_themselves(routing, monkeypatch):
    """Each sparse layer balances its base rows (padding left out) and the output rows that chose
    their own experts (every mode's last layer; `independent` everywhere); the loss adds coef x
    aux_loss, and the router gets a gradient from it alone."""
    import orthros.models.model as mm

    seen = []
    real = mm.balance_loss
    monkeypatch.setattr(mm, "balance_loss", lambda layers, E: seen.append(
        [[int(m.sum()) for _, _, m in rec] for rec in layers]) or real(layers, E))
    model = moe_model(window=3, routing=routing, router_aux_loss_coef=0.5).train()
    ids = ids_for(10, B=2)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # three left-padding positions in row 0
    out = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), output_router_logits=True)
    valid, outs = 17, 16  # 10 + 7 tokens; the output rows: every valid position with a next label
    first = [valid, outs] if routing == "independent" else [valid]
    assert seen == [[first, [outs]]]
    plain = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    assert plain.aux_loss is None
    torch.testing.assert_close(out.loss, plain.loss + 0.5 * out.aux_loss)
    model.zero_grad()
    out.aux_loss.backward()
    assert all(b.mlp.gate.weight.grad.abs().sum() > 0 for b in model.model.layers if b.sparse)
    # with activation checkpointing (non-reentrant, as orthros train runs it): the same loss and gradient
    from orthros.models.compat import set_checkpointing

    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    set_checkpointing(model, True)
    model.zero_grad()
    again = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), output_router_logits=True)
    torch.testing.assert_close(again.aux_loss, out.aux_loss)
    again.aux_loss.backward()
    for n, g in want.items():
        torch.testing.assert_close(dict(model.named_parameters())[n].grad, g, msg=n)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="non-reentrant"):
        model(ids, labels=ids, output_router_logits=True)
