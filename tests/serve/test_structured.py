"""Structured output (`serve/structured.py`, the masks in `serve/sampling.py`) through a real server and
the official `openai` client: `response_format` json_object / json_schema on chat, vLLM's `guided_json`,
`guided_regex`, `guided_grammar`, `guided_choice`, batched beside unconstrained requests, and the 400s.

The model has random weights and SmolLM2's byte-level BPE tokenizer (49,152 tokens, many of them
spanning JSON punctuation such as `{"` and `":`): left alone it writes no JSON and matches no regex
(checked), so what comes out right comes from the masks."""

import json
import re
import sys
import threading

import pytest
import torch

from ..conftest import make_model, smollm2_dir
from .conftest import start_server, with_chat_template

openai = pytest.importorskip("openai")
llguidance = pytest.importorskip("llguidance")

MSGS = [{"role": "user", "content": "Describe a cat as JSON."}]
CAT = {"type": "object", "additionalProperties": False,
       "properties": {"name": {"type": "string", "maxLength": 12},
                      "age": {"type": "integer", "minimum": 0, "maximum": 120},
                      "color": {"enum": ["black", "white", "tabby"]},
                      "indoor": {"type": "boolean"},
                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
       "required": ["name", "age", "color", "indoor", "tags"]}
EMAIL = r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"
SUM = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'


def check_cat(text: str) -> None:
    """`text` is a JSON object valid under CAT (checked by hand: no jsonschema dependency), written
    without free whitespace (`structured.JSON_STYLE`)."""
    obj = json.loads(text)
    assert text.startswith("{") and "\n" not in text  # (a raw newline is whitespace: inside a string it is invalid)
    assert isinstance(obj, dict) and set(obj) == set(CAT["required"]), obj
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 12
    assert type(obj["age"]) is int and 0 <= obj["age"] <= 120
    assert obj["color"] in ("black", "white", "tabby")
    assert type(obj["indoor"]) is bool
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3
    assert all(isinstance(t, str) and len(t) <= 6 for t in obj["tags"])


def parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir("hf"))
    d = tmp_path_factory.mktemp("structured-model")
    model = make_model("orthros", window=8, initializer_range=0.3, vocab_size=len(tok),
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def server(smol_dir):
    srv, model, tok, name = start_server(smol_dir)
    yield srv, model, tok, name
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0].url, api_key="none", max_retries=0, timeout=120)


def tid(tok, s: str) -> int:
    ids = tok(s, add_special_tokens=False)["input_ids"]
    assert len(ids) == 1, (s, ids)
    return ids[0]


# ------------------------------------------------------------------ the op
@pytest.mark.parametrize("V", [32, 70, 100, 49152])
def test_apply_token_bitmask_equals_llguidance_reference(V):
    """The sampler's mask op equals llguidance's numpy reference, on widths that are no multiple of
    32 and on logits wider than the mask (those tokens are forbidden)."""
    from llguidance.numpy import apply_token_bitmask_inplace

    from orthros.serve.sampling import apply_token_bitmask

    g = torch.Generator().manual_seed(V)
    words = (min(V, 90) + 31) // 32  # V = 100: a mask of 96 tokens over 100 logits
    logits = torch.randn(5, V, generator=g)
    mask = torch.randint(-2**31, 2**31 - 1, (5, words), generator=g, dtype=torch.int64).to(torch.int32)
    mask[1] = -1  # everything allowed
    mask[2] = 0  # nothing
    want = logits.numpy().copy()
    apply_token_bitmask_inplace(want, mask.numpy())
    got = apply_token_bitmask(logits.clone(), mask)
    assert torch.equal(got, torch.from_numpy(want))
    assert torch.isinf(got[2]).all() and torch.isfinite(got[1, : 32 * words]).all()


def test_llguidance_reads_every_token_as_transformers_decodes_it(server):
    """Regression: the GGUF-converted tokenizer's decoder Sequence(ByteFallback, Fuse, Replace,
    ByteLevel) made llguidance (through `llguidance.hf.from_tokenizer`) read 'Ġ' and 'Ċ' literally, so
    a regex with a space could not be met and a newline token could enter a JSON string."""
    from orthros.serve.structured import Grammars

    srv, model, tok, _ = server
    lltok = Grammars(tok, model.config.vocab_size, [tok.eos_token_id]).lltokenizer()
    special = set(tok.all_special_ids)
    for i in range(len(tok)):
        text = tok.decode([i])
        if i not in special and "\ufffd" not in text:  # (a token that is part of a character: no text alone)
            assert lltok.decode_bytes([i]) == text.encode(), (i, tok.convert_ids_to_tokens(i))


def test_eos_is_allowed_exactly_where_the_grammar_can_end(server):
    """The masks of a regex's matcher step by step: EOS forbidden until the grammar may end,
    allowed from there on; the matcher stops where nothing more can follow."""
    from orthros.serve.sampling import GrammarMasks
    from orthros.serve.structured import Grammars

    srv, model, tok, _ = server
    V, eos = model.config.vocab_size, tok.eos_token_id
    guide = Grammars(tok, V, [eos]).compile("regex", "[0-9]{2,4}")
    m = guide.matcher()
    masks = GrammarMasks(V, torch.device("cpu"))

    def allowed():
        bits = (masks.fill([m])[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        return set(bits.flatten().nonzero().flatten().tolist())

    digits = {tid(tok, str(k)) for k in range(10)}
    assert allowed() == digits  # SmolLM2 writes digits one per token
    for n, d in enumerate("5291", start=1):
        assert m.consume_token(tid(tok, d))
        if n < 2:
            assert allowed() == digits
        elif n < 4:
            assert allowed() == digits | {eos}
    assert m.is_stopped() and not m.is_error()
    assert guide.matcher().is_accepting() is False  # each request's own matcher, from the start


# ------------------------------------------------------------ through the API
def test_json_object(server, client):
    """Any JSON object. The model is nudged toward quotes and braces (logit_bias) so that it closes
    its strings within the budget; with the same nudge and no constraint it writes no JSON."""
    srv, model, tok, name = server
    bias = {str(tid(tok, '"')): 8, str(tid(tok, "}")): 2}
    kw = dict(model=name, messages=MSGS, max_tokens=80, temperature=0, logit_bias=bias)
    r = client.chat.completions.create(**kw, response_format={"type": "json_object"})
    c = r.choices[0]
    obj = json.loads(c.message.content)
    assert c.finish_reason == "stop" and isinstance(obj, dict) and obj, c.message.content
    free = client.chat.completions.create(**kw).choices[0].message.content
    assert not parses(free), free
    # "text" is no constraint at all
    assert client.chat.completions.create(**kw, response_format={"type": "text"}).choices[0].message.content == free


def test_json_schema(server, client):
    """OpenAI's json_schema shape on chat (n samples, each its own matcher; streamed too), and the
    same schema as vLLM's guided_json on completions."""
    srv, model, tok, name = server
    rf = {"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT, "strict": True}}
    r = client.chat.completions.create(model=name, messages=MSGS, max_tokens=120, temperature=1.0, seed=3, n=3,
                                       response_format=rf)
    texts = [c.message.content for c in r.choices]
    for c in r.choices:
        assert c.finish_reason == "stop"
        check_cat(c.message.content)
    assert len(set(texts)) > 1  # sampled: the choices differ, each valid
    greedy = client.chat.completions.create(model=name, messages=MSGS, max_tokens=120, temperature=0,
                                            response_format=rf)
    check_cat(greedy.choices[0].message.content)
    chunks = list(client.chat.completions.create(model=name, messages=MSGS, max_tokens=120, temperature=0,
                                                 response_format=rf, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == greedy.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"

    r = client.completions.create(model=name, prompt="A cat:", max_tokens=120, temperature=0,
                                  extra_body={"guided_json": CAT})
    check_cat(r.choices[0].text)
    free = client.completions.create(model=name, prompt="A cat:", max_tokens=120, temperature=0)
    assert not parses(free.choices[0].text)


def test_guided_regex_grammar_and_choice(server, client):
    srv, model, tok, name = server
    kw = dict(model=name, prompt="Contact:", max_tokens=40, temperature=0)
    r = client.completions.create(**kw, extra_body={"guided_regex": EMAIL})
    assert re.fullmatch(EMAIL, r.choices[0].text) and r.choices[0].finish_reason == "stop", r.choices[0].text
    free = client.completions.create(**kw).choices[0].text
    assert not re.fullmatch(EMAIL, free), free
    streamed = list(client.completions.create(**kw, extra_body={"guided_regex": EMAIL}, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text

    lines = r"[a-z]{1,6} [a-z]{1,6}\n[0-9]{1,3}"  # spaces and newlines are tokens of their own kind
    r = client.completions.create(**kw, extra_body={"guided_regex": lines})
    assert re.fullmatch(lines, r.choices[0].text), r.choices[0].text

    r = client.completions.create(**kw, extra_body={"guided_grammar": SUM})
    assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", r.choices[0].text), r.choices[0].text

    choices = ["yes", "no", "maybe later"]
    for prompt in ("Is it?", "Will you come?", "x"):
        r = client.completions.create(model=name, prompt=prompt, max_tokens=10, temperature=0,
                                      extra_body={"guided_choice": choices})
        assert r.choices[0].text in choices and r.choices[0].finish_reason == "stop"
    # chat takes the guided_* options too
    r = client.chat.completions.create(model=name, messages=MSGS, max_tokens=40, temperature=0,
                                       extra_body={"guided_regex": EMAIL})
    assert re.fullmatch(EMAIL, r.choices[0].message.content)


def test_eos_waits_for_the_grammar(server, client):
    """EOS pushed up by +100: unconstrained the answer is empty; under [0-9]{2,4} EOS is masked until
    two digits are out, then taken at once."""
    srv, model, tok, name = server
    kw = dict(model=name, prompt="Number:", max_tokens=10, temperature=0)
    bias = {str(tok.eos_token_id): 100}
    assert client.completions.create(**kw, logit_bias=bias).choices[0].text == ""
    r = client.completions.create(**kw, logit_bias=bias, extra_body={"guided_regex": "[0-9]{2,4}"})
    assert re.fullmatch("[0-9]{2}", r.choices[0].text) and r.choices[0].finish_reason == "stop"


def test_a_mixed_batch_equals_each_request_alone(server, client):
    """Constrained and unconstrained requests at once (greedy): each answer equals that request served
    alone, and steps did mix constrained with unconstrained rows."""
    srv, model, tok, name = server
    rf = {"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT}}
    jobs = [("chat", dict(messages=MSGS, max_tokens=100, response_format=rf)),
            ("cmpl", dict(prompt="Contact:", max_tokens=30, extra_body={"guided_regex": EMAIL})),
            ("cmpl", dict(prompt="A cat:", max_tokens=40)),
            ("cmpl", dict(prompt="Sum:", max_tokens=30, extra_body={"guided_grammar": SUM})),
            ("chat", dict(messages=MSGS, max_tokens=24)),
            ("cmpl", dict(prompt="A cat:", max_tokens=100, extra_body={"guided_json": CAT})),
            ("cmpl", dict(prompt="Is it?", max_tokens=8, extra_body={"guided_choice": ["yes", "no"]})),
            ("cmpl", dict(prompt="def f(x):", max_tokens=40))]

    def run(kind, kw):
        if kind == "chat":
            return client.chat.completions.create(model=name, temperature=0, **kw).choices[0].message.content
        return client.completions.create(model=name, temperature=0, **kw).choices[0].text

    alone = [run(*j) for j in jobs]
    steps = []
    masks = srv.engine.masks
    constrain = masks.constrain

    def spy(logits, rows, matchers):
        steps.append((len(rows), logits.shape[0]))
        return constrain(logits, rows, matchers)

    masks.constrain = spy
    try:
        together = [None] * len(jobs)
        threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, run(*jobs[i])))
                   for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        masks.constrain = constrain
    assert together == alone
    assert any(1 < r < n for r, n in steps), steps  # several constrained rows beside unconstrained ones


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("extra, param, words", [
    ({"guided_regex": "(["}, "guided_regex", "invalid regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "invalid grammar"),
    ({"guided_json": {"type": "no-such-type"}}, "guided_json", "invalid JSON schema"),
    ({"guided_json": "{not json"}, "guided_json", "invalid JSON schema"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, None, "at most one"),
])
def test_completion_400s(server, client, extra, param, words):
    srv, model, tok, name = server
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=name, prompt="x", max_tokens=3, extra_body=extra)
    err = e.value.body
    assert words in err["message"] and err["param"] == param, err
    assert "Traceback" not in err["message"]


@pytest.mark.parametrize("kw, words", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "needs json_schema.schema"),
    (dict(response_format={"type": "json_schema"}), "needs json_schema.schema"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}), "at most one"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}),
     "invalid JSON schema"),
    (dict(response_format={"type": "yaml"}), "response_format"),
])
def test_chat_400s(server, client, kw, words):
    srv, model, tok, name = server
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=name, messages=MSGS, max_tokens=3, **kw)
    assert words in e.value.body["message"], e.value.body


def test_without_llguidance_a_400_says_so(server, client, monkeypatch):
    """The server works without the package; asking for structured output is then a 400."""
    srv, model, tok, name = server
    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` raises ImportError
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=name, prompt="x", max_tokens=3, extra_body={"guided_regex": "[a-c]{3}"})
    assert "llguidance" in e.value.body["message"] and "pip install" in e.value.body["message"]
    assert client.completions.create(model=name, prompt="x", max_tokens=3).choices[0].finish_reason


def test_a_tokenizer_llguidance_cannot_take_is_a_400(tmp_path):
    """A model with the byte-level fallback tokenizer (no tokenizer files; not a Hugging Face fast
    tokenizer): a 400 naming the tokenizer; plain requests still work."""
    make_model("orthros", window=8).save_pretrained(tmp_path)  # vocabulary 256: `ByteTokenizer`
    srv, model, tok, name = start_server(tmp_path)
    try:
        c = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=name, prompt="x", max_tokens=3, extra_body={"guided_regex": "[a-c]{3}"})
        assert "ByteTokenizer" in e.value.body["message"], e.value.body
        assert c.completions.create(model=name, prompt="x", max_tokens=3).choices[0].text is not None
    finally:
        srv.stop()


def test_no_tokenizer_is_a_value_error():
    from orthros.serve.structured import Grammars

    with pytest.raises(ValueError, match="tokenizer"):
        Grammars(None, 256).compile("regex", "a")



# ------------------------------------------------------------ forced tool calls
HERMES = ("{%- if tools %}<|im_start|>system\nYou may call: {{ tools | tojson }}. Write calls as "
          "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{%- endif %}"
          "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
          "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
SHORT = {"type": "string", "maxLength": 6}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["city"], "properties": {"city": SHORT}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["zone"],
             "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}]


@pytest.fixture(scope="module")
def tool_client(smol_dir, tmp_path_factory):
    d = with_chat_template(smol_dir, tmp_path_factory.mktemp("tools") / "model", HERMES)
    srv, model, tok, name = start_server(d, max_model_len=1024)
    yield openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=120), name
    srv.stop()


def test_tool_choice_required_and_named_force_valid_calls(tool_client):
    """tool_choice "required": the answer is one call or more, each of a given function with
    arguments valid under its schema; a named function: one call of it. Without the constraint
    the random model writes no call."""
    c, name = tool_client
    msgs = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
    kw = dict(model=name, messages=msgs, tools=TOOLS, max_tokens=120, temperature=0)
    assert not c.chat.completions.create(**kw).choices[0].message.tool_calls  # auto: no call from this model
    for choice, parallel in (("required", True), ("required", False),
                             ({"type": "function", "function": {"name": "get_time"}}, True)):
        r = c.chat.completions.create(**kw, tool_choice=choice, parallel_tool_calls=parallel)
        ch = r.choices[0]
        calls = ch.message.tool_calls
        assert ch.finish_reason == "tool_calls" and calls, ch
        assert parallel or len(calls) == 1
        for call in calls:
            args = json.loads(call.function.arguments)
            if call.function.name == "get_weather":
                assert set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 6
            else:
                assert call.function.name == "get_time" and args == {"zone": args["zone"]} and args["zone"] in ("UTC", "CET")
        if isinstance(choice, dict):
            assert [x.function.name for x in calls] == ["get_time"]
    with pytest.raises(openai.BadRequestError, match="cannot be combined with response_format"):
        c.chat.completions.create(**kw, tool_choice="required", response_format={"type": "json_object"})
