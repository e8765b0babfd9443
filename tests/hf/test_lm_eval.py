"""lm-evaluation-harness runs an Orthros checkpoint for real, on local tasks.

Reference: the same tasks run by lm-eval's stock `hf` model on the source
Llama checkpoint. The converted model with W >= T computes that model, so
its log-likelihoods and greedy generations must match; with a small window
the generations must be those of `orthros.generate`.
"""

import importlib.util
import json
import os

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks' data are local jsonl files
os.environ.setdefault("HF_HUB_OFFLINE", "1")

if importlib.util.find_spec("lm_eval") is None and torch.cuda.is_available():
    pytest.skip("lm_eval is not installed in this GPU image (no package index); runs in CPU CI", allow_module_level=True)

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from orthros import cli  # noqa: E402
from orthros.convert import convert_checkpoint  # noqa: E402
from orthros.convert.tiny import make_tiny_checkpoint  # noqa: E402
from orthros.eval.lm_eval_adapter import evaluate  # noqa: E402
from orthros.generate import generate  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
MC = [
    {"question": "def add(a, b):\n    return", "choices": [" a + b", " a - b)", " import"], "answer": 0},
    {"question": "for i in range(10):\n   ", "choices": [" print(i)", " return", " class"], "answer": 0},
    {"question": "import", "choices": [" os", " sys", " re\n"], "answer": 1},
    {"question": "x = [1, 2,", "choices": [" 3]", " 4)", "}"], "answer": 0},
]
GEN = [{"prompt": "def main():\n", "target": "    pass"}, {"prompt": "class A:\n    def", "target": " f"},
       {"prompt": "if __name__ ==", "target": " '__main__':"}]


def write_tasks(d):
    d.mkdir()
    for name, docs in (("mc", MC), ("gen", GEN)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in docs))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {{path}}\ntest_split: test\n"
    (d / "mc.yaml").write_text("task: orthros_test_mc\n" + common.format(path=d / "mc.jsonl") + """\
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    (d / "gen.yaml").write_text("task: orthros_test_gen\n" + common.format(path=d / "gen.jsonl") + """\
output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{target}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 10
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    return d


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """lm-eval on: the source Llama (stock `hf`), Orthros W >= T, Orthros W = 3."""
    tmp = tmp_path_factory.mktemp("lm_eval")
    tasks = write_tasks(tmp / "tasks")
    make_tiny_checkpoint(tmp / "llama", "llama")
    out = {"dirs": {}}
    for name, window in (("wide", 4096), ("narrow", 3)):
        out["dirs"][name] = convert_checkpoint(tmp / "llama", tmp / name, window_size=window, dtype="fp32",
                                               progress=False)
    names = ["orthros_test_mc", "orthros_test_gen"]
    tm = TaskManager(include_path=str(tasks), include_defaults=False)
    out["hf"] = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={tmp / 'llama'},dtype=float32",
                                        device=DEV, batch_size=2, tasks=names, task_manager=tm, log_samples=True)
    for name in ("wide", "narrow"):
        out[name] = evaluate(str(out["dirs"][name]), names, batch_size=2, device=DEV, include_path=str(tasks),
                             log_samples=True)
    out["tasks"] = tasks
    return out


def samples(result, task):
    return sorted(result["samples"][task], key=lambda s: s["doc_id"])


def test_loglikelihoods_equal_the_source_model(runs):
    ref, got = samples(runs["hf"], "orthros_test_mc"), samples(runs["wide"], "orthros_test_mc")
    assert len(got) == len(MC)
    for r, g in zip(ref, got):
        lr = torch.tensor([x[0] for x in r["filtered_resps"]])
        lg = torch.tensor([x[0] for x in g["filtered_resps"]])
        torch.testing.assert_close(lg, lr, rtol=1e-5, atol=1e-4)
    assert runs["wide"]["results"]["orthros_test_mc"]["acc,none"] == runs["hf"]["results"]["orthros_test_mc"]["acc,none"]


def test_loglikelihood_is_the_sum_over_continuation_positions(runs):
    """Recompute one request by hand: every continuation token's position must be an output position."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = runs["dirs"]["narrow"]
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d).eval()
    s = samples(runs["narrow"], "orthros_test_mc")[0]
    ctx, cont = s["arguments"][0][0], s["arguments"][0][1]  # (context, continuation) of choice 0
    whole, ctx_ids = tok.encode(ctx + cont), tok.encode(ctx)
    assert whole[: len(ctx_ids)] == ctx_ids
    ids = torch.tensor([whole])
    with torch.no_grad():
        logp = model(ids).logits.log_softmax(-1)[0]
    n = len(whole) - len(ctx_ids)
    want = sum(float(logp[len(whole) - n - 1 + i, whole[len(whole) - n + i]]) for i in range(n))
    assert abs(s["filtered_resps"][0][0] - want) < 1e-4
    assert abs(want - samples(runs["wide"], "orthros_test_mc")[0]["filtered_resps"][0][0]) > 1e-3  # W matters


def test_loglikelihood_batches_are_padded_to_a_few_lengths(runs):
    """The model sees a multiple of PAD_TO tokens (compiled kernels are built per length); the
    logits handed back are the unpadded call's, cut to the request's length."""
    from orthros.eval.lm_eval_adapter import PAD_TO, OrthrosLM

    lm = OrthrosLM(pretrained=str(runs["dirs"]["narrow"]), batch_size=1, device=DEV, dtype="float32")
    seen = []
    hook = lm.model.register_forward_pre_hook(lambda m, a, kw: seen.append((a[0] if a else kw["input_ids"]).shape[1]),
                                              with_kwargs=True)
    ids = torch.randint(0, lm.model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0)).to(DEV)
    try:
        got = lm._model_call(ids)
    finally:
        hook.remove()
    assert seen == [PAD_TO] and got.shape[:2] == (2, 7)
    with torch.no_grad():
        torch.testing.assert_close(got, lm.model(ids).logits)


def test_loglikelihood_runs_only_the_continuations_as_output_positions(runs):
    """A long prompt is read by the base stream alone: the model is asked for each row's continuation
    positions only, and the log-likelihoods and greedy flags equal those of a call that makes every
    position an output position (lm-eval's one-token-continuation cache, right padding whose zeros
    look like tokens, and a request cut to max_length included)."""
    import numpy as np

    from orthros.eval.lm_eval_adapter import OrthrosLM, _key

    lm = OrthrosLM(pretrained=str(runs["dirs"]["narrow"]), batch_size=3, device=DEV, dtype="float32", max_length=40)
    g = torch.Generator().manual_seed(0)
    tok = lambda n: torch.randint(1, lm.model.config.vocab_size, (n,), generator=g).tolist()
    ctx = tok(20)
    reqs = [(("", ""), c, x) for c, x in ((ctx, [5]), (ctx, [9]), (tok(7), tok(3)), (tok(12) + [0, 0], [0, 4]),
                                          (tok(50), tok(2)), (tok(3), tok(6)))]
    seen = []
    hook = lm.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("logits_to_keep")), with_kwargs=True)
    try:
        got = lm._loglikelihood_tokens(reqs, disable_tqdm=True)
        assert seen and all(k is not None and k.dtype == torch.bool for k in seen)
        assert {int(n) for k in seen for n in k.sum(1)} == {len(c) for _, _, c in reqs}  # a row: its continuation
        seen.clear()
        lm._continuation_mask = lambda inps: None  # every position an output position: lm-eval's stock call
        want = lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    finally:
        hook.remove()
    assert all(k is None for k in seen)
    assert [g_ for _, g_ in got] == [w for _, w in want]
    torch.testing.assert_close(torch.tensor([x for x, _ in got]), torch.tensor([x for x, _ in want]), rtol=1e-5,
                               atol=1e-5)
    # a row two inputs could explain (one is the other with a zero token more) is not guessed at
    lm = OrthrosLM(pretrained=str(runs["dirs"]["narrow"]), batch_size=3, device=DEV, dtype="float32", max_length=40)
    lm._continuations = {}
    for ctx_, cont in ((ctx, [7, 0]), (ctx + [7, 0], [3])):
        k = _key(np.asarray((ctx_ + cont)[:-1], dtype=np.int64))
        lm._continuations[k] = len(cont)
    assert lm._continuation_mask(torch.tensor([ctx + [7, 0, 0, 0]], device=DEV)) is None
    assert lm._continuation_mask(torch.tensor([ctx + [7, 5, 0, 0]], device=DEV)) is None  # no input at all
    assert lm._continuation_mask(torch.tensor([ctx + [7]], device=DEV))[0].nonzero().flatten().tolist() == [19, 20]


def test_generate_until_matches_the_source_and_orthros_generate(runs):
    ref, wide = samples(runs["hf"], "orthros_test_gen"), samples(runs["wide"], "orthros_test_gen")
    assert [s["resps"] for s in wide] == [s["resps"] for s in ref]
    assert any(s["resps"][0][0] for s in wide), "empty generations: the test would not discriminate"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = runs["dirs"]["narrow"]
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d).to(DEV).eval()
    for s in samples(runs["narrow"], "orthros_test_gen"):
        prompt = tok.encode(s["arguments"][0][0])
        new = generate(model, [prompt], max_new_tokens=10, stop_tokens=tok.eos_token_id, fast=False)[0, len(prompt):].tolist()
        text = tok.decode(new, skip_special_tokens=True).split("\n\n")[0]
        assert s["resps"][0][0] == text


def test_cli(runs, tmp_path, capsys):
    out = tmp_path / "res.json"
    rc = cli.main(["eval-harness", str(runs["dirs"]["narrow"]), "--tasks", "orthros_test_mc",
                   "--include-path", str(runs["tasks"]), "--limit", "2", "--output", str(out), "--device", DEV])
    assert rc == 0
    assert "orthros_test_mc" in capsys.readouterr().out
    assert json.loads(out.read_text())["results"]["orthros_test_mc"]["sample_len"] == 2
    assert cli.main(["eval-harness", str(tmp_path), "--tasks", "orthros_test_mc"]) == 2
    assert "not a model directory" in capsys.readouterr().err


def test_an_experiment_finds_the_checkouts_local_tasks_from_any_directory(runs, tmp_path, monkeypatch):
    """`orthros experiment cpt` scores its arms on configs/lm_eval, whose task files name their data
    relative to the checkout: started from another directory, it still finds both, and comes back."""
    import dataclasses

    from orthros.data.tokenizer import load_tokenizer
    from orthros.experiments.cpt import lm_eval_scores
    from orthros.experiments.cpt_arms import PRESETS
    from orthros.loading import load_model

    model = load_model(runs["dirs"]["wide"], dtype=torch.float32).to(DEV).eval()
    preset = dataclasses.replace(PRESETS["smollm2-cpu-smoke"], lm_eval_tasks=["python_syntax"], lm_eval_limit=2)
    monkeypatch.chdir(tmp_path)
    scores = lm_eval_scores(model, load_tokenizer(runs["dirs"]["wide"]), preset)
    assert set(scores) == {"python_syntax"} and 0.0 <= scores["python_syntax"] <= 1.0, scores
    assert os.getcwd() == str(tmp_path)
