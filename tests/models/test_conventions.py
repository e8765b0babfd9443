"""The conventions every transformers causal LM meets, on Orthros.

output_hidden_states / output_attentions (both streams; the reference is the
transformers Llama with the same weights at W >= T, and the masks at W < T),
gradient checkpointing through transformers' API, return_dict=False, and
torch.export of the forward.
"""

import copy

import pytest
import torch

from orthros.models.block import OrthrosBlock

from ..conftest import DEVICE, llama_twin, make_model, rel_err


def ids_and_mask(B=2, T=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, T), generator=g).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    return ids, mask


def test_hidden_states_and_attentions_of_both_streams_equal_llamas():
    """At W >= T with SO at identity both streams are the Llama's residual stream: every
    layer's hidden states and attention probabilities match transformers' own."""
    model = make_model(window=64, perturb_so=False)
    ids, _ = ids_and_mask()
    with torch.no_grad():
        ours = model(ids, output_hidden_states=True, output_attentions=True, output_base_stream=True)
        theirs = llama_twin(model)(ids, output_hidden_states=True, output_attentions=True)
    L = model.config.num_hidden_layers
    # the last layer's base stream makes K/V only: no base state after it, no base attention in it
    for name, n in (("hidden_states", L + 1), ("base_hidden_states", L)):
        assert len(ours[name]) == n
        for a, b in zip(ours[name], theirs.hidden_states):
            assert rel_err(a, b) < 1e-5, name
    for name, n in (("attentions", L), ("base_attentions", L - 1)):
        assert len(ours[name]) == n and ours[name][0].shape == theirs.attentions[0].shape == (2, 4, 11, 11)
        for a, b in zip(ours[name], theirs.attentions):
            assert rel_err(a, b) < 1e-5, name
    torch.testing.assert_close(model.lm_head(ours.hidden_states[-1]), ours.logits)


@pytest.mark.parametrize("attention", ["orthros", "full", "swa"])
def test_what_hidden_states_and_attentions_mean_at_a_short_window(attention):
    """W < T, left padding, prefill (one output position): recorded outputs cover every position
    (each one's output row; `base_hidden_states` on request); each base row's probabilities sum to
    1 inside its window; the output rows' over their whole causal past (within the window for
    "swa"); no real token's row gives padding any. Recording changes no logit, and the rows
    equal those of a forward whose every position is an output position (SPEC invariant 1)."""
    W = 3
    model = make_model(attention, window=W)
    ids, mask = ids_and_mask()
    with torch.no_grad():
        plain = model(ids, attention_mask=mask, logits_to_keep=1)
        every = model(ids, attention_mask=mask)
        out = model(ids, attention_mask=mask, logits_to_keep=1, output_hidden_states=True, output_attentions=True,
                    output_base_stream=True)
    assert rel_err(out.logits, plain.logits) < 1e-6 and out.output_positions.tolist() == [[ids.shape[1] - 1]] * 2
    L, (B, T), C = model.config.num_hidden_layers, ids.shape, model.config.hidden_size
    assert [tuple(h.shape) for h in out.hidden_states] == [(B, T, C)] * (L + 1)
    assert [tuple(h.shape) for h in out.base_hidden_states] == [(B, T, C)] * L
    torch.testing.assert_close(out.base_hidden_states[0], model.model.embed_tokens(ids))
    torch.testing.assert_close(out.hidden_states[0], model.model.embed_tokens(ids))
    torch.testing.assert_close(model.lm_head(out.hidden_states[-1][:, -1:]), out.logits)
    real = mask.bool()
    assert rel_err(model.lm_head(out.hidden_states[-1])[real], every.logits[real]) < 1e-5
    t = torch.arange(T, device=DEVICE)
    sees = (t[None, :] <= t[:, None]) & real[:, None, :]  # [B, T, T]: causal, no padding key
    base_sees = sees & (t[:, None] - t[None, :] < (T if attention == "full" else W))
    out_sees = sees & (t[:, None] - t[None, :] < (W if attention == "swa" else T))
    assert len(out.attentions) == L and len(out.base_attentions) == L - 1
    for pb, po in zip(out.base_attentions + (None,), out.attentions):
        assert po.shape == (B, 4, T, T) and (pb is None or pb.shape == (B, 4, T, T))
        for p, allowed in ((pb, base_sees), (po, out_sees)):
            if p is None:
                continue
            p = p.transpose(1, 2)[real]  # the real query rows: [n, H, S]
            allowed = allowed[real][:, None].expand_as(p)
            assert torch.all(p[~allowed] == 0)
            torch.testing.assert_close(p.sum(-1), torch.ones_like(p[..., 0]))


def test_recorded_tensors_are_on_the_graph():
    """Gradients reach the returned hidden states and attention probabilities (they are
    the tensors the forward computed with, not copies), as with transformers' eager attention."""
    model = make_model(window=3).train()
    ids, mask = ids_and_mask()
    out = model(ids, attention_mask=mask, labels=ids, output_hidden_states=True, output_attentions=True,
                output_base_stream=True)
    recorded = [out.hidden_states[0], out.base_hidden_states[1], out.attentions[0], out.base_attentions[0]]
    for t in recorded:
        t.retain_grad()
    out.loss.backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in recorded)


def test_config_flags_and_decode_step_attentions():
    """The config's output_* flags are the defaults; a decode step's output row attends
    over the whole cache ([B, H, 1, S]); the base stream's only on request."""
    model = make_model(window=3)
    ids, mask = ids_and_mask()
    model.config.output_hidden_states = model.config.output_attentions = True
    with torch.no_grad():
        first = model(ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        step = model(ids[:, :1], attention_mask=torch.cat([mask, mask[:, :1]], 1), past_key_values=first.cache,
                     use_cache=True)
        quiet = model(ids, output_hidden_states=False, output_attentions=False)
    assert len(first.hidden_states) == 3 and step.attentions[0].shape == (2, 4, 1, ids.shape[1] + 1)
    assert first.hidden_states[0].shape == (2, ids.shape[1], 64) and first.base_hidden_states is None
    assert quiet.hidden_states is quiet.attentions is quiet.base_hidden_states is None


def test_return_dict_false_gives_the_fields_as_a_tuple():
    model = make_model(window=3)
    ids, _ = ids_and_mask()
    with torch.no_grad():
        out = model(ids, labels=ids, use_cache=False)
        tup = model(ids, labels=ids, use_cache=False, return_dict=False)
        plain = model(ids, use_cache=False)
        model.config.return_dict = False
        by_config = model(ids, use_cache=False)
    assert isinstance(tup, tuple) and len(tup) == 3  # loss, logits, output_positions
    torch.testing.assert_close(tup[0], out.loss)
    torch.testing.assert_close(tup[1], out.logits)
    assert isinstance(by_config, tuple) and torch.equal(by_config[0], plain.logits)


def enable_checkpointing(model, **kw):
    """transformers' API (renamed activation checkpointing after 5.17; the old name still works)."""
    fn = getattr(model, "activation_checkpointing_enable", None)
    if fn is not None:
        return fn(activation_checkpointing_kwargs=kw)
    return model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_through_transformers_api(reentrant):
    """The blocks are transformers' GradientCheckpointingLayers: enabling checkpointing
    reaches them, every block runs again in the backward pass, and the loss and every
    gradient are unchanged."""
    ids, _ = ids_and_mask()
    grads = []
    for checkpointing in (False, True):
        model = make_model(window=3).train()
        assert all(isinstance(b, OrthrosBlock) for b in model.model.layers)
        if checkpointing:
            enable_checkpointing(model, use_reentrant=reentrant)
            assert all(b.gradient_checkpointing for b in model.model.layers)
        calls = []  # MLP calls (the block's own hooks stay outside the checkpoint on newer transformers)
        for b in model.model.layers:
            b.mlp.register_forward_pre_hook(lambda m, a: calls.append(m))
        loss = model(ids, labels=ids).loss
        n_forward = len(calls)
        loss.backward()
        assert len(calls) == (2 if checkpointing else 1) * n_forward
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = grads
    torch.testing.assert_close(l0, l1)
    for n in g0:
        torch.testing.assert_close(g0[n], g1[n], msg=n)


def test_gradient_checkpointing_refuses_a_cache_it_would_write_twice():
    model = make_model(window=3).train()
    enable_checkpointing(model, use_reentrant=False)
    ids, _ = ids_and_mask()
    with pytest.raises(ValueError, match="second time"):
        model(ids, labels=ids, past_key_values=model.new_cache())
    out = model(ids, labels=ids, use_cache=True)  # asked for, dropped (transformers' convention)
    assert out.cache is None
    with torch.no_grad():  # no backward, nothing recomputed: the cache is filled once
        cache = model(ids, use_cache=True).cache
    assert cache.get_seq_length() == ids.shape[1]


def test_torch_export_without_host_sync():
    """torch.export traces the forward (no .tolist() / .item() on the way), a padded batch
    and a decode step with the cache as input and output."""
    model = make_model(window=3)
    ids, mask = ids_and_mask(T=7)
    ep = torch.export.export(model, (ids,), {"attention_mask": mask, "use_cache": False})
    torch.testing.assert_close(ep.module()(ids, attention_mask=mask, use_cache=False).logits,
                               model(ids, attention_mask=mask, use_cache=False).logits)
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
    tok = ids[:, :1]
    kw = lambda: {"past_key_values": copy.deepcopy(cache), "use_cache": True, "logits_to_keep": 1}
    ep = torch.export.export(model, (tok,), kw())
    got, ref = ep.module()(tok, **kw()), model(tok, **kw())
    torch.testing.assert_close(got.logits, ref.logits)
    assert got.cache.get_seq_length() == ids.shape[1] + 1
    torch.testing.assert_close(got.cache.layers[-1].keys, ref.cache.layers[-1].keys)
