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
                "--max-new-tokens", "6", "--out", str(tmp_path / "d"))
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "d" / "demo.json").read_text())
    assert set(res["answers"]) == {"source", "orthros"}
    assert all(a["text"] and a["ttft_s"] > 0 for a in res["answers"].values())
    assert "4 sink tokens" in res["orthros_model"] and res["prefill"]["64"]["orthros"] > 0  # the default conversion
    assert (tmp_path / "d" / "demo.png").stat().st_size > 0
    assert "time to first token" in r.stdout
