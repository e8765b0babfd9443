"""Tool calls: the request's `tools` go into the model's chat template; calls come back out of the
generated text, in the format the model was trained to write them (a parser per format, as vLLM's
`--tool-call-parser`):

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block per call
                 (Qwen2.5 / Qwen3, Hermes, SmolLM3 templates)
    llama3_json  the whole answer is {"name": ..., "parameters": {...}} (optionally after
                 <|python_tag|>; several joined by ';'), Llama 3.1+

`detect(template)` picks the parser a chat template's text implies. A call that is not valid JSON
with a string `name` stays text: nothing is invented.
"""

from __future__ import annotations

import json
import re
import uuid

PARSERS = ("hermes", "llama3_json")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def call_grammar(parser: str, tools: list[dict], tool_choice, parallel: bool = True) -> str:
    """A grammar (Lark, as llguidance reads it, JSON schemas inline) whose sentences are exactly the
    calls `parse(parser, ...)` reads, each of a function among `tools` with arguments valid under its
    `parameters` schema: for tool_choice "required" one call or more (one if not `parallel`), for a
    named function ({"type": "function", "function": {"name": ...}}) one call of it. The JSON is
    written without free whitespace (as `structured.JSON_STYLE`)."""
    if parser not in PARSERS:
        raise ValueError(f"unknown tool-call parser {parser!r}; choose from {', '.join(PARSERS)}")
    if isinstance(tool_choice, dict):
        tools = [t for t in tools if t["function"]["name"] == tool_choice["function"]["name"]]
        parallel = False
    key = "arguments" if parser == "hermes" else "parameters"
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", key],
              "properties": {"name": {"const": t["function"]["name"]},
                             key: t["function"].get("parameters") or {"type": "object"}}} for t in tools]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}),
              "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    body = "%json " + json.dumps(schema)
    call, sep = (f'"<tool_call>\\n" {body} "\\n</tool_call>"', '"\\n"') if parser == "hermes" else (body, '"; "')
    return f"start: call{f' ({sep} call)*' if parallel else ''}\ncall: {call}\n"


def detect(template: str | None) -> str | None:
    """The parser a chat template implies, or None (it shows no tool-call format)."""
    t = template or ""
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json"
    return None


def _call(obj) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return {"name": obj["name"], "arguments": args}


def parse(parser: str, text: str) -> tuple[str | None, list[dict]]:
    """(the text that is not a call, or None; the calls [{name, arguments}]) of a generated answer."""
    if parser == "hermes":
        calls, rest = [], text
        for m in _HERMES.finditer(text):
            try:
                call = _call(json.loads(m.group(1)))
            except ValueError:
                call = None
            if call is not None:
                calls.append(call)
                rest = rest.replace(m.group(0), "", 1)
        rest = rest.strip()
        return (rest or None) if calls else text, calls
    if parser == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        calls, i, dec = [], 0, json.JSONDecoder()
        while i < len(body):  # JSON objects separated by ';' (a ';' inside a string is the string's)
            try:
                obj, i = dec.raw_decode(body, i)
            except ValueError:
                return text, []
            call = _call(obj)
            if call is None:
                return text, []
            calls.append(call)
            while i < len(body) and body[i] in "; \n\t":
                i += 1
        return (None, calls) if calls else (text, [])
    raise ValueError(f"unknown tool-call parser {parser!r}; one of {', '.join(PARSERS)}")


def openai_calls(calls: list[dict]) -> list[dict]:
    """The calls as the OpenAI API returns them (`arguments` a JSON string)."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for c in calls]
