"""Jobs in worker processes return what the same calls return in-process, in order."""

import pytest

from orthros.experiments.jobs import run_jobs


def _square_plus(x, y):
    if x < 0:
        raise ValueError("negative")
    return x * x + y


def test_parallel_matches_serial():
    jobs = [(i, 10 * i) for i in range(5)]
    assert run_jobs(_square_plus, jobs, workers=2) == run_jobs(_square_plus, jobs, workers=1) == [
        i * i + 10 * i for i in range(5)]


def test_errors_reach_the_caller():
    with pytest.raises(ValueError, match="negative"):
        run_jobs(_square_plus, [(1, 0), (-1, 0)], workers=2)
    with pytest.raises(ValueError, match="workers"):
        run_jobs(_square_plus, [(1, 0)], workers=0)


def test_recall_jobs_train_the_same_models(tmp_path):
    """Architectures trained side by side in worker processes get the results of a serial run."""
    from orthros.experiments.recall import run_experiment

    archs = ("orthros", "full")
    serial = run_experiment("smoke", archs, out=tmp_path / "a")["results"]
    parallel = run_experiment("smoke", archs, out=tmp_path / "b", jobs=2)["results"]
    assert list(parallel) == list(archs)
    for a in archs:
        assert parallel[a]["eval"] == serial[a]["eval"] and parallel[a]["params"] == serial[a]["params"]
        assert parallel[a]["train"]["steps"] == serial[a]["train"]["steps"]
    with pytest.raises(ValueError, match="jobs"):
        run_experiment("smoke", archs, out=tmp_path / "c", jobs=0)


def test_recall_several_seeds_mean_and_range(tmp_path):
    """Several seeds: each run equals the one-seed run with that seed; the table shows the
    mean over seeds with the range."""
    from orthros.experiments.recall import run_experiment
    from orthros.experiments.report import aggregate

    one = {s: run_experiment("smoke", ("full",), seed=s, out=tmp_path / f"s{s}")["results"]["full"] for s in (0, 1)}
    both = run_experiment("smoke", ("full",), seed=[0, 1], out=tmp_path / "both", jobs=2)
    r = both["results"]["full"]
    assert r["per_seed"]["0"]["eval"] == one[0]["eval"] and r["per_seed"]["1"]["eval"] == one[1]["eval"]
    ppl = [one[s]["eval"]["ppl"]["ppl"] for s in (0, 1)]
    assert r["eval"]["ppl"]["ppl"] == pytest.approx(sum(ppl) / 2)
    assert r["range"]["eval"]["ppl"]["ppl"] == [min(ppl), max(ppl)]
    assert f"{min(ppl):.3f}–{max(ppl):.3f}" in both["table"] and "seeds 0, 1" in both["table"]
    with pytest.raises(ValueError, match="seconds"):
        run_experiment("smoke", ("full",), seed=[0, 1], out=tmp_path / "x", seconds=1.0)
    agg = aggregate({0: {"n": 1, "cfg": "a"}, 1: {"n": 3, "cfg": "a"}})
    assert agg["n"] == 2 and agg["range"]["n"] == [1, 3] and agg["cfg"] == "a"


def _log(name, path):
    import time

    with open(path, "a") as f:
        f.write(f"start {name}\n")
    time.sleep(0.2 if name == "teacher" else 0.05)
    with open(path, "a") as f:
        f.write(f"end {name}\n")
    return name


@pytest.mark.parametrize("workers", [1, 2])
def test_a_job_starts_after_the_jobs_it_needs(tmp_path, workers):
    from orthros.experiments.jobs import run_after

    log = tmp_path / "log"
    jobs = {n: (n, str(log)) for n in ("free", "student", "teacher")}
    out = run_after(_log, jobs, {"student": ["teacher"]}, workers)
    assert out == {n: n for n in jobs}
    lines = log.read_text().splitlines()
    assert lines.index("end teacher") < lines.index("start student")
    if workers == 1:
        assert lines[0] == "start teacher"  # the job others wait for goes first
    with pytest.raises(ValueError, match="cycle"):
        run_after(_log, {"a": ("a", str(log)), "b": ("b", str(log))}, {"a": ["b"], "b": ["a"]}, workers)


def _log_or_fail(name, path):
    if name.startswith("bad"):
        raise MemoryError(f"{name} ran out")
    return _log(name, path)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failed_job_is_said_at_once_and_the_others_finish(tmp_path, workers, capfd):
    """A job that raises (an arm out of memory) does not stop the jobs beside it: they finish, the
    jobs that need it do not run, and the error names it with what finished."""
    from orthros.experiments.jobs import JobsFailed, run_after

    log = tmp_path / "log"
    jobs = {n: (n, str(log)) for n in ("bad", "free", "student", "teacher", "after-bad")}
    with pytest.raises(JobsFailed) as e:
        run_after(_log_or_fail, jobs, {"student": ["teacher"], "after-bad": ["bad"]}, workers)
    assert set(e.value.done) == {"free", "student", "teacher"} and list(e.value.errors) == ["bad"]
    assert isinstance(e.value.errors["bad"], MemoryError) and e.value.skipped == ["after-bad"]
    assert "bad: MemoryError: bad ran out" in str(e.value) and "after-bad" in str(e.value)
    assert "job bad failed: MemoryError: bad ran out" in capfd.readouterr().err
    assert "start after-bad" not in log.read_text()


def test_a_failed_arm_leaves_the_finished_arms_reported(tmp_path, monkeypatch, capsys):
    from orthros.experiments import cpt
    from orthros.experiments.cli import run_cpt_command

    def fake_arm(arm, conv, out, preset, device, position=0, train_only=False):
        if arm == "orthros-kd":
            raise MemoryError("CUDA out of memory")
        return {"arm": arm, "eval": {}}

    monkeypatch.setattr(cpt, "prepare", lambda *a, **k: tmp_path / "orthros")
    monkeypatch.setattr(cpt, "run_arm", fake_arm)
    monkeypatch.setattr(cpt, "write_report", lambda results, preset, meta, out: {"results": results,
                                                                                "table": f"table of {sorted(results)}"})
    args = type("A", (), dict(preset="smollm2-cpu-smoke", out=str(tmp_path / "o"), from_json=None, source="x.gguf",
                              archs=["orthros-kd", "orthros-cpt"], device="cpu", jobs=1, steps=None,
                              lm_eval_limit=None, compile=None))
    assert run_cpt_command(args) == 1
    err = capsys.readouterr().err
    assert "table of ['orthros-cpt']" in err and "orthros-kd: MemoryError: CUDA out of memory" in err


def test_students_start_once_their_teacher_is_trained_not_evaluated(tmp_path, monkeypatch):
    """The conversion experiment: a teacher arm is two jobs (train and save; evaluate), and the arms
    it teaches wait only for the first."""
    from orthros.experiments import cpt

    calls = []

    def fake_arm(arm, conv, out, preset, device, position=0, train_only=False):
        calls.append((arm, train_only))
        return {"arm": arm, "train": {}} if train_only else {"arm": arm, "eval": {}}

    monkeypatch.setattr(cpt, "prepare", lambda *a, **k: tmp_path / "orthros")
    monkeypatch.setattr(cpt, "run_arm", fake_arm)
    monkeypatch.setattr(cpt, "write_report", lambda results, preset, meta, out: results)
    res = cpt.run_cpt("smollm2-cpu-smoke", "unused.gguf", tmp_path, arms=("orthros-kd-d", "full-cpt", "orthros-cpt"))
    assert calls[0] == ("full-cpt", True)  # the teacher trains first, and stops at its weights
    assert calls.index(("orthros-kd-d", False)) > 0
    assert ("full-cpt", False) in calls and len(calls) == 4  # then it is evaluated, as a job of its own
    assert set(res) == {"orthros-kd-d", "full-cpt", "orthros-cpt"}


def test_an_arm_s_recipe_changes_its_training_only():
    from orthros.experiments import cpt_arms as cpt

    base = cpt.PRESETS["smollm2-kd-h200"]
    p = cpt.arm_preset("orthros-kd-d-w256-lr3", base)
    assert p.lr == 3e-4 and p.passkey_samples == base.passkey_samples and p.eval_rows == base.eval_rows
    assert cpt.arm_preset("orthros-kd-d", base) == base
    cpt.ARMS["bad-recipe"] = cpt.Arm("x", {}, "all", recipe=dict(passkey_samples=1))
    try:
        with pytest.raises(ValueError, match="recipe may change"):
            cpt.arm_preset("bad-recipe", base)
    finally:
        del cpt.ARMS["bad-recipe"]


def _oom_beside(name, d):
    """'big' runs out of memory the first time, while 'small' runs; 'small' takes a moment."""
    import time
    from pathlib import Path

    import torch

    d = Path(d)
    if name == "big":
        n = len(list(d.glob("big-*"))) + 1
        (d / f"big-{n}").write_text(repr(time.time()))
        if n == 1:
            while not (d / "small-started").exists():
                time.sleep(0.01)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB")
        return "big done"
    if name == "always":
        n = len(list(d.glob("always-*"))) + 1
        (d / f"always-{n}").write_text("")
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB")
    (d / "small-started").write_text("")
    time.sleep(0.5)
    (d / "small-ended").write_text(repr(time.time()))
    return name


def test_a_job_out_of_memory_beside_others_runs_again_alone(tmp_path):
    """A job that ran out of device memory while another ran beside it runs again, once, after the
    others end; one that runs out again (or ran alone) is a failure like any other."""
    from orthros.experiments.jobs import JobsFailed, run_after

    res = run_after(_oom_beside, {"big": ("big", tmp_path), "small": ("small", tmp_path)}, {}, workers=2)
    assert res == {"big": "big done", "small": "small"}
    assert float((tmp_path / "big-2").read_text()) >= float((tmp_path / "small-ended").read_text())

    d = tmp_path / "again"
    d.mkdir()
    with pytest.raises(JobsFailed) as e:
        run_after(_oom_beside, {"always": ("always", d), "small": ("small", d)}, {}, workers=2)
    assert set(e.value.errors) == {"always"} and e.value.done == {"small": "small"}
    assert len(list(d.glob("always-*"))) == 2  # once beside 'small', once alone

    d = tmp_path / "alone"
    d.mkdir()
    with pytest.raises(JobsFailed):
        run_after(_oom_beside, {"always": ("always", d)}, {}, workers=2)
    assert len(list(d.glob("always-*"))) == 1


class _Held:
    """Stands in for a job's tensors."""


def test_a_job_s_memory_is_given_back_when_it_ends(monkeypatch):
    """A worker outlives its job: after each job, failed or not, what the job held is collected and the
    device cache released (else a job run again alone would meet the memory an idle worker keeps)."""
    import gc
    import traceback
    import weakref

    from orthros.experiments import jobs

    released, refs = [], []
    monkeypatch.setattr(jobs, "release_device_memory", lambda: released.append(all(r() is None for r in refs)))

    def job(fail):
        held = _Held()  # referenced only by this frame (and, once it raises, its traceback)
        refs.append(weakref.ref(held))
        if fail:
            raise MemoryError("out of memory")
        return "ok"

    assert jobs.run_job(job, False) == "ok"
    with pytest.raises(MemoryError) as e:
        jobs.run_job(job, True)
    gc.collect()
    assert released == [True, True] and refs[1]() is None
    assert "raise MemoryError" in "".join(traceback.format_tb(e.value.__traceback__))  # the trace is kept
