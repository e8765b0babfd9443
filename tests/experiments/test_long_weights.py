"""LongCE weights with the source as the judge (experiments/long_weights.py): each target weighs
min(p_full / p_window, cap); they are 1 where the window sees the whole row, they multiply the
training loss, and a run computes them once."""

import dataclasses

import numpy as np
import pytest
import torch

from orthros.experiments.cpt_train import train_arm
from orthros.experiments.cpt_arms import ARMS, PRESETS, arm_preset
from orthros.experiments.long_weights import long_context_weights, source_long_weights

from ..conftest import DEVICE, make_model

W = 8
# on CUDA the judge runs under bf16 autocast, and full and windowed attention are different kernels
ATOL = 2e-3 if DEVICE.type == "cpu" else 5e-2


def test_weights_are_one_inside_the_window_and_capped_past_it():
    full, windowed = make_model("full", window=W), make_model("swa", window=W)  # the same weights (seed 0)
    rows = np.random.default_rng(0).integers(0, full.config.vocab_size, (3, 48)).astype(np.int32)
    w = long_context_weights(full, windowed, rows, cap=3.0, device=DEVICE, batch=2, progress=False)
    assert w.shape == rows.shape and w.dtype == np.float16
    assert np.allclose(w[:, :W], 1.0, atol=ATOL)  # the window holds the whole prefix: the same prediction
    assert (w <= 3.0).all() and (w > 0).all()
    assert not np.allclose(w[:, W + 1 :], 1.0, atol=1e-2)  # past it the two differ
    same = long_context_weights(full, full, rows, cap=3.0, device=DEVICE, progress=False)
    assert np.allclose(same, 1.0, atol=ATOL)
    with pytest.raises(ValueError, match="at least 1"):
        long_context_weights(full, full, rows, cap=0.5, device=DEVICE, progress=False)


def test_the_source_judges_once_per_run(tmp_path, monkeypatch):
    import orthros.experiments.long_weights as lw

    src = make_model("orthros", window=W, perturb_so=False)
    src.save_pretrained(tmp_path / "source")
    rows = np.random.default_rng(1).integers(0, src.config.vocab_size, (2, 40)).astype(np.int32)
    w = source_long_weights(tmp_path / "source", rows, W, 2, 4.0, DEVICE, tmp_path)
    (cache,) = tmp_path.glob("long-weights-w8-s2-cap4-*.npy")
    ref = long_context_weights(make_model("full", window=W, perturb_so=False),
                               make_model("swa", window=W, perturb_so=False, sink_tokens=2), rows, 4.0, DEVICE,
                               progress=False)
    assert np.allclose(w.astype(np.float32), ref.astype(np.float32), atol=ATOL) and cache.exists()
    monkeypatch.setattr(lw, "long_context_weights", lambda *a, **k: pytest.fail("computed again"))
    assert np.array_equal(source_long_weights(tmp_path / "source", rows, W, 2, 4.0, DEVICE, tmp_path), w)


def test_token_weights_multiply_the_training_loss():
    p = dataclasses.replace(PRESETS["smollm2-cpu-smoke"], seq_len=32, steps=1, warmup=1, checkpoint_every=0)
    rows = np.random.default_rng(0).integers(0, 256, (p.batch_size, 32)).astype(np.int32)
    losses = []
    for tw in (np.ones(rows.shape, np.float16), np.full(rows.shape, 2.0, np.float16)):
        torch.manual_seed(0)
        _, stats = train_arm(make_model(perturb_so=False), "all", p, rows, str(DEVICE), "t", token_weights=tw)
        losses.append(stats["loss_curve"][0])
    assert losses[1] == pytest.approx(2 * losses[0], rel=1e-4)


def test_the_answers_keep_their_weight_when_the_long_weights_fall_on_the_text():
    p = dataclasses.replace(PRESETS["smollm2-cpu-smoke"], seq_len=32, steps=1, warmup=1, checkpoint_every=0,
                            answer_weight=32.0, long_weight_cap=5.0)
    rows = np.random.default_rng(0).integers(0, 256, (p.batch_size, 32)).astype(np.int32)
    mask = np.ones(rows.shape, bool)
    mask[:, :10] = False  # a retrieval row: its haystack (no target), 5 answers, the EOS, then text
    mask[:, 15] = False
    on_answers = np.ones(rows.shape, np.float16)
    on_answers[:, 10:15] = 2.0  # the long weights say the answers need the far context

    def first_loss(tw, answers):
        torch.manual_seed(0)
        q = dataclasses.replace(p, long_weight_answers=answers)
        _, stats = train_arm(make_model(perturb_so=False), "all", q, rows, str(DEVICE), "t", mask=mask,
                             token_weights=tw)
        return stats["loss_curve"][0]

    plain = first_loss(np.ones(rows.shape, np.float16), True)
    assert first_loss(on_answers, False) == pytest.approx(plain, rel=1e-4)  # the answers' x32 alone
    assert first_loss(on_answers, True) > 1.2 * plain  # x32 times 2 on the answers
    assert first_loss(np.full(rows.shape, 2.0, np.float16), False) > plain  # the text weighs 2


def test_the_long_weight_arms():
    for name, mode in (("orthros-cpt-sink-mix-aw-w1024-lce5", "all"), ("orthros-lora-sink-mix-aw-w1024-lce5",
                                                                        "lora+so")):
        a = ARMS[name]
        assert a.mode == mode and a.window == 1024 and a.recipe["long_weight_cap"] == 5.0
        assert arm_preset(name, PRESETS["smollm2-w512-52m"]).long_weight_cap == 5.0
    assert PRESETS["smollm2-w512-52m"].long_weight_cap == 0.0
    assert arm_preset("orthros-cpt-sink-mix-aw-w1024-lce5", PRESETS["smollm2-w512-52m"]).long_weight_answers
    for cap in (5.0, 2.0):
        q = arm_preset(f"orthros-cpt-sink-mix-aw-w1024-lce{cap:g}t", PRESETS["smollm2-w512-52m"])
        assert q.long_weight_cap == cap and not q.long_weight_answers and q.answer_weight == 32.0
