"""Real processes: a SIGKILL during a save, and torchrun data parallelism (FSDP2 on gloo)."""

import os
import signal
import subprocess
import time

import pytest
import torch

from orthros import OrthrosForCausalLM
from orthros.train import train
from orthros.train.checkpoint import PAUSE_ENV, list_checkpoints
from orthros.train.config import build_config
from orthros.train.metrics import read_metrics

from .train_helpers import PY, ROOT, cli_args, tiny_overrides


def _env(**extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", **extra}
    return env


def losses(out_dir, key="loss"):
    return [r[key] for r in read_metrics(out_dir / "metrics.jsonl") if key in r]


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    run = tmp_path / "run"
    o = tiny_overrides(run, train__steps=4, checkpoint__every=2, train__device="cpu")
    proc = subprocess.Popen([PY, "-m", "orthros", "train", *cli_args(o)], env=_env(**{PAUSE_ENV: "4:600"}),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 300
        while not list((run / "checkpoints").glob(".tmp-step_00000004-*/model.safetensors")):
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.time() < deadline, "the second save never started"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)  # killed mid-save: weights written, training state not
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    ckpts = list_checkpoints(run / "checkpoints")
    assert [c.name for c in ckpts] == ["step_00000002"]
    OrthrosForCausalLM.from_pretrained(str(ckpts[0]))  # the previous checkpoint is intact
    s = train(build_config(None, {**o, "checkpoint.resume": "latest"}))
    assert s["steps"] == 4 and not list((run / "checkpoints").glob(".tmp-*"))
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4]


def test_fsdp_two_processes_match_one(tmp_path):
    """torchrun x2 (FSDP2, gloo) == one process on the same global batch; its checkpoint resumes in one process."""
    kw = dict(train__device="cpu", data__prefetch=0)
    o2 = tiny_overrides(tmp_path / "fsdp", train__batch_size=1, train__grad_accum=2, train__stop_at=4, **kw)
    r = subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "orthros", "train", *cli_args(o2)], env=_env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    one = tmp_path / "one"
    train(build_config(None, tiny_overrides(one, train__batch_size=4, **kw)))
    a, b = losses(tmp_path / "fsdp"), losses(one)
    assert len(a) == 4 and a == pytest.approx(b[:4], rel=1e-6, abs=1e-6)
    assert losses(tmp_path / "fsdp", "eval_loss")[0] == pytest.approx(losses(one, "eval_loss")[0], rel=1e-6)
    # the FSDP checkpoint holds full tensors: one process continues it and lands where the straight run did
    o1 = tiny_overrides(tmp_path / "fsdp", train__batch_size=4, checkpoint__resume="latest", **kw)
    train(build_config(None, o1))
    assert losses(tmp_path / "fsdp") == pytest.approx(b, rel=1e-5, abs=1e-6)
    wa = OrthrosForCausalLM.from_pretrained(str(list_checkpoints(one / "checkpoints")[-1])).state_dict()
    wb = OrthrosForCausalLM.from_pretrained(str(list_checkpoints(tmp_path / "fsdp/checkpoints")[-1])).state_dict()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)
