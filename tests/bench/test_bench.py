"""`orthros bench`: both subcommands run end to end on a tiny model, and the table arithmetic."""

import json

import pytest

from orthros.bench.prefill import estimates, parse_len, table
from orthros.cli import main


def test_prefill_runs_and_renders(tmp_path):
    doc = tmp_path / "b.md"
    doc.write_text("x\n<!-- prefill-table:begin -->\nold\n<!-- prefill-table:end -->\ny\n")
    rc = main(["bench", "prefill", "--models", "tiny", "--lengths", "48", "96", "--layers", "1", "--chunk-size", "64",
               "--max-quadratic", "48", "--max-hf", "48", "--device", "cpu", "--out-dir", str(tmp_path), "--docs", str(doc)])
    assert rc == 0
    result = json.loads((tmp_path / "prefill.json").read_text())
    got = {(r["variant"], r["T"]): r["status"] for r in result["rows"]}
    assert got[("orthros", 96)] == "ok" and got[("floor", 96)] == "ok" and got[("full", 96)] == "skipped"
    assert (tmp_path / "prefill.png").stat().st_size > 0
    text = doc.read_text()
    assert "old" not in text and "| 96 |" in text and text.startswith("x\n") and text.endswith("y\n")


def test_prefill_full_attention_chunks_from_its_threshold(tmp_path):
    """--full-chunk-from: full attention prefills long prompts in chunks too, marked in the table."""
    rc = main(["bench", "prefill", "--models", "tiny", "--lengths", "48", "96", "--layers", "1", "--chunk-size", "32",
               "--full-chunk-from", "96", "--variants", "full", "floor", "--max-quadratic", "96", "--device", "cpu",
               "--out-dir", str(tmp_path), "--docs", "none"])
    assert rc == 0
    rows = json.loads((tmp_path / "prefill.json").read_text())["rows"]
    chunk = {(r["variant"], r["T"]): r["chunk"] for r in rows}
    assert chunk == {("full", 48): None, ("full", 96): 32, ("floor", 48): 32, ("floor", 96): 32}
    md = (tmp_path / "prefill.md").read_text()
    assert "s† (" in md and "prefilled in 32 chunks" in md


def test_train_runs(tmp_path):
    rc = main(["bench", "train", "--config", "tiny", "--seq-len", "64", "--steps", "1", "--warmup", "0", "--device", "cpu",
               "--out-dir", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "train_bench.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["orthros", "full"] and all(r["step_s"] > 0 for r in rows)


def test_quadratic_estimate():
    """Skipped full-attention rows: floor(T) + (full - floor at the longest timed T) * (T / T_ref)^2."""
    rows = [dict(model="m", variant=v, T=T, status="ok", time_s=t, peak_gib=1.0, layers=2)
            for v, T, t in [("floor", 100, 1.0), ("full", 100, 3.0), ("floor", 200, 2.0), ("orthros", 200, 2.1)]]
    rows.append(dict(model="m", variant="full", T=200, status="skipped", layers=2))
    est = estimates(rows)
    assert est[("m", "full", 200)] == pytest.approx(2.0 + 2.0 * 4)
    md = table(dict(rows=rows, env=dict(date="d", gpu="g", torch="t", transformers="x"), command="c", dtype="bf16",
                    window=4, chunk_size=64, breakdown=None))
    assert "~10 s est." in md and "~4.76×" in md


def test_bad_lengths_are_user_errors():
    with pytest.raises(ValueError, match="length"):
        parse_len("12Q")
    assert parse_len("32K") == 32768 and parse_len("1M") == 1 << 20


def test_from_json_merges_runs(tmp_path):
    """Two saved runs (say one per model shape) re-render as one table: every row, both commands and dates."""
    env = dict(gpu="g", torch="t", transformers="x")
    run = lambda model, date, cmd: dict(
        rows=[dict(model=model, variant=v, T=64, status="ok", time_s=t, peak_gib=1.0, layers=2)
              for v, t in (("orthros", 1.0), ("floor", 0.9), ("full", 2.0))],
        env={**env, "date": date}, command=cmd, dtype="bf16", window=4, chunk_size=64, breakdown=None)
    paths = []
    for i, model in enumerate(("a-shape", "b-shape")):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(run(model, f"day{i}", f"cmd{i}")))
    out = tmp_path / "out"
    assert main(["bench", "prefill", "--from-json", *map(str, paths), "--out-dir", str(out), "--docs", "none"]) == 0
    md = (out / "prefill.md").read_text()
    assert "**a-shape**" in md and "**b-shape**" in md and "cmd0` and `cmd1" in md and "day0 / day1" in md
    assert main(["bench", "prefill", "--from-json", str(paths[0]), str(tmp_path / "missing.json")]) != 0
    # a later run's row replaces an earlier one of the same model, variant and length
    later = run("a-shape", "day2", "cmd2")
    later["rows"] = [dict(model="a-shape", variant="full", T=64, status="ok", time_s=7.0, peak_gib=1.0, layers=2)]
    (tmp_path / "2.json").write_text(json.dumps(later))
    assert main(["bench", "prefill", "--from-json", str(paths[0]), str(tmp_path / "2.json"), "--out-dir", str(out),
                 "--docs", "none"]) == 0
    md = (out / "prefill.md").read_text()
    assert "7.00 s" in md and "2.00 s" not in md
