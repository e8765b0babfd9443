"""Every parameter takes part in training, and files from before the last layer lost its base SO load.

The last layer's base stream makes K/V only, so a base-stream scale-offset there would
never get a gradient; DistributedDataParallel without `find_unused_parameters` fails on
such a parameter. That layer has none; checkpoints, adapters and optimizer states that
still hold it load (the values are never read).
"""

import logging

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from orthros import OrthrosConfig, OrthrosForCausalLM
from orthros.parallel import spawn

from ..conftest import DEVICE, make_model

KINDS = [dict(attention="orthros"), dict(attention="orthros", scale_offset=False), dict(attention="full"),
         dict(attention="swa")]


def batch(B=2, T=12, seed=0, device=DEVICE):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed)).to(device)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: "-".join(map(str, k.values())))
def test_every_parameter_gets_a_gradient_in_pre_training(kind):
    model = make_model(window=3, num_hidden_layers=3, tie_word_embeddings=False, **kind).train()
    ids = batch()
    model(ids, labels=ids).loss.backward()
    none = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not none, f"parameters without a gradient: {none}"


def _ddp_steps(rank: int, world: int, config, state, batches, out: list):
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool
    model = OrthrosForCausalLM(config).train()
    model.load_state_dict(state)
    ddp = DDP(model)  # find_unused_parameters=False (the default): every parameter must get a gradient
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for ids in batches:
        ids = ids[rank::world]
        ddp(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    if rank == 0:
        torch.save(model.state_dict(), out[0])


def test_ddp_steps_without_find_unused_parameters(tmp_path):
    """Two gloo processes, two steps (DDP notices an unused parameter at the second step's forward);
    the result equals one process stepping on the mean of their gradients."""
    config = OrthrosConfig.from_name("tiny", window_size=3)
    torch.manual_seed(0)
    model = OrthrosForCausalLM(config).train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [batch(4, 10, seed=s, device="cpu") for s in (1, 2)]
    out = str(tmp_path / "rank0.pt")
    # fork is faster, but not from a process whose autograd has run on CUDA (the engine's threads)
    spawn(_ddp_steps, 2, config, state, batches, [out], start_method="spawn" if torch.cuda.is_initialized() else "fork")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for ids in batches:
        for part in (ids[0::2], ids[1::2]):
            (model(part, labels=part).loss / 2).backward()
        opt.step()
        opt.zero_grad()
    got = torch.load(out)
    for name, want in model.state_dict().items():
        torch.testing.assert_close(got[name], want, msg=name)


def old_style(model: OrthrosForCausalLM) -> OrthrosForCausalLM:
    """The model as earlier versions built it: the last layer with base-stream SO too."""
    attn = model.model.layers[-1].self_attn
    n = attn.so_alpha_out.numel()
    attn.register_parameter("so_alpha", nn.Parameter(torch.full((n,), 1.5)))
    attn.register_parameter("so_beta", nn.Parameter(torch.full((n,), 0.25)))
    return model


def test_checkpoints_with_the_last_layers_base_so_load(tmp_path, caplog):
    """transformers' from_pretrained (without an unexpected-keys warning) and orthros' checked loader."""
    from orthros.loading import load_model

    model = make_model(window=3)
    old_style(model).save_pretrained(tmp_path)
    ids = batch()
    with torch.no_grad():
        want = model(ids).logits
    with caplog.at_level("WARNING"):
        loaded = OrthrosForCausalLM.from_pretrained(tmp_path)
    assert "so_alpha" not in caplog.text and "so_beta" not in caplog.text
    for m in (loaded.to(DEVICE), load_model(tmp_path).to(DEVICE)):
        assert not hasattr(m.model.layers[-1].self_attn, "so_alpha")
        with torch.no_grad():
            torch.testing.assert_close(m(ids).logits, want, rtol=0, atol=0)


def test_adapters_with_the_last_layers_base_so_apply_and_resume(tmp_path):
    from orthros.models.adapter import apply_adapter, load_trainable, make_trainable, save_adapter

    trained = make_trainable(old_style(make_model(window=3)), "so")
    save_adapter(trained, tmp_path / "a")
    base = make_model(window=3, perturb_so=False)
    apply_adapter(base, tmp_path / "a")
    fresh = make_trainable(make_model(window=3, perturb_so=False), "so")
    load_trainable(fresh, tmp_path / "a")
    for m in (base, fresh):
        for name, p in m.named_parameters():
            if ".so_" in name:
                torch.testing.assert_close(p, dict(trained.named_parameters())[name], msg=name)


def test_an_optimizer_state_naming_the_last_layers_base_so_resumes(tmp_path):
    from orthros.train import checkpoint as C
    from orthros.train.dist import Dist

    old = old_style(make_model(window=3)).train()
    opt = torch.optim.AdamW(old.parameters(), lr=1e-3)
    ids = batch()
    old(ids, labels=ids).loss.backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    state = C.get_optimizer_state_dict(old, opt, options=C.StateDictOptions(full_state_dict=True, cpu_offload=True))
    assert any("layers.1.self_attn.so_alpha" in str(p) for p in state["param_groups"][0]["params"])

    class Loader:
        def load_state_dict(self, s):
            self.state = s

    C.write_state(tmp_path, {"step": 1, "optimizer": state, "scheduler": sched.state_dict(), "rng": [C._rng_state()],
                             "data": {}, "world_size": 1})
    new = make_model(window=3).train()
    opt2 = torch.optim.AdamW(new.parameters(), lr=1e-3)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0)
    assert C.load_train_state(tmp_path, new, opt2, sched2, Loader(), Dist()) == 1
    moments = {n: opt2.state[p]["exp_avg"] for n, p in new.named_parameters()}
    for n, p in old.named_parameters():
        if n in moments:
            torch.testing.assert_close(moments[n], opt.state[p]["exp_avg"], msg=n)


@pytest.mark.parametrize("changes", [dict(attention="full"), dict(attention="swa"), dict(scale_offset=False)],
                         ids=["full", "swa", "no-so"])
def test_an_orthros_checkpoint_loads_as_its_baseline_quietly(tmp_path, changes):
    """An Orthros checkpoint run as a baseline (a distillation teacher is) has SO tensors the model
    has no place for: they are dropped without transformers' load report, and every other weight
    loads."""
    model = make_model()
    model.save_pretrained(tmp_path)
    cfg = OrthrosConfig.from_pretrained(tmp_path)
    for k, v in changes.items():
        setattr(cfg, k, v)
    records = []
    catch = logging.Handler(logging.DEBUG)
    catch.emit = records.append  # transformers' loggers write to their own handler, not propagated
    root = logging.getLogger("transformers")
    root.addHandler(catch)
    try:
        other = OrthrosForCausalLM.from_pretrained(tmp_path, config=cfg)
    finally:
        root.removeHandler(catch)
    said = "\n".join(r.getMessage() for r in records)
    assert "UNEXPECTED" not in said and "MISSING" not in said, said
    want = model.state_dict()
    assert all(torch.equal(p.cpu(), want[n].cpu()) for n, p in other.state_dict().items())
