"""Light-CPT adapters: which parameters train, and a saved adapter applied to the base
model reproduces the trained model (LoRA merged: the peft model's own output is the reference)."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from orthros import OrthrosForCausalLM, cli
from orthros.convert.tiny import make_tiny_checkpoint, tiny_tokenizer
from orthros.experiments.cpt_arms import ARMS, PRESETS
from orthros.experiments.cpt_train import train_arm
from orthros.loading import load_model
from orthros.models.adapter import apply_adapter, make_trainable, save_adapter

from ..conftest import DEVICE, make_model, rel_err


def trained(mode, seed=0):
    model = make_model(perturb_so=False, seed=seed)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    p = dataclasses.replace(PRESETS["smollm2-cpu-smoke"], seq_len=48, steps=3, light_lr=5e-2, lora_lr=5e-2,
                            lr=5e-3, gradient_checkpointing=True)  # as the GPU preset trains
    rows = np.random.default_rng(seed).integers(0, model.config.vocab_size, (6, 48)).astype(np.int32)
    model, stats = train_arm(model, mode, p, rows, str(DEVICE), mode)
    return model, base, stats


@pytest.mark.parametrize("mode", ["so-out", "so", "so+norms", "lora+so"])
def test_only_the_mode_s_parameters_train_and_the_adapter_reproduces_the_model(mode, tmp_path):
    model, base, stats = trained(mode)
    assert (stats["peak_memory_gib"] > 0) if DEVICE.type == "cuda" else stats["peak_memory_gib"] is None
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all(("so_" in n) or ("norm" in n and mode != "so") or ("lora_" in n) for n in names)
    assert all(n.endswith(("so_alpha_out", "so_beta_out")) for n in names) == (mode == "so-out")
    assert any("lora_" in n for n in names) == (mode == "lora+so")
    x = torch.randint(0, model.config.vocab_size, (2, 40), device=DEVICE)
    with torch.no_grad():
        want = model(x).logits
    save_adapter(model, tmp_path / "a", {"mode": mode}, lora_dtype=torch.float32)
    fresh = make_model(perturb_so=False)
    fresh.load_state_dict(base)
    apply_adapter(fresh, tmp_path / "a")
    with torch.no_grad():
        got = fresh(x).logits
    assert rel_err(got, want) < 1e-5
    assert rel_err(got, make_model(perturb_so=False)(x).logits) > 1e-4  # training changed something


def test_lora_on_some_projections_wraps_only_those_and_the_adapter_reproduces_the_model(tmp_path):
    """A light arm's `lora_targets` (the `-attn` arms: attention only, the MLPs as the source's)."""
    attn = ("q_proj", "k_proj", "v_proj", "o_proj")
    model = make_model(perturb_so=False)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    p = dataclasses.replace(PRESETS["smollm2-cpu-smoke"], seq_len=48, steps=3, light_lr=5e-2, lora_lr=5e-2,
                            lora_targets=attn)
    rows = np.random.default_rng(0).integers(0, model.config.vocab_size, (6, 48)).astype(np.int32)
    model, _ = train_arm(model, "lora+so", p, rows, str(DEVICE), "attn")
    wrapped = {n.rsplit(".", 2)[-2] for n, _ in model.named_parameters() if "lora_A" in n}
    assert wrapped == set(attn)
    x = torch.randint(0, model.config.vocab_size, (2, 40), device=DEVICE)
    with torch.no_grad():
        want = model(x).logits
    save_adapter(model, tmp_path / "a", {"mode": "lora+so"}, lora_dtype=torch.float32)
    fresh = make_model(perturb_so=False)
    fresh.load_state_dict(base)
    with torch.no_grad():
        assert rel_err(apply_adapter(fresh, tmp_path / "a")(x).logits, want) < 1e-5
    with pytest.raises(ValueError, match="LoRA targets"):
        make_trainable(make_model(), "lora+so", targets=("q_proj", "mlp"))
    assert ARMS["orthros-lora-sink-mix-aw-w512-attn"].recipe["lora_targets"] == attn


def test_lora_on_a_tied_lm_head_trains_its_own_delta_and_merges_untied(tmp_path):
    """The `-head` arms: LoRA on the LM head too. The tied input embedding stays the source's; the
    adapter, applied to a tied base, and the merged model both reproduce the trained model, untied."""
    from orthros.models.adapter import HEAD, LORA_TARGETS, merged_state_dict

    model = make_model(perturb_so=False, tie_word_embeddings=True)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    emb = model.get_input_embeddings().weight.detach().clone()
    p = dataclasses.replace(PRESETS["smollm2-cpu-smoke"], seq_len=48, steps=3, light_lr=5e-2, lora_lr=5e-2,
                            lora_targets=(*LORA_TARGETS, HEAD))
    rows = np.random.default_rng(0).integers(0, model.config.vocab_size, (6, 48)).astype(np.int32)
    model, _ = train_arm(model, "lora+so", p, rows, str(DEVICE), "head")
    assert torch.equal(model.get_input_embeddings().weight, emb)
    names = {n for n, q in model.named_parameters() if q.requires_grad}
    assert {"lm_head.lora_A", "lm_head.lora_B"} <= names
    x = torch.randint(0, model.config.vocab_size, (2, 40), device=DEVICE)
    with torch.no_grad():
        want = model(x).logits
    save_adapter(model, tmp_path / "a", {"mode": "lora+so"}, lora_dtype=torch.float32)
    state = merged_state_dict(model)
    fresh = make_model(perturb_so=False, tie_word_embeddings=True)
    fresh.load_state_dict(base)
    with torch.no_grad():
        got = apply_adapter(fresh, tmp_path / "a")(x).logits
    assert rel_err(got, want) < 1e-5
    assert not fresh.config.tie_word_embeddings and torch.equal(fresh.get_input_embeddings().weight, emb)
    assert rel_err(fresh.lm_head.weight, emb) > 1e-4  # the head moved, the embedding did not
    merged = OrthrosForCausalLM(type(model.config)(**model.config.to_dict())).to(DEVICE).eval()
    assert not merged.config.tie_word_embeddings
    merged.load_state_dict(state)
    with torch.no_grad():
        assert rel_err(merged(x).logits, want) < 1e-5
    assert ARMS["orthros-lora-sink-mix-aw-w1024-head"].recipe["lora_targets"][-1] == HEAD


def test_dora_row_lengths_train_apart_and_the_adapter_reproduces_the_model(tmp_path):
    """DoRA (`-dora` arms, `model.lora_dora`): the wrapped model starts as the model; a layer's
    gradients are those of m * (W + B A s) / ||W + B A s|| with the norm held constant (the fp32
    reference); the saved adapter (row lengths kept fp32 beside bf16 factors) applied to the base,
    and the merged state dict, reproduce the trained model, which the factors alone do not."""
    from safetensors.torch import load_file, save_file

    from orthros.models.adapter import LoRALinear, merged_state_dict

    torch.manual_seed(0)
    lin = torch.nn.Linear(12, 10, bias=True).to(DEVICE)
    layer = LoRALinear(lin, rank=3, alpha=6.0, dora=True)
    with torch.no_grad():
        layer.lora_B.normal_()
        layer.lora_magnitude.mul_(torch.linspace(0.5, 1.5, 10, device=DEVICE))
    x = torch.randn(4, 12, device=DEVICE)
    a, b, m = (t.detach().clone().requires_grad_() for t in (layer.lora_A, layer.lora_B, layer.lora_magnitude))
    v = lin.weight + b @ a * 2.0
    ref = x @ (v * (m / v.norm(dim=1).detach())[:, None]).T + lin.bias
    (ref.square().sum()).backward()
    layer(x).square().sum().backward()
    assert rel_err(layer(x), ref) < 1e-5
    for mine, want in ((layer.lora_A, a), (layer.lora_B, b), (layer.lora_magnitude, m)):
        assert rel_err(mine.grad, want.grad) < 1e-5
    assert rel_err(torch.nn.functional.linear(x, layer.merged_weight(), lin.bias), ref) < 1e-5

    model = make_model(perturb_so=False)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    xs = torch.randint(0, model.config.vocab_size, (2, 40), device=DEVICE)
    with torch.no_grad():
        before = model(xs).logits
        assert rel_err(make_trainable(model, "lora+so", rank=4, dora=True)(xs).logits, before) < 1e-6
    model = make_model(perturb_so=False)
    p = dataclasses.replace(PRESETS["smollm2-cpu-smoke"], seq_len=48, steps=3, light_lr=5e-2, lora_lr=5e-2,
                            lora_rank=4, lora_dora=True)
    rows = np.random.default_rng(0).integers(0, model.config.vocab_size, (6, 48)).astype(np.int32)
    model, _ = train_arm(model, "lora+so", p, rows, str(DEVICE), "dora")
    with torch.no_grad():
        want = model(xs).logits
    save_adapter(model, tmp_path / "a", {"mode": "lora+so"}, lora_dtype=torch.float32)
    info = json.loads((tmp_path / "a" / "adapter.json").read_text())
    assert info["lora"]["dora"] and info["lora"]["rank"] == 4
    fresh = make_model(perturb_so=False)
    fresh.load_state_dict(base)
    with torch.no_grad():
        assert rel_err(apply_adapter(fresh, tmp_path / "a")(xs).logits, want) < 1e-5
    merged = make_model(perturb_so=False)
    merged.load_state_dict(merged_state_dict(model))
    with torch.no_grad():
        assert rel_err(merged(xs).logits, want) < 1e-5
    tensors = load_file(str(tmp_path / "a" / "adapter.safetensors"))
    lengths = [k for k in tensors if k.endswith(".lora_magnitude")]
    assert lengths and len(lengths) == sum(k.endswith(".lora_A") for k in tensors)
    save_file({k: t for k, t in tensors.items() if k not in lengths}, str(tmp_path / "a" / "adapter.safetensors"))
    fresh.load_state_dict(base)
    with torch.no_grad():
        assert rel_err(apply_adapter(fresh, tmp_path / "a")(xs).logits, want) > 1e-4  # the lengths trained
    save_adapter(model, tmp_path / "b", {"mode": "lora+so"})  # bf16 factors, fp32 lengths
    small = load_file(str(tmp_path / "b" / "adapter.safetensors"))
    assert all(t.dtype == (torch.float32 if k.endswith("_magnitude") else torch.bfloat16)
               for k, t in small.items() if ".lora_" in k)
    assert ARMS["orthros-lora-sink-mix-aw-w1024-r16-dora"].recipe["lora_dora"]


def test_so_out_learns_the_output_queries_only():
    """so-out trains the output stream's SO alone: every base-stream row (so every layer's K/V)
    is the untrained model's (to rounding: CUDA kernels may differ in the last bit from call to
    call), the output rows are not."""
    model, base, _ = trained("so-out")
    fresh = make_model(perturb_so=False)
    fresh.load_state_dict(base)
    x = torch.randint(0, model.config.vocab_size, (2, 40), device=DEVICE)
    with torch.no_grad():
        got, want = (m(x, output_hidden_states=True, output_base_stream=True) for m in (model, fresh))
    for g, w in zip(got.base_hidden_states, want.base_hidden_states):
        assert rel_err(g, w) < 1e-6
    assert rel_err(got.logits, want.logits) > 1e-4


def test_a_damaged_or_mismatched_adapter_is_an_error(tmp_path):
    model, _, _ = trained("so")
    save_adapter(model, tmp_path / "a")
    other = OrthrosForCausalLM(type(model.config).from_name("tiny", hidden_size=32, num_attention_heads=2,
                                                          num_key_value_heads=1, head_dim=16))
    with pytest.raises(ValueError, match="does not fit this model"):
        apply_adapter(other, tmp_path / "a")
    (tmp_path / "a" / "adapter.safetensors").write_bytes(b"\x00" * 12)
    with pytest.raises(ValueError, match="damaged adapter"):
        apply_adapter(model, tmp_path / "a")
    with pytest.raises(ValueError, match="needs an Orthros model with scale-offset"):
        make_trainable(make_model(attention="full"), "so")


def test_convert_with_an_adapter_writes_the_merged_model(tmp_path):
    src = tmp_path / "src"
    make_tiny_checkpoint(src, "llama", tokenizer=tiny_tokenizer())
    assert cli.main(["convert", str(src), str(tmp_path / "conv"), "--window-size", "8", "--dtype", "fp32"]) == 0
    model = load_model(tmp_path / "conv")
    model = make_trainable(model, "lora+so", rank=4)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    save_adapter(model, tmp_path / "ad", {"window": 8}, lora_dtype=torch.float32)
    x = torch.randint(0, model.config.vocab_size, (1, 30))
    with torch.no_grad():
        want = model(x).logits
    assert cli.main(["convert", str(src), str(tmp_path / "merged"), "--window-size", "8", "--dtype", "fp32",
                     "--adapter", str(tmp_path / "ad")]) == 0
    merged = load_model(tmp_path / "merged")
    with torch.no_grad():
        assert rel_err(merged(x).logits, want) < 1e-5
    assert (tmp_path / "merged" / "tokenizer.json").exists() and (tmp_path / "merged" / "orthros_adapter.json").exists()
    assert cli.main(["convert", str(src), str(tmp_path / "w16"), "--window-size", "16",
                     "--adapter", str(tmp_path / "ad")]) == 2  # trained for another window


def test_a_full_fine_tune_extracted_at_its_rank_reproduces_it(tmp_path):
    """`orthros extract-adapter`: a fine-tune whose weights moved by rank-2 changes (and whose SO and
    norms moved) comes back from its base exactly at rank 2 (fp32 factors: the logits to 1e-5), with
    a relative error of 0 recorded; at rank 1 the error is recorded and the logits differ. A base of
    another shape, or an unchanged model, is a clear error."""
    src = tmp_path / "src"
    make_tiny_checkpoint(src, "llama", tokenizer=tiny_tokenizer())
    assert cli.main(["convert", str(src), str(tmp_path / "base"), "--window-size", "8", "--dtype", "fp32"]) == 0
    model = load_model(tmp_path / "base")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.ndim == 2 and "layers.1." not in n:  # layer 1's weights stay: left out of the adapter
                p.add_(0.05 * torch.randn(p.shape[0], 2, generator=g) @ torch.randn(2, p.shape[1], generator=g))
            elif p.ndim == 1:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(tmp_path / "trained")
    x = torch.randint(0, model.config.vocab_size, (1, 30))
    with torch.no_grad():
        want = model(x).logits
    for rank in (2, 1):
        out = tmp_path / f"ad{rank}"
        assert cli.main(["extract-adapter", str(tmp_path / "trained"), str(tmp_path / "base"), str(out),
                         "--rank", str(rank), "--lora-dtype", "fp32"]) == 0
        info = json.loads((out / "adapter.json").read_text())
        mods = info["lora"]["modules"]
        assert not any("layers.1." in m for m in mods) and "model.embed_tokens" in mods
        errs = list(info["relative_error"].values())
        got = apply_adapter(load_model(tmp_path / "base"), out)
        if rank == 2:  # and through `orthros convert --adapter`, from the source checkpoint
            assert cli.main(["convert", str(src), str(tmp_path / "merged"), "--window-size", "8", "--dtype", "fp32",
                             "--adapter", str(out)]) == 0
            with torch.no_grad():
                assert rel_err(load_model(tmp_path / "merged")(x).logits, want) < 1e-5
        with torch.no_grad():
            e = rel_err(got(x).logits, want)
        if rank == 2:
            assert max(errs) < 1e-5 and e < 1e-5, (max(errs), e)
        else:
            assert min(errs) > 0.05 and e > 1e-3, (min(errs), e)
    other = tmp_path / "other"
    make_tiny_checkpoint(other, "llama", tokenizer=tiny_tokenizer(), num_hidden_layers=3)
    assert cli.main(["convert", str(other), str(tmp_path / "obase"), "--window-size", "8", "--dtype", "fp32"]) == 0
    assert cli.main(["extract-adapter", str(tmp_path / "trained"), str(tmp_path / "obase"),
                     str(tmp_path / "bad")]) == 2
    assert cli.main(["extract-adapter", str(tmp_path / "base"), str(tmp_path / "base"), str(tmp_path / "same")]) == 2
    assert cli.main(["extract-adapter", str(tmp_path / "nope"), str(tmp_path / "base"), str(tmp_path / "x")]) == 2
