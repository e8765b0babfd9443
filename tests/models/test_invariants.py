"""SPEC §2's consistency invariants, on tiny fp32 models at odd sizes.

1. Logits at an output position do not depend on which other positions are
   output positions: pre-training, SFT, prefill, chunked prefill and
   token-by-token decoding agree.
2. W >= T and SO at identity: Orthros computes exactly the full transformer.
3. Any W >= 1, any length, padding, no output positions: finite everywhere.
"""

import pytest
import torch

from orthros.generate import decode_one_token, prefill

from ..conftest import DEVICE, make_model, rel_err

TOL = 1e-5


def ids_for(T, B=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, T), generator=g).to(DEVICE)


@pytest.mark.parametrize("T", [1, 7, 63, 130])
def test_orthros_equals_full_when_window_covers_sequence(T):
    orthros = make_model("orthros", window=T, perturb_so=False)
    full = make_model("full", window=T)
    full.load_state_dict(orthros.state_dict(), strict=False)  # same weights, SO dropped
    ids = ids_for(T, B=2)
    assert rel_err(orthros(ids).logits, full(ids).logits) < TOL
    # a window larger than the sequence changes nothing either
    wide = make_model("orthros", window=4 * T + 3, perturb_so=False)
    assert rel_err(wide(ids).logits, full(ids).logits) < TOL


def test_orthros_differs_from_full_when_window_is_short():
    orthros = make_model("orthros", window=3, perturb_so=False)
    full = make_model("full", window=3)
    ids = ids_for(40)
    assert rel_err(orthros(ids).logits, full(ids).logits) > 1e-3


@pytest.mark.parametrize("attention", ["orthros", "full", "swa"])
@pytest.mark.parametrize("T, W", [(7, 3), (63, 16), (130, 1), (130, 16)])
def test_all_phases_agree(attention, T, W):
    model = make_model(attention, window=W)
    ids = ids_for(T, seed=T)
    ref = model(ids).logits[0]  # pre-training: every position an output position
    assert ref.shape == (T, 256)

    # SFT: labels mask a prompt; outputs are the positions whose next label counts
    labels = ids.clone()
    prompt = T // 2
    labels[:, : prompt + 1] = -100
    out = model(ids, labels=labels)
    pos = out.output_positions[0]
    assert pos.tolist() == list(range(prompt, T - 1))
    assert rel_err(out.logits[0], ref[pos]) < TOL
    assert torch.isfinite(out.loss)

    # prefill of every few prefixes: one output position, the last
    for t in sorted({0, T // 3, T - 1}):
        last = model(ids[:, : t + 1], logits_to_keep=1).logits[0, -1]
        assert rel_err(last, ref[t]) < TOL, t

    # chunked prefill at several chunk sizes, then token-by-token decoding
    for chunk in (1, 5, W, 64):
        start = max(1, T // 2)
        logits, cache = prefill(model, ids[:, :start], chunk_size=chunk)
        assert rel_err(logits[0], ref[start - 1]) < TOL, chunk
        for t in range(start, T):
            logits = decode_one_token(model, ids[:, t], None, cache)
            assert rel_err(logits[0], ref[t]) < TOL, (chunk, t)
        assert cache.get_seq_length() == T


def test_arbitrary_output_subsets_agree():
    model = make_model(window=5)
    ids = ids_for(50, B=2)
    ref = model(ids).logits
    mask = torch.rand(2, 50, generator=torch.Generator().manual_seed(1)) < 0.3
    out = model(ids, logits_to_keep=mask.to(DEVICE))
    for b in range(2):
        n = int(mask[b].sum())
        pos = out.output_positions[b, :n]
        assert pos.tolist() == mask[b].nonzero().flatten().tolist()
        assert (out.output_positions[b, n:] == -1).all()
        assert rel_err(out.logits[b, :n], ref[b, pos]) < TOL
    idx = torch.tensor([3, 17, 49], device=DEVICE)
    assert rel_err(model(ids, logits_to_keep=idx).logits, ref[:, idx]) < TOL


@pytest.mark.parametrize("attention", ["orthros", "full", "swa"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_each_sequence_alone(attention, side):
    model = make_model(attention, window=4)
    lengths = [13, 6, 1]
    T = max(lengths)
    seqs = [ids_for(n, seed=n)[0] for n in lengths]
    ids = torch.zeros(len(seqs), T, dtype=torch.long, device=DEVICE)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        sl = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        ids[i, sl], mask[i, sl] = s, 1
    batched = model(ids, attention_mask=mask).logits
    for i, s in enumerate(seqs):
        alone = model(s[None]).logits[0]
        got = batched[i][mask[i].bool()]
        assert rel_err(got, alone) < TOL, (i, side)
    assert torch.isfinite(batched).all()


@pytest.mark.parametrize("attention", ["orthros", "full", "swa"])
def test_packed_equals_separate(attention):
    model = make_model(attention, window=4)
    lengths = [9, 1, 14, 5]
    seqs = [ids_for(n, seed=10 + n)[0] for n in lengths]
    packed = torch.cat(seqs)[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None].to(DEVICE)
    labels = packed.clone()
    out = model(packed, position_ids=position_ids).logits[0]
    start = 0
    for s in seqs:
        alone = model(s[None]).logits[0]
        assert rel_err(out[start : start + len(s)], alone) < TOL
        start += len(s)
    # and the loss ignores the cross-document targets when labels mark them
    labels[0, torch.cumsum(torch.tensor(lengths), 0)[:-1]] = -100
    assert torch.isfinite(model(packed, position_ids=position_ids, labels=labels).loss)


def test_packed_decoding_continues_the_last_document():
    model = make_model(window=3)
    a, b = ids_for(6, seed=1)[0], ids_for(9, seed=2)[0]
    packed = torch.cat([a, b[:5]])[None]
    pos = torch.cat([torch.arange(6), torch.arange(5)])[None].to(DEVICE)
    out = model(packed, position_ids=pos, use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    ref = model(b[None]).logits[0]
    for t in range(5, 9):
        logits = decode_one_token(model, b[t : t + 1], None, cache)
        assert rel_err(logits[0], ref[t]) < TOL


@pytest.mark.parametrize("attention", ["orthros", "full", "swa"])
@pytest.mark.parametrize("T, W", [(1, 1), (1, 16), (9, 1), (40, 3)])
def test_finite_outputs_and_gradients(attention, T, W):
    model = make_model(attention, window=W).train()
    ids = ids_for(T, B=2)
    mask = torch.ones_like(ids)
    mask[1, : T // 2] = 0  # left padding
    out = model(ids, attention_mask=mask, labels=ids)
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    out.loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), n


@pytest.mark.parametrize("attention", ["orthros", "full", "swa"])
def test_no_output_positions(attention):
    model = make_model(attention, window=3).train()
    ids = ids_for(12, B=2)
    empty = torch.empty(0, dtype=torch.long, device=DEVICE)
    out = model(ids, logits_to_keep=empty)
    assert out.logits.shape == (2, 0, 256)
    labels = torch.full_like(ids, -100)  # nothing to predict: SFT batch with no responses
    out = model(ids, labels=labels)
    assert out.logits.shape[1] == 0 and out.loss.item() == 0.0
    out.loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), n


def test_loss_is_mean_cross_entropy_over_output_positions():
    model = make_model(window=4)
    ids = ids_for(20, B=2)
    labels = ids.clone()
    labels[0, :10] = -100
    out = model(ids, labels=labels)
    full = model(ids).logits
    targets, logits = [], []
    for b in range(2):
        for t in range(19):
            if labels[b, t + 1] != -100:
                logits.append(full[b, t])
                targets.append(labels[b, t + 1])
    ref = torch.nn.functional.cross_entropy(torch.stack(logits), torch.stack(targets))
    assert abs(out.loss.item() - ref.item()) < 1e-5


@pytest.mark.parametrize("attention", ["orthros", "swa"])
def test_mlp_in_row_chunks_changes_no_logit(attention, monkeypatch):
    """Without autograd a group longer than `MLP_CHUNK` rows runs its MLP in row chunks added in
    place (what bounds a long context-parallel shard's activations): the logits stay the same."""
    model = make_model(attention, window=5)
    ids = ids_for(23, B=2, seed=3)
    calls = []
    model.model.layers[0].mlp.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        ref = model(ids).logits
        one = len(calls)
        monkeypatch.setattr("orthros.models.block.MLP_CHUNK", 4)
        got = model(ids).logits
    assert len(calls) - one > 2 * one  # 23 rows a group: 6 chunks each
    assert rel_err(got, ref) < TOL
