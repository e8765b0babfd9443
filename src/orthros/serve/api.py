"""The OpenAI-compatible HTTP API on FastAPI, in front of an `Engine`.

    POST /v1/completions        text or token-id prompts (one or several), n choices each
    POST /v1/chat/completions   messages through the tokenizer's chat template
    GET  /v1/models             the served model
    GET  /health                200 while the engine runs, 503 once it has died
    GET  /metrics               Prometheus text format

Streaming responses are server-sent events (`data: {json}` chunks, then
`data: [DONE]`). Errors are OpenAI-style JSON bodies
`{"error": {"message", "type", "param", "code"}}`: 400 for a malformed
request or a prompt + max_tokens over the context, 404 for another model
name, 503 when the queue is full or the engine has died. A client that goes
away has its requests aborted; their KV blocks are freed at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json

# This module is the HTTP layer itself: FastAPI is imported here, and this module only
# where a server is built (`orthros serve`, tests), never by the engine or the model.
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .engine import Engine
from .outputs import ChoiceOutput, decode
from .protocol import (ChatCompletionRequest, CompletionRequest, chat_logprobs, completion_logprobs, error_body,
                       new_id, now, usage)
from .request import EngineDead, QueueFull, SamplingParams
from .structured import Grammars
from .tools import call_grammar, detect as detect_tools, openai_calls, parse as parse_tools


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code=None, param=None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param


class Job:
    """The engine requests of one API call (prompts x n) and their outputs."""

    def __init__(self, engine: Engine, tokenizer, prompts: list[list[int]], params: list[SamplingParams],
                 stops: list[str]):
        self.engine, self.prompts, self.params = engine, prompts, params
        n = len(params) // len(prompts)
        self.prompt_of = [i // n for i in range(len(params))]
        self.outputs = [ChoiceOutput(tokenizer, stops) for _ in params]
        self.requests = []
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()

    def submit(self) -> None:
        try:
            for i, p in enumerate(self.params):
                sink = self._sink(i)
                self.requests.append(self.engine.submit(self.prompts[self.prompt_of[i]], p, sink))
        except QueueFull as e:
            self.abort()
            raise ApiError(503, f"the server is busy: {e}; retry later", "server_error", "queue_full") from e
        except EngineDead as e:
            self.abort()
            raise ApiError(503, f"the engine has stopped: {e}", "server_error", "engine_dead") from e
        except ValueError as e:
            self.abort()
            code = "context_length_exceeded" if "context" in str(e) or "KV cache" in str(e) else None
            raise ApiError(400, str(e), code=code) from e

    def _sink(self, i: int):
        def put(ev):
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens any more
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (i, ev))
        return put

    def abort(self) -> None:
        """Abort every engine request not finished yet."""
        for i, r in enumerate(self.requests):
            if not r.finished:
                self.engine.abort(r.id)

    @property
    def done(self) -> bool:
        return all(o.finished for o in self.outputs)

    async def next(self) -> int:
        """Wait for one engine event, apply it; return its choice index."""
        i, ev = await self.queue.get()
        if self.outputs[i].add(ev):  # a stop string: the engine request ends here
            self.engine.abort(self.requests[i].id)
        return i

    def cached_tokens(self) -> int:
        return sum(r.cached_tokens for r in self.requests[:: max(1, len(self.params) // len(self.prompts))])

    def usage(self) -> dict:
        return usage(sum(len(p) for p in self.prompts), sum(len(o.token_ids) for o in self.outputs),
                     self.cached_tokens())


def create_app(engine: Engine, tokenizer, model_name: str, metrics=None, api_key: str | None = None,
               tool_parser: str = "auto"):
    """The FastAPI app serving `engine` (started / stopped with the app). With `api_key`, every
    /v1 request must carry `Authorization: Bearer <api_key>` (a 401 otherwise, as the OpenAI API
    answers); /health and /metrics stay open for probes and scrapers. `tool_parser`: how tool
    calls are read from chat answers (`serve.tools`; "auto": the one the chat template implies)."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        if engine._thread is None:
            engine.start()
        yield
        engine.stop()

    app = FastAPI(title="orthros", lifespan=lifespan)
    app.state.engine = engine
    grammars = Grammars(tokenizer, engine.model.config.vocab_size, engine.eos)

    def error(status: int, message: str, type_: str, code=None, param=None):
        if metrics:
            metrics.rejected.labels(str(code or status)).inc()
        return JSONResponse(error_body(message, type_, code, param), status_code=status)

    if api_key is not None:
        if not api_key:
            raise ValueError("--api-key: the key is empty")
        want = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def _auth(request: Request, call_next):
            if request.url.path.startswith("/v1"):
                got = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(got, want):
                    return error(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                                 "invalid_request_error", "invalid_api_key")
            return await call_next(request)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error(e.status, e.message, e.type, e.code, e.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        errs = e.errors()
        parts = []
        for err in errs:
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        param = ".".join(str(x) for x in errs[0].get("loc", ())[1:2]) if errs else None
        return error(400, "; ".join(parts) or "malformed request", "invalid_request_error", None, param or None)

    # ------------------------------------------------------------- helpers
    def check_model(name: str):
        if name != model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           code="model_not_found", param="model")

    def encode(text: str) -> list[int]:
        if tokenizer is None:
            raise ApiError(400, "this server has no tokenizer: send the prompt as token ids", param="prompt")
        from ..data.tokenizer import encode as enc

        return enc(tokenizer, text)

    def top_dict(top: list[tuple[int, float]]) -> dict[str, float]:
        """{token text: logprob}; tokens that decode alike keep the higher value (listed first)."""
        d: dict[str, float] = {}
        for a, b in top:
            d.setdefault(decode(tokenizer, [a]), b)
        return d

    async def guide_of(body):
        """The request's compiled grammar (`serve.structured`), or None; compiled off the event loop."""
        opt = body.guide_option()
        if opt is None:
            return None
        field, kind, spec = opt
        try:
            return await asyncio.to_thread(grammars.compile, kind, spec)
        except ValueError as e:
            raise ApiError(400, str(e), param=field) from e

    def sampling(body, prompt_len: int, max_new: int | None, logprobs: int | None, seed_offset: int, guide):
        max_tokens = max_new if max_new is not None else engine.max_model_len - prompt_len
        try:
            return SamplingParams(
                max_tokens=max(1, max_tokens), temperature=body.temperature,
                top_p=None if body.top_p >= 1 else body.top_p, top_k=body.top_k_value(),
                seed=None if body.seed is None else body.seed + seed_offset,
                stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
                min_tokens=body.min_tokens, logprobs=logprobs, presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty, logit_bias=body.token_bias(), guide=guide)
        except ValueError as e:
            raise ApiError(400, str(e)) from e

    def make_job(body, prompts: list[list[int]], max_new, logprobs, guide=None) -> Job:
        for p in prompts:
            if not p:
                raise ApiError(400, "the prompt is empty", param="prompt")
            want = len(p) + (max_new if max_new is not None else 1)
            if want > engine.max_model_len:
                raise ApiError(400, f"this model's maximum context length is {engine.max_model_len} tokens; the "
                               f"request asks for {want} ({len(p)} in the prompt, {want - len(p)} to generate)",
                               code="context_length_exceeded", param="max_tokens")
        params = [sampling(body, len(p), max_new, logprobs, j, guide) for p in prompts for j in range(body.n)]
        job = Job(engine, tokenizer, prompts, params, body.stop_strings())
        job.submit()
        return job

    async def collect(job: Job, request: Request) -> None:
        """Run a non-streaming job to its end; abort it if the client goes away."""
        async def watch():
            while True:
                if await request.is_disconnected():
                    job.abort()
                    return
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        try:
            while not job.done:
                await job.next()
        finally:
            watcher.cancel()
            job.abort()
        errors = [o.error for o in job.outputs if o.finish_reason == "error"]
        if errors:  # the engine died, or (alive) one request failed alone
            if engine.alive:
                raise ApiError(500, errors[0], "server_error")
            raise ApiError(503, errors[0], "server_error", "engine_dead")

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    def stream(job: Job, body, chunk_fn, first_fn=None):
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)

        async def gen():
            try:
                if first_fn is not None:
                    for i in range(len(job.outputs)):
                        yield sse(first_fn(i))
                while not job.done:
                    i = await job.next()
                    out = job.outputs[i]
                    if out.finish_reason == "error":
                        yield sse(error_body(out.error or "the engine failed", "server_error",
                                             None if engine.alive else "engine_dead"))
                        return
                    text, t0, t1 = out.take_delta()
                    if not text and t0 == t1 and not out.finished:
                        continue
                    chunk = chunk_fn(i, out, text, t0, t1)
                    if chunk is None:  # held back (an answer that may be a tool call: sent whole at its end)
                        continue
                    chunk["usage"] = job.usage() if continuous else None
                    yield sse(chunk)
                if include_usage:
                    yield sse({**chunk_fn(None, None, "", 0, 0), "choices": [], "usage": job.usage()})
                yield "data: [DONE]\n\n"
            finally:  # normal end, or the client went away (the generator is closed)
                job.abort()

        return StreamingResponse(gen(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ------------------------------------------------------------ endpoints
    @app.get("/health")
    async def health():
        if not engine.alive:
            return error(503, f"the engine has stopped: {engine.error!r}", "server_error", "engine_dead")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_endpoint():
        from prometheus_client import CONTENT_TYPE_LATEST

        if metrics is None:
            raise ApiError(404, "metrics are off", code="not_found")
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": now(),
                                            "owned_by": "orthros", "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        prompts = [encode(p) if isinstance(p, str) else list(p) for p in body.prompts()]
        job = make_job(body, prompts, body.max_tokens, body.logprobs, await guide_of(body))
        rid, created = new_id("cmpl"), now()

        def logprobs_of(out, t0, t1, offset0):
            if body.logprobs is None:
                return None
            texts = [out.token_text(j) for j in range(t0, t1)]
            tops = [None if out.top_logprobs[j] is None else top_dict(out.top_logprobs[j]) for j in range(t0, t1)]
            return completion_logprobs(texts, out.logprobs[t0:t1], tops, offset0, texts)

        def choice(i, out, text, t0, t1, offset0=0):
            c = {"index": i, "text": text, "logprobs": logprobs_of(out, t0, t1, offset0),
                 "finish_reason": out.finish_reason if out.finished else None}
            if body.return_token_ids:
                c["token_ids"] = out.token_ids[t0:t1]
                if t0 == 0:
                    c["prompt_token_ids"] = job.prompts[job.prompt_of[i]]
            return c

        def chunk(i, out, text, t0, t1):
            choices = [] if out is None else [choice(i, out, text, t0, t1, out.sent_chars - len(text))]
            return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": choices}

        if body.stream:
            return stream(job, body, chunk)
        await collect(job, request)
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                "choices": [choice(i, o, o.text, 0, len(o.token_ids)) for i, o in enumerate(job.outputs)],
                "usage": job.usage()}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, "this model has no chat template: use /v1/completions", param="messages")
        msgs = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None

        def render(**kw):
            try:
                return tokenizer.apply_chat_template(msgs, tokenize=False,
                                                     add_generation_prompt=body.add_generation_prompt, **kw)
            except Exception as e:  # noqa: BLE001 - a template that rejects these messages
                raise ApiError(400, f"the chat template failed on these messages: {e}", param="messages") from e

        text = render(tools=tools) if tools else render()
        parser = None
        if tools:
            if text == render():
                raise ApiError(400, "this model's chat template does not take tools", param="tools")
            if body.tool_choice != "none":
                parser = detect_tools(tokenizer.chat_template) if tool_parser == "auto" else tool_parser
                if parser is None:
                    raise ApiError(400, "this model's chat template shows no tool-call format: start the server "
                                   "with --tool-call-parser hermes|llama3_json", param="tools")
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        top = (body.top_logprobs or 0) if body.logprobs else None
        if body.forces_tools():  # the answer is the calls, in the format the parser reads
            spec = call_grammar(parser, tools, body.tool_choice, body.parallel_tool_calls is not False)
            try:
                guide = await asyncio.to_thread(grammars.compile, "lark", spec)
            except ValueError as e:
                raise ApiError(400, str(e), param="tool_choice") from e
        else:
            guide = await guide_of(body)
        job = make_job(body, [prompt], body.max_new(), top, guide)
        rid, created = new_id("chatcmpl"), now()

        def logprobs_of(out, t0, t1):
            if not body.logprobs:
                return None
            tops = [None if out.top_logprobs[j] is None else
                    [(decode(tokenizer, [a]), b) for a, b in out.top_logprobs[j]] for j in range(t0, t1)]
            return chat_logprobs([out.token_text(j) for j in range(t0, t1)], out.logprobs[t0:t1], tops)

        def extra(c, out, t0, t1):
            if body.return_token_ids:
                c["token_ids"] = out.token_ids[t0:t1]
            return c

        def message(o) -> tuple[dict, str | None]:
            """The answer's message and finish reason, its tool calls parsed out."""
            if parser is None:
                return {"role": "assistant", "content": o.text}, o.finish_reason
            content, calls = parse_tools(parser, o.text)
            if not calls:
                return {"role": "assistant", "content": o.text}, o.finish_reason
            return ({"role": "assistant", "content": content, "tool_calls": openai_calls(calls)},
                    "tool_calls" if o.finish_reason == "stop" else o.finish_reason)

        def chunk(i, out, text, t0, t1):
            if out is not None and parser is not None:  # the whole answer at its end: it may be a call
                if not out.finished:
                    return None
                msg, reason = message(out)
                delta = {k: v for k, v in msg.items() if k != "role" and v is not None}
                if "tool_calls" in delta:
                    delta["tool_calls"] = [{"index": j, **c} for j, c in enumerate(delta["tool_calls"])]
                choices = [extra({"index": i, "delta": delta, "logprobs": logprobs_of(out, 0, len(out.token_ids)),
                                  "finish_reason": reason}, out, 0, len(out.token_ids))]
            else:
                choices = [] if out is None else [extra(
                    {"index": i, "delta": {"content": text} if text else {}, "logprobs": logprobs_of(out, t0, t1),
                     "finish_reason": out.finish_reason if out.finished else None}, out, t0, t1)]
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": choices}

        def first(i):
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}], "usage": None}

        if body.stream:
            return stream(job, body, chunk, first)
        await collect(job, request)
        choices = []
        for i, o in enumerate(job.outputs):
            msg, reason = message(o)
            choices.append(extra({"index": i, "message": msg, "logprobs": logprobs_of(o, 0, len(o.token_ids)),
                                  "finish_reason": reason}, o, 0, len(o.token_ids)))
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": choices, "usage": job.usage()}

    return app
