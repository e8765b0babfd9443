"""Distillation: the losses against their definitions, a tiny teacher and student trained
with `orthros distill`, exact resume (full weights and LoRA + SO), and the errors a user meets."""

import subprocess

import pytest
import torch
from safetensors.torch import load_file

from orthros import cli
from orthros.convert.hf import convert_checkpoint
from orthros.convert.tiny import make_tiny_checkpoint, tiny_tokenizer
from orthros.errors import UserError
from orthros.loading import load_model
from orthros.models.adapter import apply_adapter
from orthros.train import train
from orthros.train.checkpoint import list_checkpoints
from orthros.train.config import build_config
from orthros.train.distill import LossWeights, distill_loss, head_losses, load_teacher, weighted_ce_loss
from orthros.train.metrics import read_metrics

from .train_helpers import DEVICE, PY, ROOT, cli_args, tiny_overrides

SEQ = 32


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny Llama checkpoint (the teacher) and its Orthros conversion at W = 4 (the student)."""
    root = tmp_path_factory.mktemp("distill")
    make_tiny_checkpoint(root / "llama", "llama", tokenizer=tiny_tokenizer())
    convert_checkpoint(root / "llama", root / "student", window_size=4, dtype="fp32", progress=False)
    convert_checkpoint(root / "llama", root / "wide", window_size=4 * SEQ, dtype="fp32", progress=False)
    return root


def batch(vocab, seed=0, B=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, SEQ), generator=g).to(DEVICE)
    return {"input_ids": ids, "labels": ids.clone()}


def run_cfg(source, out, **kw):
    o = tiny_overrides(out, **kw)
    del o["model.name"], o["model.overrides"], o["data.tokenizer"]
    o.update({"model.init_from": str(source / "student"), "distill.teacher": str(source / "llama"),
              "data.max_bytes": "20000", "data.seq_len": str(SEQ), "train.device": "cpu"})
    o.update({k.replace("__", "."): str(v) for k, v in kw.items()})
    return o


def test_kl_and_alignment_vanish_when_the_student_is_the_teacher(source):
    """W >= T and SO at identity: the converted model computes its source exactly, so every
    term is 0 up to rounding; at W = 4 the same terms are far from 0 (the test can fail)."""
    teacher = load_teacher(source / "llama", DEVICE, torch.float32, cache_dir=source / "teacher")
    wide, narrow = load_model(source / "wide").to(DEVICE), load_model(source / "student").to(DEVICE)
    b = batch(teacher.config.vocab_size)
    w = LossWeights(ce=0.0, kl=1.0, align=1.0, align_on="kv+hidden")
    _, same = distill_loss(wide, teacher, b, SEQ * 2, w)
    _, diff = distill_loss(narrow, teacher, b, SEQ * 2, w)
    assert diff["kl"].item() > 1e-3 and diff["align"].item() > 1e-3
    # rounding only (GPU kernels differ between the two attentions' code paths): far below the W = 4 terms
    tol = 1e-9 if DEVICE == "cpu" else 1e-6
    assert same["kl"].item() < max(tol, 1e-4 * diff["kl"].item())
    assert same["align"].item() < max(tol, 1e-4 * diff["align"].item())


def test_head_losses_match_their_definition_with_temperature():
    """KL and CE made from hidden rows a chunk at a time (recomputed in the backward) == the
    plain formulas on whole logits, values and gradients (the student's rows and head)."""
    torch.manual_seed(0)
    M, C, V, T = 5000, 16, 37, 2.0
    s_head, t_head = torch.nn.Linear(C, V, bias=False).double(), torch.nn.Linear(C, V, bias=False).double()
    s_h = torch.randn(M, C, dtype=torch.float64, requires_grad=True)
    t_h = torch.randn(M, C, dtype=torch.float64)
    target = torch.randint(0, V, (M,))
    s, t = s_head(s_h), t_head(t_h)
    kl_ref = (torch.softmax(t / T, -1) * (torch.log_softmax(t / T, -1) - torch.log_softmax(s / T, -1))).sum() * T * T
    ce_ref = torch.nn.functional.cross_entropy(s, target, reduction="sum")
    kl, ce = head_losses(s_h, t_h, target, s_head, t_head, T)
    assert torch.allclose(kl.double(), kl_ref, rtol=1e-5) and torch.allclose(ce.double(), ce_ref, rtol=1e-5)
    for got, ref in ((kl, kl_ref), (ce, ce_ref)):
        g_got = torch.autograd.grad(got, (s_h, s_head.weight), retain_graph=True)
        g_ref = torch.autograd.grad(ref, (s_h, s_head.weight), retain_graph=True)
        assert all(torch.allclose(a.double(), b, rtol=1e-4, atol=1e-6) for a, b in zip(g_got, g_ref))


def test_weighted_losses_are_the_plain_ones_at_weight_1_and_weigh_each_target(source):
    """weighted_ce_loss at every weight 1 == the model's own loss (value and gradient); with weights it is
    sum(w * CE) / n over the targets, the weight of predicting the token at p read at p (the labels'
    indexing); distill_loss with weights scales each target's KL and CE alike."""
    student = load_model(source / "student").to(DEVICE).float()
    teacher = load_teacher(source / "llama", DEVICE, torch.float32, cache_dir=source / "teacher")
    b = batch(student.config.vocab_size, seed=3)
    b["labels"][0, :7] = -100
    n = int((b["labels"][:, 1:] != -100).sum())
    ref = student(**b, use_cache=False).loss
    one = weighted_ce_loss(student, b, n, torch.ones(2, SEQ, device=DEVICE))
    assert torch.allclose(one, ref, rtol=1e-5)
    w = torch.ones(2, SEQ, device=DEVICE)
    w[1, 10:14] = 9.0  # the targets at 10..13: the predictions made at 9..12
    out = student(**b, use_cache=False)  # logits of the output rows, at output_positions
    pos = out.output_positions
    nxt = (pos + 1).clamp(0, SEQ - 1)
    tgt = torch.where((pos >= 0) & (pos + 1 < SEQ), b["labels"].gather(1, nxt), -100)
    ce = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), tgt.flatten(), ignore_index=-100,
                                           reduction="none").view(tgt.shape)
    want = (ce * w.gather(1, nxt)).sum() / n
    assert torch.allclose(ce.sum() / n, ref, rtol=1e-5)
    got = weighted_ce_loss(student, b, n, w)
    assert torch.allclose(got, want, rtol=1e-5) and got > ref * 1.1
    g_got = torch.autograd.grad(got, student.lm_head.weight)[0]
    g_want = torch.autograd.grad(want, student.lm_head.weight)[0]
    assert torch.allclose(g_got, g_want, rtol=1e-4, atol=1e-7)
    lw = LossWeights(ce=0.5, kl=1.0, align=0.0)
    plain, p0 = distill_loss(student, teacher, b, n, lw)
    unit, p1 = distill_loss(student, teacher, b, n, lw, weights=torch.ones(2, SEQ, device=DEVICE))
    heavy, p2 = distill_loss(student, teacher, b, n, lw, weights=w)
    assert torch.allclose(plain, unit, rtol=1e-5) and torch.allclose(p2["ce"], want, rtol=1e-5)
    assert p2["kl"] > p0["kl"] and heavy > plain


@pytest.mark.parametrize("trainable", ["all", "lora+so", "lora+so+head"])
def test_distill_resume_is_exact(source, tmp_path, trainable):
    """N steps straight == N/2 steps, stop, resume: same losses (every part), same weights; a light
    run's checkpoint is the merged model, and its adapter reproduces it on the base model (with LoRA
    on the LM head too: the merged checkpoint's head is its own, untied)."""
    head = trainable.endswith("+head")
    trainable = trainable.removesuffix("+head")
    extra = dict(model__lora_targets="[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head]")
    kw = dict(model__trainable=trainable, **(extra if head else {}), distill__ce="0.5", distill__align="1.0",
              distill__align_steps="2",
              optim__vector_lr="1e-2", optim__lora_lr="1e-2", checkpoint__every="100", train__steps="4",
              train__grad_accum="2", train__gradient_checkpointing="true")
    train(build_config(None, run_cfg(source, tmp_path / "straight", **kw)))
    train(build_config(None, run_cfg(source, tmp_path / "split", train__stop_at="2", **kw)))
    train(build_config(None, run_cfg(source, tmp_path / "split", checkpoint__resume="latest", **kw)))
    ra = [r for r in read_metrics(tmp_path / "straight/metrics.jsonl") if "loss" in r]
    rb = [r for r in read_metrics(tmp_path / "split/metrics.jsonl") if "loss" in r]
    assert len(ra) == len(rb) == 4
    for a, b in zip(ra, rb):
        assert all(a[k] == b[k] for k in ("loss", "loss_ce", "loss_kl")), (a, b)
    assert "loss_align" in ra[0] and "loss_align" not in ra[-1]  # the alignment warm-up ended at step 2
    ca = list_checkpoints(tmp_path / "straight/checkpoints")[-1]
    cb = list_checkpoints(tmp_path / "split/checkpoints")[-1]
    wa, wb = load_file(str(ca / "model.safetensors")), load_file(str(cb / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not any("lora_" in k for k in wa)
    start = load_file(str(source / "student" / "model.safetensors"))
    moved = [k for k in wa if not torch.equal(wa[k], start[k])]
    if trainable == "lora+so":
        assert (ca / "adapter.safetensors").exists()
        assert all(("so_" in k) or ("norm" in k) or k.endswith("proj.weight") or (head and k == "lm_head.weight")
                   for k in moved)
        assert ("lm_head.weight" in moved) == head
        base = load_model(source / "student")
        apply_adapter(base, ca)
        x = torch.randint(0, base.config.vocab_size, (1, SEQ))
        with torch.no_grad():
            assert torch.allclose(base(x).logits, load_model(ca)(x).logits, atol=1e-5)
    else:
        assert any("embed" in k for k in moved) and not (ca / "adapter.safetensors").exists()


def test_a_teacher_with_another_vocabulary_is_a_clear_error(source, tmp_path):
    make_tiny_checkpoint(tmp_path / "other", "llama", tokenizer=tiny_tokenizer(vocab_size=300))
    o = run_cfg(source, tmp_path / "run", distill__teacher=str(tmp_path / "other"))
    with pytest.raises(UserError, match="vocabulary"):
        train(build_config(None, o))
    # same size, other tokens: the tokenizers are compared too
    make_tiny_checkpoint(tmp_path / "same-size", "llama", tokenizer=tiny_tokenizer(corpus_bytes=50_000))
    o = run_cfg(source, tmp_path / "run2", distill__teacher=str(tmp_path / "same-size"))
    with pytest.raises(UserError, match="tokenizer"):
        train(build_config(None, o))


def test_distill_cli_needs_a_teacher_and_says_so_in_one_line(source, tmp_path, capsys):
    o = run_cfg(source, tmp_path / "run")
    del o["distill.teacher"]
    assert cli.main(["distill", *cli_args(o)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a teacher" in err[0]
    assert cli.main(["distill", *cli_args(run_cfg(source, tmp_path / "r2", model__trainable="lora"))]) == 2
    assert "model.trainable" in capsys.readouterr().err
    o = run_cfg(source, tmp_path / "r3", model__trainable="lora+so", model__lora_targets="[q_proj, mlp]")
    assert cli.main(["distill", *cli_args(o)]) == 2
    assert "model.lora_targets" in capsys.readouterr().err


def test_distill_cli_trains(source, tmp_path):
    """The installed command end to end: a teacher converted once into out_dir/teacher, a checkpoint."""
    o = run_cfg(source, tmp_path / "run", train__steps="2", model__trainable="so+norms", optim__vector_lr="1e-2")
    r = subprocess.run([PY, "-m", "orthros", "distill", *cli_args(o)], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "teacher:" in r.stderr and (tmp_path / "run/teacher/config.json").exists()
    assert list_checkpoints(tmp_path / "run/checkpoints")
