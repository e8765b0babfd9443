"""An experiment arm cut mid-training continues from its newest checkpoint exactly: the same
loss curve, the same weights, as the arm trained in one sitting (full weights, LoRA + SO, and a
distilled arm whose teacher runs in the same step; a light arm without LoRA, whose merged and unmerged
states are the same tensors)."""

import dataclasses

import numpy as np
import pytest
import torch

from orthros.experiments.cpt_train import train_arm
from orthros.experiments.cpt_arms import PRESETS
from orthros.train.checkpoint import list_checkpoints

from ..conftest import DEVICE, make_model

STEPS, EVERY = 5, 2


class Cut(Exception):
    pass


def arm(mode, ckpt_dir, teacher=False, cut_after=None):
    torch.manual_seed(0)  # the model, and LoRA's initial factors
    model = make_model(perturb_so=False)
    t = make_model("full", perturb_so=False, seed=1).requires_grad_(False) if teacher else None
    p = dataclasses.replace(PRESETS["smollm2-cpu-smoke"], seq_len=32, steps=STEPS, warmup=2, lr=5e-3,
                            light_lr=5e-2, lora_lr=5e-2, checkpoint_every=EVERY, align_frac=0.4)
    rows = np.random.default_rng(0).integers(0, model.config.vocab_size, (STEPS * p.batch_size, 32)).astype(np.int32)

    def stop(step):
        if cut_after is not None and step + 1 == cut_after:
            raise Cut

    return train_arm(model, mode, p, rows, str(DEVICE), mode, teacher=t, on_step=stop, ckpt_dir=ckpt_dir)


@pytest.mark.parametrize("mode, teacher", [("all", False), ("lora+so", False), ("so-out", True), ("all", True)],
                         ids=["all", "lora+so", "so-out-distilled", "distilled"])
def test_a_cut_arm_resumes_exactly(tmp_path, mode, teacher):
    straight, s_stats = arm(mode, tmp_path / "straight", teacher)
    with pytest.raises(Cut):
        arm(mode, tmp_path / "cut", teacher, cut_after=3)  # after step 3: the newest checkpoint is step 2
    assert [c.name for c in list_checkpoints(tmp_path / "cut")] == ["step_00000002"]
    resumed, r_stats = arm(mode, tmp_path / "cut", teacher)
    assert r_stats["loss_curve"] == s_stats["loss_curve"] and len(r_stats["loss_curve"]) == STEPS
    if teacher:
        assert r_stats["part_curves"] == s_stats["part_curves"] and len(s_stats["part_curves"]["align"]) == 2
    a, b = straight.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    start = make_model(perturb_so=False).state_dict()
    assert any(not torch.equal(a[k], start[k]) for k in start)  # it trained


def test_a_cut_evaluation_keeps_its_finished_probes(tmp_path, monkeypatch):
    """Each probe's result is written as it finishes; a run cut in a later probe (here the pass
    key) keeps the earlier ones, and the next run does only what is missing."""
    import orthros.eval.longrange as lr
    from orthros.experiments.cpt import evaluate_arm

    model = make_model(perturb_so=False).eval()
    p = dataclasses.replace(PRESETS["smollm2-cpu-smoke"], lm_eval_tasks=[], copy_gaps=[8], short_len=16)
    held = {"code": np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 32)).astype(np.int32)}
    stream = torch.randint(0, model.config.vocab_size, (600,), generator=torch.Generator().manual_seed(0))
    calls = []
    real_copy = lr.copy_probe

    def copy_probe(*a, **k):
        calls.append("copy")
        return real_copy(*a, **k)

    def cut(*a, **k):
        raise Cut

    monkeypatch.setattr(lr, "copy_probe", copy_probe)
    monkeypatch.setattr(lr, "chat_passkey", cut)
    partial = tmp_path / "arm-x.partial.json"
    with pytest.raises(Cut):
        evaluate_arm(model, None, p, held, stream, partial)
    assert calls == ["copy"] and partial.exists()
    monkeypatch.setattr(lr, "chat_passkey", lambda *a, **k: {"mean": 0.5})
    out = evaluate_arm(model, None, p, held, stream, partial)
    assert calls == ["copy"]  # not run again
    assert out["passkey"] == {"mean": 0.5} and set(out) == {"code", "copy", "passkey"}
    assert out["code"]["long"]["ppl"] == evaluate_arm(model, None, p, held, stream)["code"]["long"]["ppl"]


def test_a_freeze_recipe_keeps_those_weights_the_source_s():
    torch.manual_seed(0)
    model = make_model(perturb_so=False)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    p = dataclasses.replace(PRESETS["smollm2-cpu-smoke"], seq_len=32, steps=3, warmup=1, lr=5e-3,
                            freeze=("q_proj", "k_proj"))
    rows = np.random.default_rng(0).integers(0, model.config.vocab_size, (3 * p.batch_size, 32)).astype(np.int32)
    trained, _ = train_arm(model, "all", p, rows, str(DEVICE), "freeze")
    after = trained.state_dict()
    frozen = [k for k in start if "q_proj" in k or "k_proj" in k]
    assert frozen and all(torch.equal(after[k], start[k].to(after[k].device)) for k in frozen)
    assert all(not torch.equal(after[k], start[k].to(after[k].device)) for k in start
               if ("v_proj" in k or "o_proj" in k))  # the rest trained
    with pytest.raises(ValueError, match="no trainable parameter"):
        train_arm(make_model(perturb_so=False), "so+norms", dataclasses.replace(p, freeze=("q_proj",)), rows,
                  str(DEVICE), "freeze")


def test_the_window_arms_carry_their_window_seed_rank_and_frozen_projections():
    from orthros.experiments.cpt_arms import ARMS, arm_preset

    base = PRESETS["smollm2-kd-h200-rqp"]
    for name, (window, seed, freeze) in {"orthros-cpt-sink-mix-aw-w512": (512, 0, ()),
                                         "orthros-cpt-sink-mix-aw-w512-s1": (512, 1, ()),
                                         "orthros-cpt-sink-mix-aw-w512-fqk": (512, 0, ("q_proj", "k_proj")),
                                         "orthros-cpt-sink-mix-aw-w1024": (1024, 0, ())}.items():
        arm, p = ARMS[name], arm_preset(name, base)
        assert (arm.window, arm.seed, p.freeze, p.answer_weight, arm.mode) == (window, seed, freeze, 32.0, "all")
    p = arm_preset("orthros-lora-sink-mix-aw-w512-r16", base)
    assert (ARMS["orthros-lora-sink-mix-aw-w512-r16"].mode, p.lora_rank, p.answer_weight) == ("lora+so", 16, 32.0)
    assert arm_preset("orthros-lora-sink-mix-aw-w512", base).lora_rank == 8
    # the light twin distilled from its full-weight twin: that arm trains first in the same run, at its window
    kd = ARMS["orthros-lora-sink-mix-aw-w1024-r24-kd-full"]
    teacher = ARMS[kd.teacher]
    assert (kd.mode, kd.window, teacher.mode, teacher.window) == ("lora+so", 1024, "all", 1024)
    assert arm_preset("orthros-lora-sink-mix-aw-w1024-r24-kd-full", base).lora_rank == 24
    assert all(a.teacher in (None, "source") or a.teacher in ARMS for a in ARMS.values())


def test_a_sharpened_start_scales_the_output_queries_of_the_later_layers_only(tmp_path):
    """`Arm.sharpen` (f, s): the output rows' queries of layers >= f * L are s times the unsharpened
    model's, so their scores are s times too; every other layer, the base stream and the K/V match."""
    from orthros.experiments import cpt, cpt_arms

    torch.manual_seed(0)
    model = make_model(perturb_so=True)
    model.save_pretrained(tmp_path / "conv")
    cpt_arms.ARMS["sharp-test"] = cpt_arms.Arm("x", dict(attention="orthros"), "so-out", sharpen=(0.5, 1.5))
    try:
        plain = cpt.load_arm(tmp_path / "conv", "orthros-0shot", model.config.window_size, "cpu")
        sharp = cpt.load_arm(tmp_path / "conv", "sharp-test", model.config.window_size, "cpu")
    finally:
        del cpt_arms.ARMS["sharp-test"]
    L = model.config.num_hidden_layers
    first = round(0.5 * L)
    for i in range(L):
        a, b = plain.model.layers[i].self_attn, sharp.model.layers[i].self_attn
        s = 1.5 if i >= first else 1.0
        assert torch.allclose(b.so_alpha_out, s * a.so_alpha_out) and torch.allclose(b.so_beta_out, s * a.so_beta_out)
        assert torch.equal(b.q_proj.weight, a.q_proj.weight) and torch.equal(b.k_proj.weight, a.k_proj.weight)
        assert not a.base_so or torch.equal(b.so_alpha, a.so_alpha)  # the last layer has no base SO
    ids = torch.randint(0, model.config.vocab_size, (1, 24))
    with torch.no_grad():
        assert not torch.allclose(plain(ids).logits, sharp(ids).logits, atol=1e-4)
    with pytest.raises(ValueError, match="sharpen"):
        cpt.sharpen_output_queries(plain, 1.5, 2.0)


def test_answer_weight_trains_on_the_answers_harder_and_needs_retrieval_rows():
    """answer_weight: the same rows with the answers x8 give another loss curve from the first step
    (the answers weigh more); an arm whose rows hold no retrieval sample is refused."""
    torch.manual_seed(0)
    model = make_model(perturb_so=False)
    p = dataclasses.replace(PRESETS["smollm2-cpu-smoke"], seq_len=32, steps=2, warmup=1, lr=5e-3)
    rows = np.random.default_rng(0).integers(0, model.config.vocab_size, (2 * p.batch_size, 32)).astype(np.int32)
    mask = np.ones(rows.shape, bool)
    mask[0, :20] = False  # a retrieval row: a prompt, an answer at 12..15, the EOS at 20, then text
    mask[0, 12:16] = True
    curves = []
    for w in (1.0, 8.0):
        torch.manual_seed(0)
        m = make_model(perturb_so=False)
        _, st = train_arm(m, "all", dataclasses.replace(p, answer_weight=w), rows, str(DEVICE), "aw", mask=mask)
        curves.append(st["loss_curve"])
    assert curves[1][0] > curves[0][0] * 1.05
    with pytest.raises(ValueError, match="no retrieval answers"):
        train_arm(model, "all", dataclasses.replace(p, answer_weight=8.0), rows, str(DEVICE), "aw",
                  mask=np.ones(rows.shape, bool))


def test_an_adapter_arm_evaluates_a_shipped_adapter_on_the_conversion(tmp_path, monkeypatch):
    """`Arm.adapter`: the arm is the conversion with the named adapter applied (its SO values, the
    rest the conversion's); an adapter trained at another window or sink count is refused."""
    from orthros.experiments import cpt, cpt_arms
    from orthros.models import adapter as adapters

    torch.manual_seed(0)
    model = make_model(perturb_so=False).cpu()
    model.save_pretrained(tmp_path / "conv")
    tuned = make_model(perturb_so=False).cpu()
    tuned.load_state_dict(model.state_dict())
    tuned = adapters.make_trainable(tuned, "so-out")
    with torch.no_grad():
        for layer in tuned.model.layers:
            layer.self_attn.so_alpha_out.add_(0.25)
    w = model.config.window_size
    adapters.save_adapter(tuned, tmp_path / "shipped" / "a", {"window": w, "sink_tokens": 0})
    adapters.save_adapter(tuned, tmp_path / "shipped" / "b", {"window": w + 1, "sink_tokens": 0})
    monkeypatch.setattr(adapters, "SHIPPED", tmp_path / "shipped")
    for name in "abc":
        monkeypatch.setitem(cpt_arms.ARMS, f"ad-{name}", cpt_arms.Arm("x", dict(attention="orthros"), adapter=name))
    got = cpt.load_arm(tmp_path / "conv", "ad-a", w, "cpu")
    for a, b in zip(got.model.layers, tuned.model.layers):
        assert torch.equal(a.self_attn.so_alpha_out, b.self_attn.so_alpha_out)
        assert torch.equal(a.self_attn.q_proj.weight, b.self_attn.q_proj.weight)
    with pytest.raises(ValueError, match="trained at W="):
        cpt.load_arm(tmp_path / "conv", "ad-b", w, "cpu")
    with pytest.raises(FileNotFoundError, match="no adapter"):
        cpt.load_arm(tmp_path / "conv", "ad-c", w, "cpu")
