"""The `dense_start` kernel hints that `Layout` passes to the dispatcher.

A hint lets kernels drop the document lookups, so it must be given only
when it is true (one document per row, no padding, consecutive query
slots), and giving it must change no result.
"""

import pytest
import torch

import orthros.layers.attention as layer
from orthros.generate import decode_one_token, prefill

from ..conftest import DEVICE, make_model, rel_err


def _record(seen: list, dense_start) -> None:
    """A call's hint, or each group's where one call takes two groups of rows (a decode pair)."""
    seen.extend(dense_start if isinstance(dense_start, tuple) else (dense_start,))


def hints_of(model, *args, **kwargs):
    """Run the model and record the dense_start of every attention call with queries."""
    seen = []
    real = layer.attend

    def spy(*a, dense_start=None, **kw):
        if a[0].shape[1]:
            _record(seen, dense_start)
        return real(*a, dense_start=dense_start, **kw)

    layer.attend = spy
    try:
        out = model(*args, **kwargs)
    finally:
        layer.attend = real
    return out, seen


def without_hints(model, *args, **kwargs):
    real = layer.attend
    layer.attend = lambda *a, dense_start=None, **kw: real(*a, **kw)
    try:
        return model(*args, **kwargs)
    finally:
        layer.attend = real


@pytest.mark.parametrize("case", ["pretrain", "labels", "prefill", "padded", "packed", "sft"])
def test_hints_are_given_when_true_and_change_nothing(case):
    model = make_model(window=5)
    B, T = 2, 37
    ids = torch.randint(0, 256, (B, T), device=DEVICE)
    kw, want = {}, None
    if case == "pretrain":
        want = {0}  # base stream from slot 0; outputs at every slot
    elif case == "labels":
        kw = dict(labels=ids)  # outputs at 0..T-2
        want = {0}
    elif case == "prefill":
        kw = dict(logits_to_keep=1)
        want = {0, T - 1}
    elif case == "padded":
        mask = torch.ones(B, T, dtype=torch.long, device=DEVICE)
        mask[1, :4] = 0
        kw = dict(attention_mask=mask)
        want = {None}
    elif case == "packed":
        pos = torch.cat([torch.arange(20), torch.arange(T - 20)]).to(DEVICE)[None].expand(B, T)
        kw = dict(position_ids=pos)
        want = {None}
    elif case == "sft":
        labels = ids.clone()
        labels[0, :10] = -100  # rows have different output positions
        kw = dict(labels=labels)
        want = {0, None}  # base stream dense; output stream not a common run
    out, seen = hints_of(model, ids, **kw)
    assert set(seen) == want
    ref = without_hints(model, ids, **kw)
    assert rel_err(out.logits, ref.logits) < 1e-6


def test_hints_in_chunked_prefill_and_decode():
    """With a cache: the base stream starts at the cache length; decoding steps stay dense."""
    model = make_model(window=4)
    ids = torch.randint(0, 256, (1, 30), device=DEVICE)
    cache = model.new_cache()
    with torch.no_grad():
        _, seen = hints_of(model, ids[:, :17], past_key_values=cache, use_cache=True,
                           logits_to_keep=torch.empty(0, dtype=torch.long, device=DEVICE))
        assert set(seen) == {0}
        out, seen = hints_of(model, ids[:, 17:], past_key_values=cache, use_cache=True, logits_to_keep=1)
        assert set(seen) == {17, 29}
    full = model(ids, logits_to_keep=1).logits
    assert rel_err(out.logits, full) < 1e-5
    with torch.no_grad():
        logits, cache = prefill(model, ids)
        tok = logits.argmax(-1)
        real = layer.attend
        seen = []
        layer.attend = lambda *a, dense_start=None, **kw: _record(seen, dense_start) or real(*a, dense_start=dense_start,
                                                                                             **kw)
        try:
            decode_one_token(model, tok, None, cache)
        finally:
            layer.attend = real
    assert set(seen) == {30}


@pytest.mark.parametrize("sinks", [0, 4])
def test_a_chunked_prefill_gives_flexattention_one_layout_per_shape(monkeypatch, sinks):
    """Compiled FlexAttention is specialised to its inputs' strides as to their shapes (dynamic=False):
    a chunked prefill over the growing cache must hand it the same strides for the same shapes, or it
    is compiled again for every chunk. The windowed chunks after the first all see W - 1 + C keys (with
    sinks: the sinks, then the window), so they share one shape too."""
    import orthros.ops.flex as flex

    real, seen = flex._flex, {}

    def spy(compiled):
        op = real(compiled)

        def call(q, k, v, **kw):
            seen.setdefault((tuple(q.shape), tuple(k.shape)), set()).add((q.stride(), k.stride(), v.stride()))
            return op(q, k, v, **kw)
        return call

    monkeypatch.setattr(flex, "_flex", spy)
    model = make_model(window=16, attn_backend="flex", sink_tokens=sinks)
    ids = torch.randint(0, model.config.vocab_size, (1, 160), device=DEVICE)
    with torch.no_grad():
        logits, _ = prefill(model, ids, chunk_size=32)  # the model's own growing cache
        ref, _ = prefill(make_model(window=16, sink_tokens=sinks), ids)
    assert max(len(v) for v in seen.values()) == 1, seen
    # keys: the first chunk's 32, every later chunk's sinks + W - 1 + 32, the output row's whole cache
    assert {kv[2] for _, kv in seen} == {32, sinks + 15 + 32, 160}, seen
    assert rel_err(logits, ref) < 1e-4


@pytest.mark.parametrize("sinks", [0, 3])
@pytest.mark.parametrize("rows", [None, 4])
def test_a_dense_chunks_keys_cut_to_its_window_change_nothing(sinks, rows):
    """`DenseKV.seen`, the one place a dense chunk's keys are cut to what it can see: against the
    reference op over every key, at each offset of a 40-key layer (window 6; with and without sinks)."""
    from orthros.ops import naive_attention
    from orthros.ops.kv import DenseKV

    g = torch.Generator().manual_seed(0)
    S, W, M = 40, 6, 4
    k, v = torch.randn(1, S, 2, 8, generator=g), torch.randn(1, S, 2, 8, generator=g)
    k_doc = torch.zeros(1, S, dtype=torch.long)
    for first in range(0, S - M + 1):
        q = torch.randn(1, M, 2, 8, generator=g)
        slot, q_doc = torch.arange(first, first + M)[None], torch.zeros(1, M, dtype=torch.long)
        ref = naive_attention(q, k, v, slot, q_doc, k_doc, window=W, sinks=sinks)
        w = DenseKV.seen(k, v, first, rows, W, sinks)
        assert w.k.shape[1] <= (S - max(0, first - W + 1) if rows is None else M + W - 1) + sinks
        out = naive_attention(q, w.k, w.v, w.local(slot), q_doc, w.key_docs(k_doc), window=W, sinks=sinks)
        assert (out - ref).abs().max() < 1e-6, first
