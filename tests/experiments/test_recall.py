"""The recall experiment's training recipe: its baselines, its batches and its loss weights."""

import dataclasses
import math

import pytest
import torch

from orthros.data.tokenizer import ByteTokenizer
from orthros.eval.passkey import passkey_batch
from orthros.experiments.presets import PRESETS, Preset
from orthros.experiments.recall import TrainData, train_model
from orthros.models import OrthrosForCausalLM


def _tiny(**changes) -> Preset:
    return dataclasses.replace(PRESETS["smoke"], text_bytes=50_000, **changes)


def test_full_baseline_is_a_llama_in_loss_and_gradients():
    """The experiment's `full` model is transformers' Llama with the same weights: the same loss
    and gradients on a passkey batch whose loss sits on a few output positions only."""
    transformers = pytest.importorskip("transformers")
    preset = dataclasses.replace(PRESETS["cpu"], hidden_size=64, heads=4, kv_heads=2)
    cfg = preset.model_config("full")
    torch.manual_seed(0)
    ours = OrthrosForCausalLM(cfg)
    with torch.no_grad():  # norms off identity, so their placement matters
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    llama_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
        attn_implementation="eager")
    llama = transformers.LlamaForCausalLM(llama_cfg)
    llama.load_state_dict(ours.state_dict(), strict=True)
    llama.tie_weights()
    tok = ByteTokenizer()
    hay = torch.randint(0, 256, (4000,), generator=torch.Generator().manual_seed(1))
    ids, labels, _ = passkey_batch(hay, tok.encode, 3, 192, None, seed=2, copy_labels=True)
    a = ours(ids, labels=labels, use_cache=False).loss
    b = llama(ids, labels=labels).loss
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    a.backward()
    b.backward()
    theirs = dict(llama.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_passkey_first_steps_train_the_passkey_alone():
    preset = _tiny(passkey_lengths=[128, 160], passkey_batch=4, passkey_first=2)
    data = TrainData(preset, seed=0)
    early, late = data.batch(1), data.batch(2)
    assert set(early) == {"passkey"} and early["passkey"][0].shape == (4, 128)
    assert set(late) == {"mqar", "text", "passkey"}
    assert set(TrainData(_tiny(passkey_first=2, passkey_batch=0), seed=0).batch(0)) == {"mqar", "text"}


def test_late_passkey_lengths_replace_the_early_ones_at_equal_tokens():
    preset = _tiny(passkey_lengths=[128], passkey_batch=4, passkey_lengths_late=[128, 256], passkey_late_from=2)
    data = TrainData(preset, seed=0)
    shapes = [data.batch(step)["passkey"][0].shape for step in range(5)]
    assert shapes == [(4, 128), (4, 128), (4, 128), (2, 256), (4, 128)]


def test_passkey_weight_scales_the_passkey_loss():
    """Weight 0 trains exactly what no passkey data trains (the other tasks' batches do not
    depend on it); weight 1 trains something else."""

    def weights(**changes):
        model, _ = train_model("full", _tiny(steps=2, **changes), TrainData(_tiny(**changes), seed=0))
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    without = weights(passkey_batch=0)
    assert torch.equal(weights(passkey_weight=0.0), without)
    assert not torch.allclose(weights(passkey_weight=1.0), without)


def test_moe_variants_train_alike_and_run_every_probe(tmp_path):
    """The MoE variants of the recall comparison: the same active width a token as the dense models
    (k experts of 3h / k), every layer sparse, the load-balancing loss in training, the three routing
    modes; the smoke preset trains and evaluates them end to end."""
    from orthros.experiments.presets import DEFAULT_ARCHS
    from orthros.experiments.recall import run_experiment

    p = PRESETS["smoke"]
    dense, moe = p.model_config("orthros"), p.model_config("orthros-moe-bound")
    assert moe.num_experts_per_tok * moe.moe_intermediate_size == dense.intermediate_size
    assert moe.output_routing == "bound" and moe.output_router_logits and moe.attention == "orthros"
    assert p.model_config("full-moe").attention == "full" and "full-moe" not in DEFAULT_ARCHS
    model = OrthrosForCausalLM(moe)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    out = model(ids, labels=ids, use_cache=False)
    assert out.aux_loss is not None and out.aux_loss > 0  # balancing counted in the training loss
    res = run_experiment("smoke", ("full-moe", "orthros-moe", "orthros-moe-bound"), out=tmp_path)["results"]
    for arch, r in res.items():
        assert set(r["eval"]) >= {"mqar", "passkey", "ppl"}, arch
        assert math.isfinite(r["eval"]["ppl"]["ppl"]) and r["params"] > 0
    assert res["orthros-moe"]["params"] == res["orthros-moe-bound"]["params"]
