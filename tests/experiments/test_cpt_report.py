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
