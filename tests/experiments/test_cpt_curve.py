"""The conversion experiment's token curve: runs of several budgets, each Orthros arm's gap to the
same-data control at its own budget, from `--steps A B C` or from saved runs."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from orthros.experiments import cpt_curve as curve


def _run(path, steps, arms):
    """A results.json of one budget: arm -> its code perplexity (prose = code + 1, 8K = half of 2K)."""
    ev = lambda ppl: {"short": {"ppl": ppl}, "long": {"ppl": ppl / 2}}  # noqa: E731
    res = {a: {"label": a, "window": None, "train": {"tokens": steps * 100, "steps": steps, "seconds": 1.0},
               "eval": {"code": ev(c), "prose": ev(c + 1), "copy": {"by_gap": {"512": {"second": c / 10}}},
                        "passkey": {"by_length": {"1024": 1.0}}}}
           for a, c in arms.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": {"config": {"window": 128}, "train_tokens": steps * 100}, "results": res}))
    return path


def test_each_budget_is_paired_with_its_control(tmp_path):
    """A point per (arm, tokens); a gap only where the control has the same budget; the control is
    found (the one `full-` arm at every budget); a later file's point wins."""
    files = [_run(tmp_path / "a.json", 10, {"full-x": 4.0}), _run(tmp_path / "b.json", 10, {"orthros-x": 4.4}),
             _run(tmp_path / "c.json", 30, {"full-x": 3.0, "orthros-x": 3.3}),
             _run(tmp_path / "d.json", 30, {"orthros-x": 3.15}), _run(tmp_path / "e.json", 90, {"orthros-x": 2.0})]
    pts = curve.points(files)
    assert [(p["arm"], p["tokens"], p["window"]) for p in pts] == [
        ("full-x", 1000, None), ("full-x", 3000, None), ("orthros-x", 1000, 128), ("orthros-x", 3000, 128),
        ("orthros-x", 9000, 128)]
    assert curve.reference(pts) is None  # full-x lacks the 9,000-token budget
    assert curve.reference(pts[:4]) == "full-x"
    g = curve.gaps(pts, "full-x")
    assert [(x["tokens"], round(x["code_short"], 6), round(x["code_long"], 6), round(x["copy"]["512"], 6))
            for x in g] == [(1000, 10.0, 10.0, 10.0), (3000, 5.0, 5.0, 5.0)]
    text = curve.table(pts, g)
    assert "+5.0% / +5.0%" in text
    # the columns are the domains the runs have (no docs here), at the preset's lengths; every row fits them
    lines = text.splitlines()
    assert "code 2K / 8K" in lines[0] and "docs" not in lines[0] and "novel" not in lines[0]
    assert len({ln.count("|") for ln in lines}) == 1
    assert curve.budgets(files) == {1000, 3000, 9000}


def test_a_curve_needs_each_runs_results_file(tmp_path):
    bad = tmp_path / "arm.json"
    bad.write_text(json.dumps({"arm": "x", "train": {"tokens": 5}}))
    with pytest.raises(ValueError, match="not an arm file"):
        curve.points([bad])
    ok = _run(tmp_path / "r.json", 10, {"full-x": 4.0})
    with pytest.raises(ValueError, match="no trained arm full-y"):
        curve.write_curve([ok], tmp_path / "out", ref="full-y")


def _args(tmp_path, **kw):
    base = dict(preset="smollm2-cpu-smoke", out=str(tmp_path / "o"), from_json=None, source="x.gguf",
                archs=["orthros-x", "full-x"], device="cpu", jobs=1, steps=None, lm_eval_limit=None, compile=None)
    return SimpleNamespace(**{**base, **kw})


def test_several_steps_run_a_budget_each_then_write_the_curve(tmp_path, monkeypatch):
    from orthros.experiments import cpt
    from orthros.experiments.cli import run_cpt_command

    ran = []

    def fake_run_cpt(preset, source, out, arms, device, jobs, steps, *a):
        ran.append((out, steps))
        _run(Path(out) / "results.json", steps, {"full-x": 40 / steps, "orthros-x": 44 / steps})
        return {"table": f"table of {steps}", "files": ["results.json"]}

    monkeypatch.setattr(cpt, "run_cpt", fake_run_cpt)
    monkeypatch.setattr(cpt, "check_names", lambda *a: None)  # the fake runs' arms are no real arms
    assert run_cpt_command(_args(tmp_path, steps=[10, 30])) == 0
    o = tmp_path / "o"
    assert ran == [(f"{o}/steps-10", 10), (f"{o}/steps-30", 30)]
    got = json.loads((o / "curve.json").read_text())
    assert got["ref"] == "full-x" and [round(g["code_short"], 6) for g in got["gaps"]] == [10.0, 10.0]
    assert (o / "curve.png").stat().st_size > 0 and "+10.0%" in (o / "curve.md").read_text()

    # the same report again from the saved runs; one budget's files still make one table
    (o / "curve.json").unlink()
    assert run_cpt_command(_args(tmp_path, from_json=[str(o / "steps-10" / "results.json"),
                                                      str(o / "steps-30" / "results.json")])) == 0
    assert json.loads((o / "curve.json").read_text())["ref"] == "full-x"
    assert curve.budgets([o / "steps-10" / "results.json"]) == {1000}


def test_a_preset_with_arms_runs_them_unless_arms_are_named(tmp_path, monkeypatch):
    """The headline preset names its arms (the recipe at W = 512 and its control): with no --arms those
    run; --arms still wins; every preset's arms exist."""
    from orthros.experiments import cpt
    from orthros.experiments.cli import run_cpt_command
    from orthros.experiments.cpt_arms import ARMS, DEFAULT_ARMS, PRESETS

    assert all(a in ARMS for p in PRESETS.values() for a in p.arms)
    ran = []
    monkeypatch.setattr(cpt, "run_cpt", lambda preset, source, out, arms, *a: ran.append(arms) or {"table": "", "files": []})
    assert run_cpt_command(_args(tmp_path, preset="smollm2-w512-52m", archs=None)) == 0
    assert run_cpt_command(_args(tmp_path, preset="smollm2-w512-52m", out=str(tmp_path / "o2"),
                                 archs=["orthros-cpt", "full-cpt"])) == 0
    assert run_cpt_command(_args(tmp_path, preset="smollm2-cpu-smoke", archs=None, out=str(tmp_path / "o3"))) == 0
    assert ran == [["orthros-cpt-sink-mix-aw-w512", "full-cpt-mix-aw"], ["orthros-cpt", "full-cpt"], list(DEFAULT_ARMS)]
    assert PRESETS["smollm2-w512-52m"].steps * PRESETS["smollm2-w512-52m"].batch_size * 8192 == 52_428_800


def test_recall_takes_one_steps():
    from orthros.errors import UserError
    from orthros.experiments.cli import run

    args = SimpleNamespace(name="recall", device="cpu", preset="smoke", out=None, seed=[0], steps=[10, 20],
                           archs=None, seconds=None, jobs=1)
    with pytest.raises(UserError, match="recall takes one --steps"):
        run(args)
