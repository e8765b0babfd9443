"""SFT examples -> (token ids, target mask): loss only on the responses.

A prompt/response pair is `prompt + response + EOS`; a chat `messages` list
is rendered with the tokenizer's chat template when it has one (the BPE
trained by `orthros train` carries ChatML), else with a plain
`### role` layout. Each rendered piece is tokenized on its own so that the
target mask lines up exactly with the assistant turns.
"""

from __future__ import annotations

from .tokenizer import encode


def _chat_segments(messages: list[dict], tok) -> list[tuple[str, bool]]:
    """[(text, is_target)] whose concatenation is the rendered conversation."""
    template = getattr(tok, "chat_template", None)
    if template:
        def render(msgs, gen=False):
            return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) if msgs else ""
    else:
        def render(msgs, gen=False):
            text = "".join(f"### {m['role']}\n{m['content']}\n" for m in msgs)
            return text + ("### assistant\n" if gen else "")
    segs, done = [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head, full = render(messages[:i], gen=True), render(messages[: i + 1])
        if not (head.startswith(done) and full.startswith(head)):
            raise ValueError("the tokenizer's chat template does not render conversations prefix by prefix; "
                             "cannot tell assistant turns apart")
        segs += [(head[len(done):], False), (full[len(head):], True)]
        done = full
    rest = render(messages)[len(done):]
    return segs + ([(rest, False)] if rest else [])


def render_example(example: dict, tok) -> tuple[list[int], list[bool]]:
    """Token ids and per-token 'is a target' flags of one SFT example."""
    eos = getattr(tok, "eos_token_id", None)
    bos = getattr(tok, "bos_token_id", None)
    if "messages" in example:
        segs = _chat_segments(example["messages"], tok)
        tail = []  # chat templates close each turn themselves
    else:
        response = example.get("response", example.get("completion"))
        segs = [(str(example["prompt"]), False), (str(response), True)]
        tail = [] if eos is None else [eos]
    ids, mask = ([bos], [False]) if bos is not None else ([], [])
    for text, target in segs:
        t = encode(tok, text)
        ids += t
        mask += [target] * len(t)
    ids += tail
    mask += [True] * len(tail)
    return ids, mask
