"""OpenAI API schemas: request models (validated by pydantic) and response builders.

Requests follow the OpenAI completions / chat completions APIs (penalties and
`logit_bias` included); beside them a few fields that vLLM and SGLang also take
(`top_k`, `stop_token_ids`, `ignore_eos`, `min_tokens`, `return_token_ids`, and vLLM's structured-output
options `guided_json`, `guided_regex`, `guided_grammar`, `guided_choice`; chat also takes OpenAI's
`response_format`). Unknown fields are errors,
so a misspelt parameter is a 400 rather than silently ignored. Responses are
plain dicts in the OpenAI shapes (what the official client parses).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias
    user: str | None = None
    return_token_ids: bool = False
    # structured output, vLLM's names (`serve.structured`): at most one of them
    guided_json: dict | str | None = None  # a JSON schema (or its text)
    guided_regex: str | None = None
    guided_grammar: str | None = None  # Lark, as llguidance reads it
    guided_choice: list[str] | None = None

    @model_validator(mode="after")
    def _supported(self):
        self.token_bias()  # keys are token ids
        guided = [k for k in GUIDED if getattr(self, k) is not None]
        if len(guided) > 1:
            raise ValueError(f"give at most one structured-output option, got {', '.join(guided)}")
        stops = self.stop_strings()
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream=true")
        return self

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with int keys (OpenAI sends them as strings); SamplingParams checks the ranges."""
        if not self.logit_bias:
            return None
        try:
            return {int(k): float(v) for k, v in self.logit_bias.items()}
        except ValueError:
            raise ValueError(f"logit_bias keys are token ids, got {list(self.logit_bias)}") from None

    def top_k_value(self) -> int | None:
        return None if self.top_k in (None, -1, 0) else self.top_k

    def guide_option(self) -> tuple[str, str, object] | None:
        """The structured output asked for: (the field's name, llguidance's format, the spec), or None."""
        for k, kind in GUIDED.items():
            if getattr(self, k) is not None:
                return k, kind, getattr(self, k)
        return None


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "lark", "guided_choice": "choice"}


# Token ids first, and strict (no "5" or 5.0 taken as 5): a 128K-token prompt is then checked in about
# a millisecond; pydantic's smart union tried every member (15-25 ms) with the engine's thread waiting
# for the GIL, which every running stream felt as a late token.
Prompt = Annotated[list[StrictInt] | str | list[str] | list[list[StrictInt]], Field(union_mode="left_to_right")]


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _completion_supported(self):
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, self.n):
            raise ValueError("best_of is not supported (it must equal n)")
        p = self.prompt
        if not p or (isinstance(p, list) and not isinstance(p[0], int) and not all(p)):
            raise ValueError("prompt must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids (a list holds one kind: see `Prompt`)."""
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool fields: passed to the template as given
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: "text" (no constraint), "json_object" (any JSON object) or
    "json_schema" (`json_schema.schema`)."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _chat_supported(self):
        rf = self.response_format
        if rf is not None and rf.type == "json_schema" and (rf.json_schema is None or rf.json_schema.schema_ is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        if rf is not None and rf.type != "text" and super().guide_option() is not None:
            raise ValueError(f"give at most one structured-output option, got response_format and "
                             f"{super().guide_option()[0]}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.tool_choice is not None and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, dict):
            f = self.tool_choice.get("function")
            if self.tool_choice.get("type") != "function" or not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise ValueError('a named tool_choice is {"type": "function", "function": {"name": ...}}')
            if f["name"] not in {t.function.name for t in self.tools}:
                raise ValueError(f"tool_choice names function {f['name']!r}, which is not among the tools")
        if self.forces_tools() and self.guide_option() is not None:
            raise ValueError(f"tool_choice {'required' if self.tool_choice == 'required' else 'naming a function'} "
                             f"constrains the answer already: it cannot be combined with {self.guide_option()[0]}")
        return self

    def forces_tools(self) -> bool:
        """tool_choice "required" or a named function: the answer is constrained to tool calls."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, dict)

    def max_new(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def guide_option(self) -> tuple[str, str, object] | None:
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            return "response_format", "json", {"type": "object"}
        if rf is not None and rf.type == "json_schema":
            return "response_format", "json", rf.json_schema.schema_
        return super().guide_option()


# ------------------------------------------------------------------ responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u


def error_body(message: str, type_: str, code: str | int | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def completion_logprobs(tokens: list[str], logprobs: list[float], tops: list[dict[str, float] | None],
                        offset0: int, texts: list[str]) -> dict:
    """The completions API's `logprobs` object for a run of tokens."""
    offsets, o = [], offset0
    for t in texts:
        offsets.append(o)
        o += len(t)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops if any(t is not None for t in tops)
            else None, "text_offset": offsets}


def chat_logprobs(tokens: list[str], logprobs: list[float], tops: list[list[tuple[str, float]] | None]) -> dict:
    """The chat API's `logprobs` object ({"content": [...]}) for a run of tokens."""
    def entry(tok, lp):
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in (top or [])]}
                        for t, lp, top in zip(tokens, logprobs, tops)]}
