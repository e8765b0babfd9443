"""What a transformers user expects of any causal LM, on Orthros.

Recorded hidden states and attentions have one row per input position, also when
generate() computes one output position (prefill with logits_to_keep=1, k+1 when
verifying drafts); the base stream's records are opt-in, so the output tuple has
transformers' length; the base model takes transformers' arguments; torch.export
traces the prefill.
"""

import pytest
import torch
from transformers import AutoModel
from transformers.modeling_outputs import BaseModelOutputWithPast

from orthros.models.compat import GENERATE_CACHE_KEY
from orthros.models.model import OrthrosModel

from ..conftest import DEVICE, llama_twin, make_model, rel_err
from .test_hf import left_padded, lively_model

MODES = {"greedy": dict(do_sample=False), "sample": dict(do_sample=True, top_k=20),
         "beam": dict(do_sample=False, num_beams=2)}


@pytest.mark.parametrize("mode", MODES)
def test_generate_dict_outputs_have_one_row_per_input_position(mode):
    """transformers' shapes: the prefill's attentions [B, H, T, T] and hidden states [B, T, C]
    (although it computes logits at one position), then [B, H, 1, S] and [B, 1, C] per step
    (B counts the beams). The prefill's last row is the one its first token came from."""
    model = lively_model()
    ids, mask = left_padded()
    n, (B, T), C, L = 3, ids.shape, model.config.hidden_size, model.config.num_hidden_layers
    torch.manual_seed(0)
    out = model.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=n, return_dict_in_generate=True,
                         output_attentions=True, output_hidden_states=True, output_scores=True, **MODES[mode])
    rows = B * MODES[mode].get("num_beams", 1)
    assert len(out.attentions) == len(out.hidden_states) == n
    for i, (attn, hidden) in enumerate(zip(out.attentions, out.hidden_states)):
        q = T if i == 0 else 1
        assert len(attn) == L and len(hidden) == L + 1
        assert all(a.shape == (rows, 4, q, T + i) for a in attn)
        assert all(h.shape == (rows, q, C) for h in hidden)
    with torch.no_grad():
        plain = model(ids, attention_mask=mask, logits_to_keep=1).logits[:, -1]
    first = model.lm_head(out.hidden_states[0][-1][:, -1])
    if mode != "beam":  # beams start from copies of each prompt
        torch.testing.assert_close(first, plain, rtol=1e-5, atol=1e-5)
    sees = out.attentions[0][0].sum(-1)  # each real row's probabilities over the prompt sum to 1
    torch.testing.assert_close(sees[:1], torch.ones_like(sees[:1]))


def test_assisted_decoding_with_hidden_states_and_attentions():
    """transformers splits a verification forward's records per token (it looks for the
    (batch, input length) axes): they must cover the k + 1 input positions, not only the
    logit rows. Same tokens as plain greedy decoding, same records up to rounding."""
    model = lively_model(window=3)
    draft = lively_model(window=2, seed=1)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
              output_hidden_states=True, output_attentions=True)
    want = model.generate(ids, **kw)
    got = model.generate(ids, assistant_model=draft, **kw)
    assert got.sequences.tolist() == want.sequences.tolist()
    assert len(got.hidden_states) == len(want.hidden_states) == 10
    for step, (a, b) in enumerate(zip(got.hidden_states, want.hidden_states)):
        assert [t.shape for t in a] == [t.shape for t in b], step
        assert max(rel_err(x, y) for x, y in zip(a, b)) < 1e-5, step
    for step, (a, b) in enumerate(zip(got.attentions, want.attentions)):
        assert [t.shape for t in a] == [t.shape for t in b], step
        assert max(rel_err(x, y) for x, y in zip(a, b)) < 1e-5, step


def test_the_output_tuple_has_transformers_fields_only():
    """Asking for hidden states (or attentions) adds one field to the tuple, as for any
    transformers model; the base stream's come only with output_base_stream=True."""
    model = make_model(window=3)
    ids, mask = left_padded()
    with torch.no_grad():
        plain = model(ids, attention_mask=mask, return_dict=False)
        hidden = model(ids, attention_mask=mask, return_dict=False, output_hidden_states=True)
        both = model(ids, attention_mask=mask, return_dict=False, output_hidden_states=True, output_attentions=True)
        base = model(ids, attention_mask=mask, output_hidden_states=True, output_base_stream=True)
    assert len(hidden) == len(plain) + 1 and len(both) == len(plain) + 2
    assert base.base_hidden_states is not None and base.base_attentions is None


def test_the_base_model_takes_transformers_arguments():
    """model.model(input_ids=..., attention_mask=...) returns transformers' base-model output:
    every position's last hidden state, which is Llama's at W >= T (SO at identity) and what
    the LM head reads; the cache it returns continues the sequence."""
    model = make_model(window=64, perturb_so=False)
    ids, mask = left_padded()
    real = mask.bool()
    with torch.no_grad():
        out = model.model(input_ids=ids, attention_mask=mask, use_cache=True)
        theirs = llama_twin(model).model(input_ids=ids, attention_mask=mask)
        full = model(ids, attention_mask=mask)
        tup = model.model(ids, attention_mask=mask, use_cache=False, return_dict=False, output_hidden_states=True)
        nxt = model.model(input_ids=ids[:, :1], attention_mask=torch.cat([mask, mask[:, :1]], 1),
                          past_key_values=out.past_key_values)
        whole = model.model(input_ids=torch.cat([ids, ids[:, :1]], 1), attention_mask=torch.cat([mask, mask[:, :1]], 1))
    assert isinstance(out, BaseModelOutputWithPast) and out.last_hidden_state.shape == (*ids.shape, 64)
    assert rel_err(out.last_hidden_state[real], theirs.last_hidden_state[real]) < 1e-5
    torch.testing.assert_close(model.lm_head(out.last_hidden_state), full.logits, rtol=1e-5, atol=1e-5)
    assert out.past_key_values.get_seq_length() == ids.shape[1] + 1  # the decode step appended to it
    assert rel_err(nxt.last_hidden_state, whole.last_hidden_state[:, -1:]) < 1e-5
    assert len(tup) == 2 and torch.equal(tup[0], out.last_hidden_state) and len(tup[1]) == 3


def test_auto_model_loads_the_base_model(tmp_path):
    model = make_model(window=3)
    model.save_pretrained(tmp_path)
    base = AutoModel.from_pretrained(tmp_path).to(DEVICE)
    assert type(base) is OrthrosModel
    ids, mask = left_padded()
    with torch.no_grad():
        torch.testing.assert_close(model.lm_head(base(ids, attention_mask=mask).last_hidden_state),
                                   model(ids, attention_mask=mask).logits)


def test_torch_export_of_the_prefill():
    """generate()'s prefill (a padded batch, a new cache, one output position), exported with a
    dynamic batch and length: no host sync on the way (`Layout`'s kernel hints are left unset
    under export) and no guard that narrows the batch's or the length's range, so the program
    runs at other batch sizes and at lengths past 64 rows. (Dim.DYNAMIC, not named dims: torch
    2.11's contiguity checks add `Min(16 L, 32 L) == 16 L`, always true, which named dims refuse
    as unproven; what matters, the ranges, is asserted below.)"""
    from torch.export import Dim
    from torch.utils._sympy.numbers import int_oo

    model = make_model(window=3)
    ids, mask = left_padded(B=2, T=7)
    kw = dict(attention_mask=mask, use_cache=True, logits_to_keep=1)
    dyn = {"input_ids": {0: Dim.DYNAMIC, 1: Dim.DYNAMIC}, "attention_mask": {0: Dim.DYNAMIC, 1: Dim.DYNAMIC},
           "use_cache": None, "logits_to_keep": None}
    ep = torch.export.export(model, (), dict(input_ids=ids, **kw), dynamic_shapes=dyn)
    ranges = list(ep.range_constraints.values())
    assert len(ranges) >= 2 and all(r.lower <= 2 and r.upper == int_oo for r in ranges), ranges
    for B, T in ((2, 7), (3, 70)):
        ids, mask = left_padded(B=B, T=T, seed=B)
        got = ep.module()(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        with torch.no_grad():
            ref = model(ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        torch.testing.assert_close(got.logits, ref.logits)
        assert got[GENERATE_CACHE_KEY].get_seq_length() == T
        torch.testing.assert_close(got[GENERATE_CACHE_KEY].layers[-1].values, ref.cache.layers[-1].values)


def test_torch_export_refuses_a_data_dependent_number_of_output_positions():
    """SFT selects the output positions from the labels: their number is a value of the data,
    not a shape, so the traced program cannot fix it. Documented (docs/conversion.md):
    pass the positions as an index tensor instead, which exports."""
    model = make_model(window=3)
    ids, _ = left_padded(B=2, T=7)
    labels = ids.masked_fill(torch.arange(7, device=DEVICE) < 3, -100)
    with pytest.raises(Exception, match="data-dependent"):
        torch.export.export(model, (ids,), {"labels": labels, "use_cache": False})
    idx = torch.arange(2, 6, device=DEVICE)[None].expand(2, -1)
    ep = torch.export.export(model, (ids,), {"labels": labels, "logits_to_keep": idx, "use_cache": False})
    got = ep.module()(ids, labels=labels, logits_to_keep=idx, use_cache=False)
    ref = model(ids, labels=labels, use_cache=False)
    torch.testing.assert_close(got.loss, ref.loss)
