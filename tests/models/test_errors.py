"""Bad inputs raise clear ValueErrors, never an index error deep inside."""

import pytest
import torch

from ..conftest import DEVICE, make_model


@pytest.fixture(scope="module")
def model():
    return make_model(window=4)


def ids(B=2, T=8):
    return torch.randint(0, 256, (B, T), device=DEVICE)


@pytest.mark.parametrize("bad, match", [
    (lambda: dict(input_ids=torch.tensor([[1, 2, 256]], device=DEVICE)), r"token ids must lie in \[0, 256\)"),
    (lambda: dict(input_ids=torch.tensor([[-1, 2]], device=DEVICE)), "token ids must lie"),
    (lambda: dict(input_ids=torch.zeros(1, 0, dtype=torch.long, device=DEVICE)), "empty input"),
    (lambda: dict(input_ids=torch.zeros(0, 5, dtype=torch.long, device=DEVICE)), "empty input"),
    (lambda: dict(input_ids=torch.tensor([1, 2, 3], device=DEVICE)), r"\[batch, seq\]"),
    (lambda: dict(input_ids=torch.rand(1, 3, device=DEVICE)), "integer tensor"),
    (lambda: dict(input_ids=ids(), attention_mask=torch.ones(2, 5, device=DEVICE)), "attention_mask must be"),
    (lambda: dict(input_ids=ids(), attention_mask=torch.ones(3, 8, device=DEVICE)), "attention_mask must be"),
    (lambda: dict(input_ids=ids(), position_ids=torch.arange(7, device=DEVICE)[None]), "position_ids must be"),
    (lambda: dict(input_ids=ids(), labels=ids(T=7)), "labels must be"),
    (lambda: dict(input_ids=ids(), logits_to_keep=-1), "logits_to_keep must be >= 0"),
    (lambda: dict(input_ids=ids(), logits_to_keep=torch.tensor([8], device=DEVICE)), "logits_to_keep indices"),
    (lambda: dict(input_ids=ids(), logits_to_keep=torch.ones(2, 5, dtype=torch.bool, device=DEVICE)), "bool mask"),
    (lambda: dict(), "exactly one of input_ids"),
])
def test_bad_inputs(model, bad, match):
    with pytest.raises(ValueError, match=match):
        model(**bad())


def test_cache_batch_mismatch(model):
    out = model(ids(B=2), use_cache=True, logits_to_keep=1)
    with pytest.raises(ValueError, match="does not match the cache"):
        model(ids(B=3, T=1), past_key_values=out.past_key_values)
