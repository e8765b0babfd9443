"""The scripts under benchmarks/ that need a GPU to run are at least valid Python that
imports: a broken sweep should fail here, not on the first GPU call of a session."""

import ast
import importlib.util
import pathlib

import pytest
import torch

SCRIPTS = sorted((pathlib.Path(__file__).parents[2] / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_script_parses_and_its_imports_resolve(path):
    tree = ast.parse(path.read_text(), filename=str(path))  # a SyntaxError fails the test
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            top = node.module.split(".")[0]
        elif isinstance(node, ast.Import):
            top = node.names[0].name.split(".")[0]
        else:
            continue
        if top == "orthros":  # the project's own modules must exist as named
            mod = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            assert importlib.util.find_spec(mod) is not None, f"{path.name}: no module {mod}"


def test_dequant_probe_gluon_kernels_build_for_sm90_without_a_barrier():
    """The Gluon probes behind docs/long_context.md's layout design build for sm_90 on this machine
    (no GPU), and their loops hold no barrier, shuffle or shared-memory access: the layouts
    do what the design says, or this fails (e.g. on a Triton whose Gluon converts differently)."""
    import sys

    sys.path.insert(0, str(SCRIPTS[0].parent))
    try:
        import dequant_probe as probe
    finally:
        sys.path.pop(0)
    keys = probe.loop_counts(probe.MODES.index("gluon-lop3"), 64, 4, 16)
    values = probe.value_counts("gluon-values", 4)
    for n, ops in (keys, values):
        assert ops["HMMA"] == 16 and n > 16
        assert not {"BAR", "SHFL", "STS", "LDS", "LDSM"} & set(ops), ops
    (n, ops), _ = probe.tile_counts(4)["gluon-tile"]  # the softmax's reductions stay in the warp (shuffles)
    assert ops["HMMA"] == 32 and not {"BAR", "STS", "LDS", "LDSM"} & set(ops), ops


def test_cpt_position_gap_splits_a_gap_by_position(tmp_path):
    """benchmarks/cpt_position_gap.py: an arm whose loss matches the reference's in its first 512
    positions and is log(1.1) above it after shows 0% there and +10% in every later range; a file
    that is not an arm file is refused."""
    import json
    import math
    import sys

    sys.path.insert(0, str(SCRIPTS[0].parent))
    try:
        import cpt_position_gap as gap
    finally:
        sys.path.pop(0)
    start = list(range(0, 8192, 256))
    ref_loss = [2.0 - 0.03 * i for i in range(len(start))]
    arm_loss = [x + (math.log(1.1) if s >= 512 else 0.0) for s, x in zip(start, ref_loss)]

    def arm(name, loss):
        bp = {"start": start, "end": [s + 256 for s in start], "loss": loss}
        return {"arm": name, "label": name, "eval": {"code": {"long": {"by_position": bp}}}}

    g = gap.gaps(arm("ref", ref_loss), arm("x", arm_loss))
    assert list(g) == ["code"]
    assert [round(x, 6) for x in g["code"]] == [0.0, 0.0, 0.1, 0.1, 0.1]
    bad = tmp_path / "results.json"
    bad.write_text(json.dumps({"results": {}}))
    with pytest.raises(SystemExit, match="not an arm file"):
        gap.load(str(bad))
    both = tmp_path / "both.json"  # a results.json: an arm named after '#'
    both.write_text(json.dumps({"results": {"ref": arm("ref", ref_loss), "x": arm("x", arm_loss)}}))
    assert gap.load(f"{both}#x")["eval"] == arm("x", arm_loss)["eval"]
    with pytest.raises(SystemExit, match="name one of its arms after '#': ref, x"):
        gap.load(str(both))


def test_kv_oracle_probe_gives_the_source_back_with_every_layers_kv():
    """kv_oracle_probe.py's premise (SPEC: the output stream is exact full attention): an Orthros model
    whose every layer makes its K/V from the source's attention inputs gives the source's logits, though
    its window is shorter than the input; with no layer given them it does not."""
    import importlib.util

    from ..conftest import DEVICE, llama_twin, make_model, rel_err

    spec = importlib.util.spec_from_file_location("kv_oracle_probe", SCRIPTS[0].parent / "kv_oracle_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    model = make_model(window=8, perturb_so=False)
    llama = llama_twin(model)
    ids = torch.randint(0, model.config.vocab_size, (48,)).tolist()
    x = torch.tensor([ids], device=DEVICE)
    with torch.no_grad():
        want = llama(x).logits
        inputs = probe.source_attention_inputs(llama, ids)
        L = model.config.num_hidden_layers
        with probe.oracle(model, inputs, set(range(L))):
            got = model(x).logits
        assert rel_err(got, want) < 1e-4
        with probe.oracle(model, inputs, set()):
            assert rel_err(model(x).logits, want) > 1e-2
        assert rel_err(model(x).logits, want) > 1e-2  # the patch is gone afterwards


def test_answer_logprob_is_the_full_forwards_sum_over_the_answer():
    """`demo.real.answer_logprob` (the margin and oracle probes' score) keeps only the answer's positions:
    the same number as a forward with every position an output position."""
    from orthros.demo.real import answer_logprob

    from ..conftest import make_model

    model = make_model(window=4)
    ids, ans = torch.randint(0, model.config.vocab_size, (30,)).tolist(), [3, 7, 11]
    with torch.no_grad():
        lp = model(torch.tensor([ids + ans], device=model.device)).logits[0].float().log_softmax(-1)
        got = answer_logprob(model, ids, ans)
    assert abs(got - sum(lp[len(ids) - 1 + k, t].item() for k, t in enumerate(ans))) < 1e-4


def test_moe_sweep_searches_launches_and_checks_them(tmp_path):
    """benchmarks/moe_sweep.py's logic under the Triton interpreter (its times say nothing on a CPU):
    a decode pair routed by its base row reads k experts, every candidate of the searched field is
    tried and checked against the default launch, and the JSON / table are written."""
    import json

    from ..conftest import run_triton_interpreted

    out = tmp_path / "sweep.json"
    r = run_triton_interpreted("benchmarks/moe_sweep.py", "--model", "tiny-moe", "--batches", "1", "--scenarios",
                               "bound", "independent", "--fields", "up_i", "--rounds", "1", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    rows = {x["scenario"]: x for x in json.loads(out.read_text())["rows"]}
    assert rows["bound"]["rows"] == 2 and rows["bound"]["experts_read"] == 2  # tiny-moe: top 2
    assert rows["independent"]["experts_read"] >= 2
    for x in rows.values():
        assert x["tried"] == 4 and not x["skipped"] and x["best_s"] <= x["default_s"]  # up_i: 16, 32, 128
    assert "| 1 | bound (2) | 2 |" in out.with_suffix(".md").read_text()


def test_decode_op_count_says_what_a_bound_pair_adds_to_a_layer(tmp_path):
    """benchmarks/decode_op_count.py on the CPU: a bound pair's layer dispatches at most 4 ops more
    than the Transformer's (the SO's multiply and add, the routing's concatenation and gather:
    docs/moe.md); one more per layer fails here."""
    import json
    import sys

    sys.path.insert(0, str(SCRIPTS[0].parent))
    try:
        import decode_op_count
    finally:
        sys.path.pop(0)
    out = tmp_path / "ops.json"
    decode_op_count.main(["--variants", "full", "orthros-bound", "--layers", "2", "--out", str(out)])
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    full, bound = rows["full"]["per_layer"], rows["orthros-bound"]["per_layer"]
    assert full > 20 and full < bound <= full + 4, (full, bound)
    assert out.with_suffix(".md").read_text().count("\n") == 4


def test_serve_chunk_profile_runs_every_token_through_each_path():
    """benchmarks/serve_chunk_profile.py on the tiny preset: the engine and the chunked prefill each
    run every prompt token once (the profiled chunk included), and each path has a time per 8K tokens."""
    import sys

    sys.path.insert(0, str(SCRIPTS[0].parent))
    try:
        import serve_chunk_profile as prof
    finally:
        sys.path.pop(0)
    (res,) = prof.main(["--device", "cpu", "--preset", "tiny", "--long", "100", "--budget", "32", "--dtype", "fp32",
                        "--variants", "orthros", "--repeats", "1"])  # the pool: the blocks the prompt needs
    for path in ("chunked", "engine"):
        done = sum(s["tokens"] for s in res[path]["steps"]) + res[path]["profile"]["tokens"]
        assert done == 100 and res[path]["profile"]["start"] >= 50, path
    assert all(res[k]["ms_per_8k"] > 0 and res[k]["whole_ms_per_8k"] > 0 for k in ("one forward", "chunked", "engine"))


def test_serve_ttft_path_splits_a_requests_wait_in_order(tmp_path):
    """benchmarks/serve_ttft_path.py at a few hundred tokens: each client mode's hand-overs come in
    order (every part >= 0) and add up to the time to first token the client measured."""
    import json
    import sys

    from orthros.serve import api

    sys.path.insert(0, str(SCRIPTS[0].parent))
    try:
        import serve_ttft_path as path
    finally:
        sys.path.pop(0)
    nxt = api.Job.next
    rows = path.main(["--lengths", "300", "--reps", "1", "--budget", "64", "--out", str(tmp_path)])
    assert api.Job.next is nxt  # the patch is undone
    assert [r["mode"] for r in rows] == ["ids", "usage"]
    for r in rows:
        assert all(r[k] >= 0 for k in path.PARTS) and r["steps"] > 0
        assert abs(sum(r[k] for k in path.PARTS) - r["ttft"]) < 1e-6
    assert json.loads((tmp_path / "ttft-path.json").read_text())["rows"] == rows


def test_gpu_plan_runs_its_queue_in_order_and_reads_it_again_before_each_stage(tmp_path):
    """benchmarks/gpu_plan.sh with a stand-in Python that only records its arguments: stages run in
    the queue's order, `a+b` side by side, a stage added to the queue while it runs is run too, an
    unknown stage is logged with a failing status, and each stage's command is the page's."""
    import os
    import subprocess

    py = tmp_path / "py"
    py.write_text('#!/bin/sh\necho "$@"\n'
                  '[ "$1" = -m ] && [ "$2" = pytest ] && echo "stage 2" >> "$QUEUE"\nexit 0\n')  # a stage adds 2
    py.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": str(py), "QUEUE": str(out / "queue"), "GPU_PLAN_TAG": "t",
           "GPU_PLAN_SIDE_BY_SIDE": "1"}
    script = SCRIPTS[0].parent / "gpu_plan.sh"
    subprocess.run(["bash", str(script), str(out), "servet", "paper+long=int4:1M", "bogus"], env=env, check=True,
                   cwd=SCRIPTS[0].parents[1], timeout=60)
    lines = [ln.split(" ", 1)[1] for ln in (out / "plan.txt").read_text().splitlines()]
    assert lines == ["start servet", "end servet rc=0", "start paper+long=int4:1M", "end paper+long=int4:1M rc=0",
                     "start bogus", "end bogus rc=2", "start stage", "end stage rc=2", "start 2", "end 2 rc=2",
                     "plan done"]
    assert "tests/serve" in (out / "servet.log").read_text()
    # as on a card under 100 GB, `a+b` runs in turn, said in the plan, failing if either fails
    subprocess.run(["bash", str(script), str(out / "turns"), "servet+bogus"], check=True, timeout=60,
                   env={**env, "GPU_PLAN_SIDE_BY_SIDE": "0"}, cwd=SCRIPTS[0].parents[1])
    lines = [ln.split(" ", 1)[1] for ln in (out / "turns" / "plan.txt").read_text().splitlines()]
    assert lines[0] == "start servet+bogus" and lines[1].startswith("servet+bogus: one after another ("), lines
    assert lines[2:] == ["end servet+bogus rc=2", "plan done"], lines
    subprocess.run(["bash", str(script), str(out / "parts"), "ops", "rest"], env=env, check=True,
                   cwd=SCRIPTS[0].parents[1], timeout=60)
    assert (out / "parts" / "ops.log").read_text().split()[-1] == "tests/ops"
    assert (out / "parts" / "rest.log").read_text().split()[-2:] == ["tests", "--ignore=tests/ops"]
    assert "--scenario paper --variants orthros full" in (out / "paper.log").read_text()
    long = (out / "long-int4-1M.log").read_text()
    assert "--long-cases int4:1M --capacity-dtypes --out-dir" in long and "serve-long-int4-1M-t" in long
    # every `orthros bench` stage's command parses with the CLI's own parser (a bad flag would fail on the GPU)
    import argparse
    import shlex

    from orthros.bench.cli import add_arguments

    stages = ["paper", "paper16k", "faults", "documents", "long=int2:4M", "cap=int4", "moedec"]
    subprocess.run(["bash", str(script), str(out / "bench"), *stages], env=env, check=True,
                   cwd=SCRIPTS[0].parents[1], timeout=60)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for stage in stages:
        argv = shlex.split((out / "bench" / f"{stage.replace('=', '-').replace(':', '-')}.log").read_text())
        assert argv[:3] == ["-m", "orthros", "bench"], (stage, argv)
        parsed = parser.parse_args(argv[3:])
        assert parsed.out_dir.startswith(str(out / "bench")), stage
    assert parser.parse_args(shlex.split((out / "bench" / "paper16k.log").read_text())[3:]).budget == 16384
    # every arm and preset it names exists (a misspelt one would fail on the GPU, minutes into a run)
    import re

    from orthros.experiments.cpt_arms import ARMS, PRESETS

    text = script.read_text().replace("$LORA", "orthros-lora-sink-mix-aw-w1024")
    arms = {a for names in re.findall(r"--arms ((?:\S+ )+?)--out", text) for a in names.split()}
    assert len(arms) == 11 and arms <= set(ARMS), arms - set(ARMS)
    assert set(re.findall(r"experiment cpt --preset (\S+)", text)) <= set(PRESETS)
    from orthros.experiments.presets import ARCHS

    archs = {a for names in re.findall(r"--archs ((?:\S+ )+?)--out", text) for a in names.split()}
    assert len(archs) == 3 and archs <= set(ARCHS), archs - set(ARCHS)
