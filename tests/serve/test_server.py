"""A real server on localhost driven by the official `openai` client (max_retries=0):
completions, chat, streaming, stop, n, logprobs, seed, usage, every error path, client
disconnects, a full queue, a dead engine, concurrent streams and a bounded load test."""

import asyncio
import json
import random
import threading
import time

import httpx
import pytest

from .conftest import reference, start_server

openai = pytest.importorskip("openai")


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def wait_for(cond, timeout=20.0):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            return False
        time.sleep(0.02)
    return True


def test_models_health_and_metrics(server, client):
    srv, _, _, name = server
    assert [m.id for m in client.models.list().data] == [name]
    assert httpx.get(srv.base + "/health").json() == {"status": "ok"}
    client.completions.create(model=name, prompt="x = 1", max_tokens=3, temperature=0)
    text = httpx.get(srv.base + "/metrics").text
    for metric in ("orthros_time_to_first_token_seconds_count", "orthros_inter_token_latency_seconds_bucket",
                   "orthros_num_requests_waiting", "orthros_kv_blocks_used", "orthros_kv_blocks_total 512.0",
                   "orthros_e2e_request_latency_seconds_count"):
        assert metric in text, metric
    ttft = next(line for line in text.splitlines() if line.startswith("orthros_time_to_first_token_seconds_count"))
    assert float(ttft.split()[-1]) >= 1
    value = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("orthros_")}
    pool = srv.engine.pool  # K and V of every layer for the 512 blocks and the scratch block, fp32
    cfg = srv.engine.model.config
    assert value["orthros_kv_pool_bytes"] == 2 * cfg.num_hidden_layers * 513 * 4 * cfg.num_key_value_heads \
        * cfg.head_dim * 4 == pool.memory_bytes
    assert value["orthros_max_model_len"] == 256
    assert (value["orthros_device_memory_peak_bytes"] > 0) == (srv.engine.device.type == "cuda")
    # the request is over and the engine idle: the gauges say so (not the state before its last step)
    assert value["orthros_num_requests_running"] == value["orthros_num_requests_waiting"] == 0
    assert value["orthros_kv_blocks_used"] == srv.engine.blocks.num_used == 0


def test_completion_equals_generate(server, client):
    srv, model, tok, name = server
    prompt = "def main():\n    return"
    r = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True})
    ids = encode(tok, prompt)
    ref = reference(model, tok, ids, 12)
    c = r.choices[0]
    assert c.model_extra["token_ids"] == ref
    assert c.text == tok.decode(ref, skip_special_tokens=True)
    assert c.finish_reason == ("stop" if ref[-1] == tok.eos_token_id else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), len(ref),
                                                                                        len(ids) + len(ref))
    again = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0)
    assert again.choices[0].text == c.text
    assert again.usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // 4 * 4  # full blocks of 4, reused
    # token-id prompts, several at once
    r2 = client.completions.create(model=name, prompt=[ids, ids[:5]], max_tokens=4, temperature=0)
    assert [c.text for c in r2.choices] == [tok.decode(reference(model, tok, p, 4), skip_special_tokens=True)
                                           for p in (ids, ids[:5])]


def test_chat_uses_the_template(server, client):
    srv, model, tok, name = server
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model=name, messages=msgs, max_tokens=10, temperature=0)
    ids = encode(tok, tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    ref = reference(model, tok, ids, 10)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref)
    chunks = list(client.chat.completions.create(model=name, messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_streaming_with_usage(server, client):
    srv, model, tok, name = server
    kw = dict(model=name, prompt="import os\n", max_tokens=12, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert "".join(c.choices[0].text for c in chunks[:-1]) == full.choices[0].text
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason
    # the raw wire format: data: {json} events, then data: [DONE]
    with httpx.stream("POST", srv.url + "/completions", json={**kw, "stream": True}) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: {") for line in lines[:-1])
    assert json.loads(lines[0][6:])["object"] == "text_completion"


def test_stop_strings_and_stop_token_ids(server, client):
    srv, model, tok, name = server
    prompt = "class A:\n"
    ids = encode(tok, prompt)
    ref = reference(model, tok, ids, 16)
    text = tok.decode(ref, skip_special_tokens=True)
    assert len(text) >= 6, text
    stop = text[3:5]
    want = text[: text.index(stop)]
    kw = dict(model=name, prompt=prompt, max_tokens=16, temperature=0, stop=[stop, "\x00never"])
    r = client.completions.create(**kw)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "stop"
    r = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0,
                                  extra_body={"stop_token_ids": [ref[2]], "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == ref[: ref.index(ref[2]) + 1]
    assert r.choices[0].finish_reason == "stop"


def test_n_seed_and_logprobs(server, client):
    srv, model, tok, name = server
    kw = dict(model=name, prompt="for i in", max_tokens=8, temperature=1.0, seed=11, n=3,
              extra_body={"return_token_ids": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert len(a.choices) == 3 and [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # the choices differ from each other
    assert a.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in a.choices)
    assert a.usage.prompt_tokens == len(encode(tok, "for i in"))  # the prompt counts once
    r = client.completions.create(model=name, prompt="for i in", max_tokens=6, temperature=0, logprobs=2,
                                  extra_body={"return_token_ids": True})
    lp = r.choices[0].logprobs
    n = len(r.choices[0].model_extra["token_ids"])
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(max(t.values()) == pytest.approx(v, abs=1e-5) for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    c = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in content)


def test_penalties_and_logit_bias_as_vllm_applies_them(server, client):
    """presence / frequency penalties over the request's own output and logit_bias, greedy: the
    tokens of a plain loop that applies them to the model's logits; out-of-range values are 400s."""
    import torch

    srv, model, tok, name = server
    ids = encode(tok, "def f(x):\n    return")
    V = model.config.vocab_size

    def ref(n, presence=0.0, frequency=0.0, bias=None):
        seq, out = list(ids), []
        for _ in range(n):
            with torch.no_grad():
                logits = model(torch.tensor([seq])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=V)[:V]
            logits = logits - frequency * counts - presence * (counts > 0)
            for t, b in (bias or {}).items():
                logits[t] += b
            out.append(int(logits.argmax()))
            seq.append(out[-1])
        return out

    def served(**kw):
        r = client.completions.create(model=name, prompt=ids, max_tokens=12, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True}, **kw)
        return r.choices[0].model_extra["token_ids"]

    plain = served()
    assert plain == ref(12)
    changed = 0
    for kw in (dict(frequency_penalty=1.5), dict(presence_penalty=2.0), dict(frequency_penalty=-2.0),
               dict(presence_penalty=-2.0, frequency_penalty=-2.0)):
        got = served(**kw)
        assert got == ref(12, kw.get("presence_penalty", 0.0), kw.get("frequency_penalty", 0.0)), kw
        changed += got != plain
    assert changed  # the penalties changed some answer: the comparison can tell
    forced = (plain[0] + 1) % V
    assert served(logit_bias={str(forced): 100}) == [forced] * 12
    banned = served(logit_bias={str(plain[0]): -100})
    assert banned == ref(12, bias={plain[0]: -100.0}) and plain[0] not in banned
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logit_bias={str(forced): 100}, presence_penalty=0.5)
    assert chat.choices[0].message.content is not None
    for kw in (dict(presence_penalty=2.5), dict(logit_bias={"x": 1}), dict(logit_bias={"5": 101}),
               dict(logit_bias={str(V): 1})):
        with pytest.raises(openai.BadRequestError):
            served(**kw)


def test_error_paths(server, client):
    srv, model, tok, name = server

    def check(exc, status, body_code=None):
        assert exc.value.status_code == status
        err = exc.value.response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        if body_code:
            assert err["code"] == body_code
        return err

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=name, prompt="x", max_tokens=300)
    assert check(e, 400, "context_length_exceeded")["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=name, prompt=[1] * 250, max_tokens=10)
    check(e, 400, "context_length_exceeded")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=name, prompt="x", temperature=5)
    assert "temperature" in check(e, 400)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=name, prompt="x", extra_body={"no_such_field": 1})
    check(e, 400)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=name, prompt=[1, 10**6], max_tokens=2)
    assert "token ids" in check(e, 400)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=name, messages=[], max_tokens=2)
    check(e, 400)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="other", prompt="x")
    check(e, 404, "model_not_found")
    for body in (b"{not json", b'{"model": "%s"}' % name.encode(), b'{"model": 1, "prompt": "x"}'):
        r = httpx.post(srv.url + "/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def _engine_idle(engine):
    return not engine.running and not engine.waiting and engine.blocks.num_used == 0


def test_disconnect_aborts_and_frees_blocks(server):
    srv, model, tok, name = server
    eng = srv.engine
    real = eng.runner.forward

    def slow(segments):  # >= 50 ms a step: 200 tokens take >= 10 s, an abort shows within 3
        time.sleep(0.05)
        return real(segments)

    eng.runner.forward = slow
    try:
        body = dict(model=name, prompt="while True:", max_tokens=200, temperature=0, stream=True, ignore_eos=True)
        with httpx.stream("POST", srv.url + "/completions", json=body) as resp:
            it = resp.iter_lines()
            got = [next(it) for _ in range(6)]
            assert any(line.startswith("data: {") for line in got)
            assert eng.running and eng.blocks.num_used > 0  # still generating
        assert wait_for(lambda: _engine_idle(eng), timeout=3), (eng.running, eng.blocks.num_used)
        # a non-streaming request whose client times out is aborted too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/completions", json={**body, "stream": False}, timeout=0.5)
        assert wait_for(lambda: _engine_idle(eng), timeout=3)
    finally:
        eng.runner.forward = real
    text = httpx.get(srv.base + "/metrics").text
    aborted = next(line for line in text.splitlines() if line.startswith('orthros_requests_total{finish_reason="abort"}'))
    assert float(aborted.split()[-1]) >= 2


def test_disconnect_mid_prefill_frees_its_blocks(server):
    """A long prompt, prefilled a 32-token chunk a step: the client leaves before its first token,
    and the request's blocks come back without it ever producing one."""
    srv, model, tok, name = server
    eng = srv.engine
    real, steps = eng.runner.forward, []

    def slow(segments):
        steps.append(len(segments))
        time.sleep(0.1)
        return real(segments)

    eng.runner.forward = slow
    try:
        body = dict(model=name, prompt=[5] * 230, max_tokens=4, temperature=0, stream=True)
        with httpx.stream("POST", srv.url + "/completions", json=body):
            assert wait_for(lambda: len(steps) >= 2 and eng.blocks.num_used > 0)  # chunks under way
            assert eng.running and eng.running[0].computed < 229  # not prefilled yet
        assert wait_for(lambda: _engine_idle(eng), timeout=3), (eng.running, eng.blocks.num_used)
    finally:
        eng.runner.forward = real


def test_a_burst_gets_503s_for_the_overflow_and_loses_no_accepted_request(model_dir):
    """64 long requests at once at a server with 4 seats and a queue of 8: the overflow gets 503
    (queue_full) at once, and every accepted request completes with its own greedy tokens."""
    srv, model, tok, name = start_server(model_dir, max_num_seqs=4, max_queue=8)
    prompts = [[(7 * i + j) % 250 + 3 for j in range(120 + i)] for i in range(64)]

    async def one(client, i):
        try:
            r = await client.post("/completions", json=dict(model=name, prompt=prompts[i], max_tokens=6,
                                                            temperature=0, return_token_ids=True))
        except httpx.HTTPError as e:  # a lost request: the test fails below
            return i, type(e).__name__, None
        body = r.json()
        return i, r.status_code, body["choices"][0]["token_ids"] if r.status_code == 200 else body["error"]["code"]

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    try:
        got = asyncio.run(main())
        codes = [c for _, c, _ in got]
        assert set(codes) <= {200, 503}, codes
        assert codes.count(200) >= 8 and codes.count(503) >= 1, codes  # the queue of 8 at least
        for i, code, out in got:
            if code == 503:
                assert out == "queue_full"
            else:
                assert out == reference(model, tok, prompts[i], 6), i
        assert wait_for(lambda: _engine_idle(srv.engine))
    finally:
        srv.stop()


def test_queue_full_is_503(model_dir):
    """One seat, a queue of one: with the engine held inside a step, a third request is refused."""
    srv, model, tok, name = start_server(model_dir, max_num_seqs=1, max_queue=1)
    gate, inside = threading.Event(), threading.Event()
    real = srv.engine.runner.forward

    def held(segments):
        inside.set()
        gate.wait(30)
        return real(segments)

    srv.engine.runner.forward = held
    try:
        body = dict(model=name, prompt="a", max_tokens=4, temperature=0, stream=True)
        with httpx.stream("POST", srv.url + "/completions", json=body) as first:
            assert inside.wait(20)  # the first request is running, its step held
            with httpx.stream("POST", srv.url + "/completions", json=body) as second:
                assert wait_for(lambda: len(srv.engine.waiting) == 1)  # queued
                c = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0)
                with pytest.raises(openai.InternalServerError) as e:
                    c.completions.create(model=name, prompt="b", max_tokens=2)
                assert e.value.status_code == 503
                assert e.value.response.json()["error"]["code"] == "queue_full"
                gate.set()
                assert [line for line in second.iter_lines() if line][-1] == "data: [DONE]"
            assert [line for line in first.iter_lines() if line][-1] == "data: [DONE]"
        assert wait_for(lambda: _engine_idle(srv.engine))
    finally:
        gate.set()
        srv.stop()


def test_api_key_guards_the_api(model_dir):
    """With a key, /v1 answers 401 (OpenAI's error body) without it or with another, and serves
    with it; /health and /metrics stay open."""
    srv, model, tok, name = start_server(model_dir, api_key="s3cret")
    try:
        for key in ("none", "s3cret-not"):
            c = openai.OpenAI(base_url=srv.url, api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError) as e:
                c.completions.create(model=name, prompt="a", max_tokens=2)
            assert e.value.status_code == 401 and e.value.response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/models").status_code == 401  # no header at all
        ok = openai.OpenAI(base_url=srv.url, api_key="s3cret", max_retries=0)
        assert ok.completions.create(model=name, prompt="a", max_tokens=2, temperature=0).choices[0].text is not None
        assert httpx.get(srv.base + "/health").status_code == 200
        assert httpx.get(srv.base + "/metrics").status_code == 200
    finally:
        srv.stop()


def test_open_access_warning():
    from orthros.serve.launch import open_access_warning

    for host in ("127.0.0.1", "localhost", "::1", "[::1]"):
        assert open_access_warning(host, None) is None
    for host in ("0.0.0.0", "::", "10.1.2.3", "my-host"):
        assert "without an API key" in open_access_warning(host, None)
        assert open_access_warning(host, "k") is None


def test_health_503_when_the_engine_died(model_dir):
    srv, model, tok, name = start_server(model_dir)
    try:
        def broken(segments):
            raise RuntimeError("device lost")

        srv.engine.runner.forward = broken
        c = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=name, prompt="x", max_tokens=3)
        assert e.value.status_code == 503 and "device lost" in e.value.response.json()["error"]["message"]
        r = httpx.get(srv.base + "/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        with pytest.raises(openai.InternalServerError) as e:  # new requests are refused
            c.completions.create(model=name, prompt="x", max_tokens=3)
        assert e.value.response.json()["error"]["code"] == "engine_dead"
    finally:
        srv.stop()


def _prompts(tok, n, seed):
    rng = random.Random(seed)
    words = ["def", "return", "import", "class", "self", "value", "for", "in", "if", "else", "(", ")", ":"]
    shared = " ".join(rng.choice(words) for _ in range(6))
    return [(shared if i % 3 == 0 else "") + " ".join(rng.choice(words) for _ in range(rng.randrange(1, 12)))
            for i in range(n)]


def test_16_concurrent_streaming_clients(server):
    srv, model, tok, name = server
    prompts = _prompts(tok, 16, 0)
    results = [None] * 16

    def worker(i):
        c = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=60)
        ids, text = [], ""
        for ch in c.completions.create(model=name, prompt=prompts[i], max_tokens=10, temperature=0, stream=True,
                                       extra_body={"return_token_ids": True}):
            ids += ch.choices[0].model_extra["token_ids"]
            text += ch.choices[0].text
        results[i] = (ids, text)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, p in enumerate(prompts):
        ref = reference(model, tok, encode(tok, p), 10)
        assert results[i] == (ref, tok.decode(ref, skip_special_tokens=True)), i


def test_bounded_load_nothing_lost_or_mixed(server):
    """60 requests (streaming and not, completions and chat, different lengths), at most 12 in
    flight: every one comes back once, whole, with its own prompt's tokens."""
    srv, model, tok, name = server
    prompts = _prompts(tok, 60, 1)
    lengths = [random.Random(i).randrange(1, 9) for i in range(60)]

    async def one(c, sem, i):
        async with sem:
            kw = dict(model=name, max_tokens=lengths[i], temperature=0, extra_body={"return_token_ids": True})
            if i % 4 == 3:
                kw["messages"] = [{"role": "user", "content": prompts[i]}]
                api = c.chat.completions
            else:
                kw["prompt"] = prompts[i]
                api = c.completions
            if i % 2:
                ids = []
                async for ch in await api.create(**kw, stream=True):
                    if ch.choices:
                        ids += ch.choices[0].model_extra.get("token_ids", [])
                return i, ids
            r = await api.create(**kw)
            return i, r.choices[0].model_extra["token_ids"]

    async def main():
        c = openai.AsyncOpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=60)
        sem = asyncio.Semaphore(12)
        return await asyncio.wait_for(asyncio.gather(*(one(c, sem, i) for i in range(60))), 120)

    got = asyncio.run(main())
    assert sorted(i for i, _ in got) == list(range(60))
    for i, ids in got:
        if i % 4 == 3:
            text = tok.apply_chat_template([{"role": "user", "content": prompts[i]}], tokenize=False,
                                           add_generation_prompt=True)
            p = encode(tok, text)
        else:
            p = encode(tok, prompts[i])
        assert ids == reference(model, tok, p, lengths[i]), i
    assert wait_for(lambda: _engine_idle(srv.engine))


def test_serve_command_errors_are_one_line(tmp_path, capsys):
    from orthros.cli import main

    assert main(["serve", str(tmp_path / "nope")]) == 2
    assert "not a model directory" in capsys.readouterr().err
    assert main(["serve"]) == 2
    assert "model directory or --preset" in capsys.readouterr().err


@pytest.mark.parametrize("flags, said", [(["--port", "99999"], "--port"), (["--port", "-1"], "--port"),
                                         (["--block-size", "0"], "--block-size"),
                                         (["--num-blocks", "0"], "--num-blocks"), (["--window", "0"], "--window"),
                                         (["--layers", "0"], "--layers"), (["--max-num-seqs", "0"], "--max-num-seqs")])
def test_serve_flags_out_of_range_are_one_line_errors(capsys, flags, said):
    """A port past 65535 ended in an OverflowError from the socket; --block-size 0 served with the
    default block size: each is now the parser's error, before a model is built."""
    from orthros.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--preset", "tiny", "--device", "cpu", *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert said in err and "Traceback" not in err, err
