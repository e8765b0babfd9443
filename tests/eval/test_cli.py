"""`orthros eval` and `orthros experiment` end to end on tiny settings; user mistakes are one-line errors."""

import json

import torch

from orthros import OrthrosConfig, OrthrosForCausalLM
from orthros.cli import main


def _saved_model(tmp_path):
    torch.manual_seed(0)
    model = OrthrosForCausalLM(OrthrosConfig.from_name("tiny", window_size=8))
    model.save_pretrained(tmp_path / "m")
    return str(tmp_path / "m")


def test_eval_all_tasks_writes_json_and_heatmap(tmp_path, capsys):
    path = _saved_model(tmp_path)
    rc = main(["eval", path, "--device", "cpu", "--task", "mqar", "passkey", "ppl", "--out", str(tmp_path / "ev"),
               "--mqar-lengths", "32", "64", "--mqar-kv-pairs", "4", "--mqar-samples", "8",
               "--passkey-lengths", "128", "160", "--passkey-depths", "0", "1", "--passkey-samples", "2",
               "--ppl-seq-len", "64", "--ppl-chunk-size", "16", "--ppl-max-tokens", "256"])
    assert rc == 0
    res = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert set(res["mqar"]["by_length"]) == {"32", "64"}
    assert all(0 <= a <= 1 for a in res["mqar"]["by_length"].values())
    assert set(res["passkey"]["grid"]) == {"128/0", "128/1", "160/0", "160/1"}
    assert res["ppl"]["tokens"] == 4 * 63 and res["ppl"]["ppl"] > 1
    assert (tmp_path / "ev" / "passkey.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "MQAR accuracy" in out and "passkey accuracy" in out and "perplexity" in out


def test_eval_is_deterministic(tmp_path):
    path = _saved_model(tmp_path)
    args = ["eval", path, "--device", "cpu", "--task", "mqar", "--mqar-lengths", "48", "--mqar-kv-pairs", "4",
            "--mqar-vocab", "16", "--mqar-samples", "16"]
    main(args + ["--out", str(tmp_path / "a")])
    main(args + ["--out", str(tmp_path / "b")])
    a, b = (json.loads((tmp_path / d / "eval.json").read_text())["mqar"] for d in "ab")
    assert a == b


def test_eval_user_errors(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "nope")]) == 2
    assert "not a model directory" in capsys.readouterr().err
    path = _saved_model(tmp_path)
    assert main(["eval", path, "--task", "mmlu"]) == 2
    assert "--task" in capsys.readouterr().err
    assert main(["eval", path, "--task", "mqar", "--mqar-vocab", "1024"]) == 2
    assert "vocab" in capsys.readouterr().err
    assert main(["eval", path, "--task", "mqar", "--mqar-lengths", "16", "--mqar-kv-pairs", "8"]) == 2
    assert "seq_len" in capsys.readouterr().err


def test_experiment_smoke_trains_alike_and_tabulates(tmp_path, capsys):
    rc = main(["experiment", "recall", "--preset", "smoke", "--archs", "orthros", "orthros-noso", "full",
               "--device", "cpu", "--out", str(tmp_path / "x")])
    assert rc == 0
    res = json.loads((tmp_path / "x" / "results.json").read_text())
    assert list(res["results"]) == ["orthros", "orthros-noso", "full"]
    assert len({r["params"] for r in res["results"].values()}) == 2  # w/o SO drops only the SO vectors
    assert {r["train"]["steps"] for r in res["results"].values()} == {3}
    table = (tmp_path / "x" / "table.md").read_text()
    assert "| Orthros w/o SO |" in table and "MQAR 128 (8W)" in table
    assert (tmp_path / "x" / "recall.png").stat().st_size > 0
    assert main(["experiment", "recall", "--preset", "nope"]) == 2


def test_train_data_cycles_passkey_lengths_at_equal_tokens():
    import dataclasses

    from orthros.experiments.presets import PRESETS
    from orthros.experiments.recall import TrainData

    preset = dataclasses.replace(PRESETS["smoke"], passkey_lengths=[128, 256], passkey_batch=4)
    data = TrainData(preset, seed=0)
    shapes = [data.batch(step)["passkey"][0].shape for step in range(3)]
    assert shapes == [(4, 128), (2, 256), (4, 128)]
    ids, labels = data.batch(0)["passkey"]
    assert ((labels != -100).sum(1) == 12).all()  # the answer and the needle's second copy (" " + 5 digits each)
    assert torch.equal(ids, TrainData(preset, seed=0).batch(0)["passkey"][0])
    assert not torch.equal(ids, TrainData(preset, seed=1).batch(0)["passkey"][0])
    for name, p in PRESETS.items():  # every preset's training passkeys fit its needle
        if p.passkey_batch:
            TrainData(dataclasses.replace(p, text_bytes=50_000), seed=0).batch(0)
