"""The command line: the demo trains, saves and generates; user mistakes are one-line errors."""

import json
import subprocess
import sys


def orthros(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "orthros", *args], capture_output=True, text=True, timeout=timeout)


def test_demo_then_generate_from_saved_model(tmp_path):
    out = tmp_path / "demo"
    r = orthros("demo", "--recall", "--quick", "--seconds", "3", "--seq-len", "64", "--batch-size", "2", "--max-new-tokens", "5",
                "--prefill-lengths", "128", "256", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    assert (out / "demo.png").stat().st_size > 0
    res = json.loads((out / "demo.json").read_text())
    assert set(res["recall"]) == {"orthros", "full", "swa"} and set(res["prefill"]) == {"128", "256"}
    steps = {m["steps"] for m in res["recall"].values()}
    assert len(steps) == 1  # the three models train for the same number of steps
    assert "Recall: MQAR accuracy" in r.stdout and "Prefill" in r.stdout
    r = orthros("generate", str(out), "--prompt", "import os", "--max-new-tokens", "4", "--seed", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("import os")


def test_generate_from_missing_directory_is_a_clear_error(tmp_path):
    r = orthros("generate", str(tmp_path / "nope"), "--prompt", "x")
    assert r.returncode == 2
    assert "not a model directory" in r.stderr and "Traceback" not in r.stderr


def test_the_real_model_demo_answers_and_times_both_models(tmp_path):
    """`orthros demo` on SmolLM2 (a short document here): both answers, both times, the plot."""
    from .conftest import smollm2_dir

    hf = smollm2_dir("hf")
    r = orthros("demo", "--model-dir", str(hf), "--document-chars", "1200", "--prefill-lengths", "64",
                "--max-new-tokens", "6", "--fact-depths", "0.5", "--out", str(tmp_path / "d"))
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "d" / "demo.json").read_text())
    assert set(res["answers"]) == {"source", "orthros"}
    assert all(a["text"] and a["ttft_s"] > 0 for a in res["answers"].values())
    # the default: 4 sinks and the shipped adapter
    assert "4 sink tokens + light-CPT adapter" in res["orthros_model"] and res["prefill"]["64"]["orthros"] > 0
    (fact,) = res["facts"]  # a code written into the document, asked of both; right = the code in the answer
    assert fact["depth"] == 0.5 and len(fact["code"]) == 5 and fact["tokens"] > 250
    for k in ("source", "orthros"):
        assert fact[k]["text"] and fact[k]["right"] == (fact["code"] in fact[k]["text"])
    assert (tmp_path / "d" / "demo.png").stat().st_size > 0
    assert "time to first token" in r.stdout


def test_the_question_set_contexts_hold_each_fact_at_its_depth():
    from orthros.demo.questions import QUESTIONS, context
    from pydoc_data.topics import topics

    for q in QUESTIONS:
        for depth in (0.1, 0.9):
            text = context(q, 24000, depth)
            own = topics[q.topic]
            at = text.index(own)
            assert abs(len(text) - max(24000, len(own))) < 10
            assert abs(at - depth * (len(text) - len(own))) < 10  # the chapter starts at that depth
            assert text.count(own) == 1


def test_the_real_model_answers_the_question_set(tmp_path, monkeypatch):
    """`orthros demo --questions`, one short question here: both answers, whether each holds the fact,
    the JSON and the Markdown table; --questions with --question or --recall is a one-line error."""
    from orthros.cli import main
    from orthros.demo import questions

    from .conftest import smollm2_dir

    monkeypatch.setattr(questions, "QUESTIONS", questions.QUESTIONS[2:3])  # nonlocal: a 930-character chapter
    out = tmp_path / "q"
    assert main(["demo", "--questions", "--model-dir", str(smollm2_dir("hf")),
                 "--window", "64", "--document-chars", "1500", "--max-new-tokens", "12", "--out", str(out)]) == 0
    res = json.loads((out / "questions.json").read_text())
    (row,) = res["questions"]
    assert row["prompt_tokens"] > 300 and row["topic"] == "nonlocal"
    for k in ("source", "orthros"):
        assert row[k]["answer"] and row[k]["right"] == ("3104" in row[k]["answer"])
    assert "| 1 | Which PEP" in (out / "questions.md").read_text()
    for bad in (["--question", "x"], ["--recall"]):
        assert main(["demo", "--questions", *bad, "--out", str(tmp_path / "x")]) == 2


def test_cpt_arms_are_listed_and_a_misspelt_one_gets_the_near_names(tmp_path, capsys):
    """`orthros experiment cpt --list-arms` prints every arm with its label, the defaults marked; a
    misspelt --arms name is one line naming the close ones; output cut by its reader is no error."""
    from orthros import cli
    from orthros.experiments.cpt_arms import ARMS, DEFAULT_ARMS

    assert cli.main(["experiment", "cpt", "--list-arms"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name, arm in ARMS.items():
        row = next(ln for ln in lines if ln[2:].split()[:1] == [name])
        assert row.startswith("*" if name in DEFAULT_ARMS else " ") and row.endswith(arm.label)
    assert cli.main(["experiment", "cpt", "--arms", "orthros-cpt-sink-mix-awx", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "did you mean" in err and "orthros-cpt-sink-mix-aw," in err
    gone = """
import io, os, sys
from orthros import cli
class Gone(io.TextIOBase):  # a pipe whose reader left
    def write(self, s):
        raise BrokenPipeError(32, "Broken pipe")
    def fileno(self):
        return os.open(os.devnull, os.O_WRONLY)
sys.stdout = Gone()
sys.exit(cli.main(["experiment", "cpt", "--list-arms"]))
"""
    r = subprocess.run([sys.executable, "-c", gone], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Broken pipe" not in r.stderr, r.stderr


def test_the_demo_applies_its_shipped_adapter_only_where_it_was_trained_for(tmp_path, monkeypatch):
    """The default adapter: the shipped light twin at its window and sink count; any other window or sink
    count, or no adapters directory (an installed package), is the zero-shot conversion, with the reason."""
    from orthros.demo import real

    info = json.loads((real.DEFAULT_ADAPTER / "adapter.json").read_text())
    assert real.default_adapter(info["window"], None) == (str(real.DEFAULT_ADAPTER), None)
    assert real.default_adapter(info["window"], info["sink_tokens"])[0] == str(real.DEFAULT_ADAPTER)
    name, why = real.default_adapter(64, None)
    assert name == "none" and f"W={info['window']}" in why
    assert real.default_adapter(info["window"], 0)[0] == "none"
    monkeypatch.setattr(real, "DEFAULT_ADAPTER", tmp_path / "nowhere")
    name, why = real.default_adapter(info["window"], None)
    assert name == "none" and "source checkout" in why
    assert real.with_fact("a\nbb\nccc\n", "F", 0.5) == "a\nF\nbb\nccc\n"  # at a line start, before the middle


def test_the_probes_convert_at_the_window_an_adapter_was_trained_at(monkeypatch):
    """`real.conversion_for` (the demo's probes under benchmarks/): the shipped adapter's own window, 128 for none."""
    from orthros.demo import real

    monkeypatch.setattr(real, "source_and_conversion", lambda d, window, sinks: (d, real.Path(f"w{window}-s{sinks}")))
    assert real.conversion_for("m", str(real.DEFAULT_ADAPTER), 4).name == "w512-s4"
    assert real.conversion_for("m", "none", 4).name == "w128-s4"
    assert real.conversion_for("m", "none", 0, window=256).name == "w256-s0"
