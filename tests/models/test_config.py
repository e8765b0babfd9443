import pytest

from orthros import OrthrosConfig


@pytest.mark.parametrize("name", ["tiny", "small", "160m", "1.3b", "llama-3.1-8b", "qwen3-8b"])
def test_presets_build_and_roundtrip(name):
    c = OrthrosConfig.from_name(name)
    c2 = OrthrosConfig.from_dict(c.to_dict())
    for f in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim", "window_size", "attention"):
        assert getattr(c2, f) == getattr(c, f)


def test_llama_and_qwen_shapes_are_exact():
    l = OrthrosConfig.from_name("llama-3.1-8b")
    assert (l.vocab_size, l.hidden_size, l.intermediate_size, l.num_hidden_layers) == (128256, 4096, 14336, 32)
    assert (l.num_attention_heads, l.num_key_value_heads, l.head_dim) == (32, 8, 128)
    assert l.rope_scaling["rope_type"] == "llama3" and l.rope_theta == 500000.0
    q = OrthrosConfig.from_name("qwen3-8b")
    assert (q.vocab_size, q.hidden_size, q.intermediate_size, q.num_hidden_layers) == (151936, 4096, 12288, 36)
    assert q.qk_norm and q.rope_theta == 1e6


def test_overrides_win():
    c = OrthrosConfig.from_name("tiny", window_size=5, attention="swa")
    assert c.window_size == 5 and c.attention == "swa"


@pytest.mark.parametrize("kwargs, field", [
    (dict(window_size=0), "window_size"),
    (dict(window_size=2.5), "window_size"),
    (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads"),
    (dict(attention="linear"), "attention"),
    (dict(head_dim=15), "head_dim"),
    (dict(attn_backend="cuda-magic"), "attn_backend"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=2.0)), "rope_scaling"),
    (dict(rope_scaling=dict(rope_type="llama3", factor=8.0)), "rope_scaling"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        OrthrosConfig.from_name("tiny", **kwargs)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown config name"):
        OrthrosConfig.from_name("gpt-5")
