"""The attention layer: scale-offset (SO) parameters, RoPE against transformers."""

import pytest
import torch

from orthros.layers.rope import rope_inv_freq

from ..conftest import DEVICE, make_model


def so_params(model):
    return {n: p for n, p in model.named_parameters() if ".so_" in n}


def test_so_at_identity_init():
    model = make_model(perturb_so=False)
    ps = so_params(model)
    assert len(ps) == 4 * model.config.num_hidden_layers - 2  # the last layer has no base-stream SO
    for n, p in ps.items():
        assert torch.all(p == (1.0 if "alpha" in n else 0.0)), n


@pytest.mark.parametrize("name", ["so_alpha", "so_beta", "so_alpha_out", "so_beta_out"])
def test_each_so_parameter_changes_outputs(name):
    model = make_model(window=4, perturb_so=False)
    ids = torch.randint(0, 256, (1, 20), device=DEVICE)
    before = model(ids).logits
    with torch.no_grad():
        getattr(model.model.layers[0].self_attn, name).add_(0.5)
    after = model(ids).logits
    assert (after - before).abs().max() > 1e-4


def test_no_so_parameters_without_scale_offset_or_second_stream():
    for kw in (dict(scale_offset=False), dict(attention="full"), dict(attention="swa")):
        model = make_model(**kw)
        assert not so_params(model), kw
    a = make_model(scale_offset=False)
    b = make_model()
    n_so = sum(p.numel() for p in so_params(b).values())
    assert sum(p.numel() for p in b.parameters()) - sum(p.numel() for p in a.parameters()) == n_so


def test_so_params_get_gradients():
    model = make_model(window=3).train()
    ids = torch.randint(0, 256, (2, 12), device=DEVICE)
    model(ids, labels=ids).loss.backward()
    last = model.config.num_hidden_layers - 1
    for n, p in so_params(model).items():
        if f"layers.{last}." in n and not n.endswith("_out"):
            assert p.grad is None, f"{n}: the last layer's base stream is skipped, so its SO is unused"
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0, n


@pytest.mark.parametrize("scaling", [None, dict(rope_type="linear", factor=4.0),
                                     dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=64)])
def test_rope_inv_freq_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "default", "rope_theta": 10000.0} if scaling is None else {**scaling, "rope_theta": 10000.0}
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_parameters=params,
                      max_position_embeddings=256)
    kind = params["rope_type"]
    if kind == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        ref, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[kind](cfg, None)
    ours = rope_inv_freq(16, 10000.0, scaling)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)


def test_qk_norm_model_runs_and_differs():
    a = make_model(qk_norm=True, seed=1)
    assert hasattr(a.model.layers[0].self_attn, "q_norm") and a.model.layers[0].self_attn.q_norm is not None
    ids = torch.randint(0, 256, (1, 9), device=DEVICE)
    assert torch.isfinite(a(ids).logits).all()


@torch.no_grad()
def test_decode_pair_so_rows_are_kept_per_shape_and_follow_the_parameters():
    """A two-stream group's per-row SO ([T base rows | R - T output rows]) is made once per shape and
    reused, and a change of the SO parameters (in place) is seen at the next call."""
    attn = make_model("orthros", window=6).model.layers[0].self_attn
    attn.so_alpha.uniform_(0.5, 1.5)
    attn.so_alpha_out.uniform_(0.5, 1.5)
    a, b = attn._so_rows(3, 5)
    assert torch.equal(a, torch.cat([attn.so_alpha.expand(3, -1), attn.so_alpha_out.expand(2, -1)]))
    assert torch.equal(b, torch.cat([attn.so_beta.expand(3, -1), attn.so_beta_out.expand(2, -1)]))
    assert attn._so_rows(3, 5)[0] is a  # kept
    attn.so_beta_out.add_(1.0)
    a2, b2 = attn._so_rows(3, 5)
    assert torch.equal(b2[3:], attn.so_beta_out.expand(2, -1)) and torch.equal(a2, a)
    with torch.enable_grad():
        assert attn._so_rows(3, 5)[0] is not a2  # with autograd: made afresh (gradients reach the parameters)
