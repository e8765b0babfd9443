"""`orthros convert`: Llama 3 / Qwen3 / Qwen3-MoE checkpoints -> Orthros.

The reference is the source model itself, run by transformers: with W >= T
and SO at identity the converted model must give its logits at every
position (SPEC invariant 2); with a small W it must agree before position W
and differ after.
"""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from orthros import OrthrosForCausalLM, cli
from orthros.convert import convert_checkpoint
from orthros.convert.tiny import make_tiny_checkpoint, tiny_tokenizer

from ..conftest import DEVICE, rel_err

TEXT = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nclass Point:\n    x: int = 0\n"


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_moe"])
def source(request, tmp_path_factory, tok):
    """(arch, checkpoint dir, the transformers model it holds)."""
    d = tmp_path_factory.mktemp(request.param) / "src"
    hf = make_tiny_checkpoint(d, request.param, tokenizer=tok)
    assert len(list(d.glob("*.safetensors"))) > 1, "want a sharded source"
    return request.param, d, hf.to(DEVICE)


def ids_of(tok, n_rows=2):
    ids = torch.tensor([tok.encode(TEXT)] * n_rows)
    ids[1:] = ids[1:].roll(7, dims=1)
    return ids.to(DEVICE)


def load(d):
    return AutoModelForCausalLM.from_pretrained(d).to(DEVICE).eval()


def no_leftovers(dst):
    assert not dst.exists()
    assert not [p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.partial")]


def test_converted_logits_equal_the_source_model_at_every_position(source, tmp_path, tok):
    arch, src, hf = source
    dst = convert_checkpoint(src, tmp_path / "out", window_size=4096, dtype="fp32", progress=False)
    model = load(dst)
    assert type(model) is OrthrosForCausalLM and model.config.attention == "orthros"
    qwen = arch.startswith("qwen3")
    assert model.config.qk_norm == qwen and model.config.tie_word_embeddings == qwen
    assert model.config.num_experts == (4 if arch == "qwen3_moe" else 0)
    ids = ids_of(tok)
    with torch.no_grad():
        ref, out = hf(ids).logits, model(ids).logits
    assert out.shape == ref.shape
    assert rel_err(out, ref) < 1e-5
    # The tokenizer travelled with the weights.
    assert AutoTokenizer.from_pretrained(dst).encode(TEXT) == tok.encode(TEXT)


def test_small_window_runs_and_differs_after_the_window(source, tmp_path, tok):
    _, src, hf = source
    W = 4
    model = load(convert_checkpoint(src, tmp_path / "out", window_size=W, dtype="fp32", progress=False))
    ids = ids_of(tok)
    with torch.no_grad():
        ref, out = hf(ids).logits, model(ids).logits
    assert torch.isfinite(out).all()
    assert rel_err(out[:, :W], ref[:, :W]) < 1e-5  # the window still covers the whole prefix
    assert rel_err(out[:, W + 4:], ref[:, W + 4:]) > 1e-3


def test_sinks_keep_the_first_tokens_in_view(source, tmp_path, tok):
    """With sinks covering the whole prompt the converted model is the source; with a few, it sits
    between the source and the plain window."""
    _, src, hf = source
    ids = ids_of(tok)
    with torch.no_grad():
        ref = hf(ids).logits
        every = load(convert_checkpoint(src, tmp_path / "all", window_size=2, sink_tokens=ids.shape[1], dtype="fp32",
                                        progress=False))(ids).logits
        some = load(convert_checkpoint(src, tmp_path / "some", window_size=2, sink_tokens=1, dtype="fp32",
                                       progress=False))(ids).logits
    assert rel_err(every, ref) < 1e-5
    assert rel_err(some, ref) > 1e-3 and torch.isfinite(some).all()


def test_bf16_output_is_the_source_rounded_and_so_is_at_identity(source, tmp_path):
    _, src, _ = source
    dst = convert_checkpoint(src, tmp_path / "out", window_size=8, dtype="bf16", progress=False)
    files = list(dst.glob("*.safetensors"))
    assert json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16"
    ref = {}  # the source as written (transformers' in-memory Qwen3-MoE fuses its experts)
    for f in src.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            ref.update({k: st.get_tensor(k) for k in st.keys()})
    seen = set()
    for f in files:
        with safe_open(f, "pt") as st:
            for k in st.keys():
                t = st.get_tensor(k)
                seen.add(k)
                assert t.dtype == torch.bfloat16, k
                if ".so_" in k:
                    assert torch.equal(t, torch.ones_like(t) if "alpha" in k else torch.zeros_like(t)), k
                else:
                    assert torch.equal(t, ref[k].to(torch.bfloat16)), k
    model = load(dst)
    assert model.dtype == torch.bfloat16
    assert seen == set(model.state_dict()) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())


def test_no_scale_offset_sharding_and_small_blocks(source, tmp_path, tok):
    """The w/o-SO ablation; output split into shards; tensors streamed in tiny blocks."""
    _, src, hf = source
    dst = convert_checkpoint(src, tmp_path / "out", window_size=4096, scale_offset=False, dtype="fp32",
                             max_shard_size="100KB", block_bytes=999, progress=False)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not any(".so_" in k for k in index["weight_map"])
    model = load(dst)
    assert model.config.scale_offset is False
    ids = ids_of(tok)
    with torch.no_grad():
        assert rel_err(model(ids).logits, hf(ids).logits) < 1e-5


def test_converted_model_generates_like_the_source_model(source, tmp_path, tok):
    _, src, hf = source
    model = load(convert_checkpoint(src, tmp_path / "out", window_size=4096, dtype="fp32", progress=False))
    ids = ids_of(tok, 1)[:, :12]
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=None)
    assert model.generate(ids, **kw).tolist() == hf.generate(ids, **kw).tolist()
    # Beam search reorders the OrthrosCache rows; several samples per prompt expand them.
    beams = dict(kw, num_beams=3, num_return_sequences=2)
    assert model.generate(ids, **beams).tolist() == hf.generate(ids, **beams).tolist()
    runs = []
    for m in (model, hf):
        torch.manual_seed(0)
        runs.append(m.generate(ids, **dict(kw, do_sample=True, num_return_sequences=3)).tolist())
    assert runs[0] == runs[1]


# ------------------------------------------------------------------ bad input
@pytest.fixture
def llama_src(tmp_path, tok):
    d = tmp_path / "src"
    make_tiny_checkpoint(d, "llama", tokenizer=tok)
    return d


def edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("change, match", [
    (dict(model_type="mistral", architectures=["MistralForCausalLM"]), "unsupported architecture.*mistral"),
    (dict(intermediate_size=96), r"shape mismatch for model.layers.0.mlp.\w+_proj.weight"),
    (dict(num_hidden_layers=3), "lacks .*model.layers.2"),
    (dict(num_hidden_layers=1), "has 9 tensor.*model.layers.1"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(attention_bias=True), "attention_bias"),
])
def test_bad_config_is_a_clear_error_and_leaves_nothing(llama_src, tmp_path, change, match):
    edit_config(llama_src, **change)
    dst = tmp_path / "out"
    with pytest.raises(ValueError, match=match):
        convert_checkpoint(llama_src, dst, progress=False)
    no_leftovers(dst)


def test_missing_and_truncated_shards(llama_src, tmp_path):
    dst = tmp_path / "out"
    shards = sorted(llama_src.glob("model-*.safetensors"))
    data = shards[-1].read_bytes()
    shards[-1].write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=f"{shards[-1].name}: truncated"):
        convert_checkpoint(llama_src, dst, progress=False)
    no_leftovers(dst)
    shards[1].unlink()
    with pytest.raises(FileNotFoundError, match=f"missing shard.*{shards[1].name}"):
        convert_checkpoint(llama_src, dst, progress=False)
    no_leftovers(dst)


def test_failure_while_writing_leaves_nothing(llama_src, tmp_path, monkeypatch):
    import orthros.convert.hf as conv

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(conv, "_carry_files", boom)  # after every shard is written
    dst = tmp_path / "out"
    with pytest.raises(OSError, match="disk full"):
        convert_checkpoint(llama_src, dst, progress=False)
    no_leftovers(dst)


def test_existing_destination(llama_src, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="already exists and is not an empty directory"):
        convert_checkpoint(llama_src, dst, progress=False)
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]
    (dst / "keep.txt").unlink()  # an empty directory is fine
    convert_checkpoint(llama_src, dst, progress=False)
    assert (dst / "config.json").exists()


def test_cli(llama_src, tmp_path, capsys):
    dst = tmp_path / "out"
    assert cli.main(["convert", str(llama_src), str(dst), "--window-size", "8", "--dtype", "fp32"]) == 0
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["window_size"] == 8 and cfg["model_type"] == "orthros" and cfg["dtype"] == "float32"
    assert cli.main(["convert", str(llama_src), str(dst)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert cli.main(["convert", str(tmp_path / "nope"), str(tmp_path / "o2")]) == 2
    assert "does not exist" in capsys.readouterr().err
    shutil.rmtree(dst)
    for flag, bad in (("--window-size", "0"), ("--sink-tokens", "-1")):  # the parser's error, before any work
        with pytest.raises(SystemExit) as e:
            cli.main(["convert", str(llama_src), str(dst), flag, bad])
        assert e.value.code == 2 and f"argument {flag}: must be" in capsys.readouterr().err
    no_leftovers(dst)
    assert cli.main(["convert", str(llama_src), str(dst), "--window-size", "8", "--sink-tokens", "4"]) == 0
    assert json.loads((dst / "config.json").read_text())["sink_tokens"] == 4


@pytest.mark.parametrize("overrides", [dict(norm_topk_prob=False, mlp_only_layers=[0]),
                                       dict(num_hidden_layers=4, decoder_sparse_step=2)])
@pytest.mark.parametrize("routing", ["independent", "bound"])
def test_qwen3_moe_layer_choices_equal_the_source(tmp_path, tok, overrides, routing):
    """Dense and sparse layers where Qwen3-MoE puts them, top-k weights with and without
    renormalisation; at W >= T every output routing mode computes the source model."""
    src = tmp_path / "src"
    hf = make_tiny_checkpoint(src, "qwen3_moe", tokenizer=tok, **overrides).to(DEVICE)
    dst = convert_checkpoint(src, tmp_path / "out", window_size=4096, dtype="fp32", progress=False)
    model = AutoModelForCausalLM.from_pretrained(dst, output_routing=routing).to(DEVICE).eval()
    ids = ids_of(tok)
    with torch.no_grad():
        assert rel_err(model(ids).logits, hf(ids).logits) < 1e-5


def test_qwen3_moe_load_balancing_loss_equals_the_source(tmp_path, tok):
    """With output_router_logits, the loss adds router_aux_loss_coef x the load-balancing loss over
    the rows each layer routes. With every position an output position, the same-code Transformer
    (`full`) and Orthros at W >= T (its output rows repeat its base rows) give transformers' loss and
    aux_loss; with the labels' output positions the last layer routes one row fewer (the last
    position predicts nothing and is not run there), within 1%. `--output-routing` sets the
    converted config's mode, and a dense model refuses it."""
    src = tmp_path / "src"
    hf = make_tiny_checkpoint(src, "qwen3_moe", tokenizer=tok, router_aux_loss_coef=0.05).to(DEVICE)
    dst = convert_checkpoint(src, tmp_path / "out", window_size=4096, dtype="fp32", progress=False)
    model = load(dst)
    full = AutoModelForCausalLM.from_pretrained(dst, attention="full").to(DEVICE).eval()
    assert model.config.router_aux_loss_coef == 0.05 and not model.config.output_router_logits
    ids = ids_of(tok)
    every = torch.arange(ids.shape[1], device=DEVICE)[None].expand(ids.shape[0], -1)
    with torch.no_grad():
        ref = hf(ids, labels=ids, output_router_logits=True)
        same = [m(ids, labels=ids, logits_to_keep=every, output_router_logits=True) for m in (full, model)]
        got = model(ids, labels=ids, output_router_logits=True)
        plain = model(ids, labels=ids)
    assert plain.aux_loss is None and ref.aux_loss > 0
    for out in same:
        assert abs(out.aux_loss.item() - ref.aux_loss.item()) < 1e-5 * ref.aux_loss.item()
        assert abs(out.loss.item() - ref.loss.item()) < 1e-5 * ref.loss.item()
    assert abs(got.aux_loss.item() - ref.aux_loss.item()) < 1e-2 * ref.aux_loss.item()
    assert abs(got.loss.item() - plain.loss.item() - 0.05 * got.aux_loss.item()) < 1e-5
    bound = convert_checkpoint(src, tmp_path / "bound", window_size=16, dtype="fp32", progress=False,
                               output_routing="bound")
    assert load(bound).config.output_routing == "bound"
    dense = tmp_path / "dense"
    make_tiny_checkpoint(dense, "llama", tokenizer=tok)
    with pytest.raises(ValueError, match="only a mixture-of-experts checkpoint"):
        convert_checkpoint(dense, tmp_path / "d-out", output_routing="bound", progress=False)


def test_mixtral_converts_to_the_same_logits(tmp_path, tok):
    """Mixtral's tensors are renamed to Qwen3-MoE's layout (`block_sparse_moe.experts.{e}.w1` ->
    `mlp.experts.{e}.gate_proj`); at W >= T the logits are the source model's."""
    src = tmp_path / "src"
    hf = make_tiny_checkpoint(src, "mixtral", tokenizer=tok).to(DEVICE)
    dst = convert_checkpoint(src, tmp_path / "out", window_size=4096, dtype="fp32", progress=False)
    model = load(dst)
    assert model.config.num_experts == 4 and model.config.norm_topk_prob
    ids = ids_of(tok)
    with torch.no_grad():
        assert rel_err(model(ids).logits, hf(ids).logits) < 1e-5
