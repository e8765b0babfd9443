"""Tool calling: tools into the chat template, calls out of the answer (`serve.tools`), and the
chat API returning them as `tool_calls` (streamed and not) through the official `openai` client."""

import json

import pytest

from orthros.serve.tools import detect, parse

from .conftest import start_server, with_chat_template

openai = pytest.importorskip("openai")

HERMES = ("{%- if tools %}<|system|>You may call: {{ tools | tojson }}. Write calls as "
          "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>\n{%- endif %}"
          "{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{%- endfor %}"
          "{%- if add_generation_prompt %}<|assistant|>{%- endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_hermes_calls_are_read_and_anything_else_stays_text():
    one = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert parse("hermes", one) == (None, [{"name": "f", "arguments": {"x": 1}}])
    two = 'Sure. <tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": "{\\"y\\": 2}"}</tool_call>'
    assert parse("hermes", two) == ("Sure.", [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"y": 2}}])
    for text in ("no call here", "<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>'):
        assert parse("hermes", text) == (text, [])


def test_llama3_json_calls():
    assert parse("llama3_json", '{"name": "f", "parameters": {"x": 1}}') == (None, [{"name": "f", "arguments": {"x": 1}}])
    assert parse("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}')[1] \
        == [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]
    assert parse("llama3_json", '{"name": "q", "parameters": {"sql": "a; b"}}') == (None, [{"name": "q", "arguments": {"sql": "a; b"}}])
    for text in ("The answer is 4.", '{"x": 1}', '{"name": "f"} trailing', ""):
        assert parse("llama3_json", text) == (text, [])
    assert detect(HERMES) == "hermes" and detect("{{ messages }}") is None
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        parse("xml", "")


@pytest.fixture(scope="module")
def tool_server(model_dir, tmp_path_factory):
    d = with_chat_template(model_dir, tmp_path_factory.mktemp("tools") / "model", HERMES)
    srv, model, tok, name = start_server(d, max_model_len=1536)  # the tools' JSON makes long prompts
    yield srv, tok, name
    srv.stop()


def scripted(monkeypatch, tok, text):
    """The engine answers `text` (then end-of-sequence), whatever the model would have said."""
    import orthros.serve.engine as engine_mod
    from orthros.serve.request import TokenEvent

    script = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    state = {}  # per request (each has its own SamplingParams, held here so its id stays its own): tokens sent

    def fake(logits, greedy, params, generator, output=(), masked=None):
        i = state.get(id(params), (params, -1))[1] + 1
        state[id(params)] = (params, i)
        return TokenEvent(script[i])

    monkeypatch.setattr(engine_mod, "sample_event", fake)
    return state


def test_chat_returns_tool_calls(tool_server, monkeypatch):
    srv, tok, name = tool_server
    c = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    scripted(monkeypatch, tok, 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    r = c.chat.completions.create(model=name, messages=msgs, tools=[WEATHER], max_tokens=300)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Let me check."
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"} and call.id.startswith("call_")
    # streamed: the answer comes whole at its end, the call as a delta
    calls, reasons = [], []
    for chunk in c.chat.completions.create(model=name, messages=msgs, tools=[WEATHER], max_tokens=300, stream=True):
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            reasons.append(choice.finish_reason)
    assert [t.function.name for t in calls] == ["get_weather"] and reasons[-1] == "tool_calls"
    # the call and the tool's answer go back into the template as given
    follow = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    scripted(monkeypatch, tok, "It is sunny.")
    r = c.chat.completions.create(model=name, messages=follow, tools=[WEATHER], max_tokens=40)
    assert r.choices[0].message.content == "It is sunny." and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_tool_choice_and_templates_without_tools(tool_server, server, monkeypatch):
    srv, tok, name = tool_server
    c = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    scripted(monkeypatch, tok, '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>')
    r = c.chat.completions.create(model=name, messages=msgs, tools=[WEATHER], tool_choice="none", max_tokens=40)
    assert not r.choices[0].message.tool_calls and "<tool_call>" in r.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        c.chat.completions.create(model=name, messages=msgs, tools=[WEATHER],
                                  tool_choice={"type": "function", "function": {"name": "x"}})
    with pytest.raises(openai.BadRequestError, match="a named tool_choice is"):
        c.chat.completions.create(model=name, messages=msgs, tools=[WEATHER], tool_choice={"name": "get_weather"})
    with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
        c.chat.completions.create(model=name, messages=msgs, tool_choice="auto")
    plain_srv, _, _, plain_name = server  # the test model's own template has no tools
    plain = openai.OpenAI(base_url=plain_srv.url, api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="does not take tools"):
        plain.chat.completions.create(model=plain_name, messages=msgs, tools=[WEATHER])
