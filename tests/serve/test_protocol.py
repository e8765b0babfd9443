"""The completions schema's prompt kinds (no server: pydantic alone)."""

import pytest
from pydantic import ValidationError

from orthros.serve.protocol import CompletionRequest


def req(prompt):
    return CompletionRequest.model_validate({"model": "m", "prompt": prompt})


@pytest.mark.parametrize("prompt, want", [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([5, 0, 7], [[5, 0, 7]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_each_prompt_kind_gives_its_prompts(prompt, want):
    assert req(prompt).prompts() == want


@pytest.mark.parametrize("prompt", ["", [], [""], ["a", ""], [[1], []]])
def test_an_empty_prompt_is_an_error(prompt):
    with pytest.raises(ValidationError, match="must not be empty"):
        req(prompt)


@pytest.mark.parametrize("prompt", [[1, 2.5], [1, "2"], [True, 3], [[1], [2.0]], [1, [2]], {"a": 1}])
def test_token_ids_are_whole_numbers_and_one_kind_a_list(prompt):
    """Strict: 2.5, "2" and true are not token ids (a lax schema read "2" and true as ids), and a list
    mixing ids with texts or lists is no prompt kind."""
    with pytest.raises(ValidationError):
        req(prompt)
