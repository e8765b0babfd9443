"""The CPT table's text, from the results JSON a GPU run wrote (benchmarks/results/)."""

import json
from pathlib import Path

from orthros.experiments.cpt_arms import PRESETS
from orthros.experiments.cpt_report import format_table

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results"


def _results(run: str) -> dict:
    return json.loads((RESULTS / run / "results.json").read_text())["results"]


def test_the_table_names_the_window_each_row_ran_at():
    preset = PRESETS["smollm2-kd-h200-rqp"]
    w512 = _results("cpt-smollm2-rqp-w512")
    table = format_table(w512, preset)
    assert "5.389 | 3.851" in table and "window 512." in table and "window 128" not in table
    both = {**_results("cpt-smollm2-rqp"), **w512}
    table = format_table(both, preset)
    assert table.count("\n| ") == len(both) and "window 128 (W=512 where a row says so)." in table


def test_a_run_with_no_row_at_the_presets_window_names_only_its_own():
    preset = PRESETS["smollm2-kd-h200-rqp"]
    table = format_table(_results("cpt-smollm2-rqp-windows"), preset)
    assert "window 256 / 512, as each row says." in table and "window 128" not in table
    assert "| 5.272 | 3.784 |" in table and "W=256 |" in table


def test_the_demo_columns_appear_once_a_row_has_the_probe():
    preset = PRESETS["smollm2-kd-h200-rqp"]
    rows = _results("cpt-smollm2-rqp-w512")
    assert "demo" not in format_table(rows, preset)  # runs from before the probe: no columns
    arm = next(iter(rows))
    facts = [{"depth": d, "code": "12345", "text": t, "right": r}
             for d, t, r in ((0.1, "12345", True), (0.5, "no", False), (0.9, "12345.", True))]
    probed = {**rows, arm: {**rows[arm], "eval": {**rows[arm]["eval"], "demo": {"margin": 0.7, "facts": facts,
                                                                               "right": 2}}}}
    table = format_table(probed, preset)
    assert "| demo 343 − 634 | demo codes |" in table and "| +0.70 | 2 / 3 |" in table
    ends = [line.rsplit("|", 3)[1:3] for line in table.splitlines() if line.startswith("| ")]
    assert ends.count([" - ", " - "]) == len(rows) - 1 and [" +0.70 ", " 2 / 3 "] in ends
    assert "archive code asked at 10 / 50 / 90% depth" in table


def test_a_run_with_a_demo_curve_gets_its_plot(tmp_path):
    """plot_all draws the demo's margin along training for the arms that scored it, and only then."""
    from orthros.experiments.cpt_report import plot_all

    preset = PRESETS["smollm2-w512-52m"]
    run = _results("cpt-smollm2-rqp-curve/1600x4-w1024")
    saved = [p.name for p in plot_all(run, preset, tmp_path)]
    assert saved == ["cpt.png", "cpt-train.png", "cpt-demo.png"] and (tmp_path / "cpt-demo.png").stat().st_size > 0
    (arm, r), = run.items()
    assert len(r["train"]["demo_curve"]) == 16 and r["train"]["demo_curve"][-1][1] == r["train"]["tokens"]
    with_codes = {arm: {**r, "train": {**r["train"], "demo_curve": [p + [-0.5] for p in r["train"]["demo_curve"]]}}}
    (tmp_path / "codes").mkdir()
    assert "cpt-demo.png" in [p.name for p in plot_all(with_codes, preset, tmp_path / "codes")]  # two panels
    plain = {arm: {**r, "train": {k: v for k, v in r["train"].items() if k != "demo_curve"}}}
    (tmp_path / "plain").mkdir()
    assert "cpt-demo.png" not in [p.name for p in plot_all(plain, preset, tmp_path / "plain")]
