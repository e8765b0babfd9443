"""`orthros bench serve` at the tiny scale on CPU: every scenario runs end to end against real
servers (in-process, and once as a subprocess), writes JSON, a table spliced into the docs page
and a plot; every request completes with its full length."""

import json

import pytest

from orthros.cli import main

pytest.importorskip("fastapi")
pytest.importorskip("httpx")


def run(tmp_path, scenario, *argv):
    doc = tmp_path / "serving.md"
    doc.write_text(f"<!-- serve-{scenario}-table:begin -->\n(pending)\n<!-- serve-{scenario}-table:end -->\n")
    rc = main(["bench", "serve", "--scenario", scenario, "--scale", "tiny", "--out-dir", str(tmp_path),
               "--plot-dir", str(tmp_path), "--docs", str(doc), *argv])
    assert rc == 0
    assert (tmp_path / f"serve-{scenario}.png").stat().st_size > 0
    assert "| attention |" in doc.read_text() and "(pending)" not in doc.read_text()
    return json.loads((tmp_path / f"serve-{scenario}.json").read_text())


def test_paper_scenario_both_attentions(tmp_path):
    res = run(tmp_path, "paper", "--server", "inprocess")
    assert {(r["variant"], r["run"]) for r in res["rows"]} == {(v, n) for v in ("orthros", "full")
                                                               for n in ("128K/128", "127K/1K")}
    for r in res["rows"]:
        assert r["completed"] == 2 and r["failed"] == 0
        assert r["total_output_tokens"] == 2 * r["output"] and r["total_input_tokens"] == 2 * r["input"]
        assert 0 < r["ttft"]["p50"] <= r["e2el"]["p50"] and r["itl"]["n"] > 0 and r["output_throughput"] > 0
    # the engine's step times beside the client's view, without asking (a step log per server)
    assert set(res["steps"]) == {"orthros", "full"} and all(s["steps"] > 0 for s in res["steps"].values())
    table = (tmp_path / "serve-paper.md").read_text()
    assert "The engine's view" in table and "| orthros |" in table.split("The engine's view")[1]
    # a run cut short before its last row (full attention's 127K / 1K) still makes its table and plot
    assert res["complete"] is True
    (tmp_path / "cut.json").write_text(json.dumps(dict(res, rows=res["rows"][:-1], complete=False)))
    for made in ("serve-paper.md", "serve-paper.png"):
        (tmp_path / made).unlink()
    run(tmp_path, "paper", "--from-json", str(tmp_path / "cut.json"), "--tag", "serve-paper")
    table = (tmp_path / "serve-paper.md").read_text()
    assert "| full | 128K/128 |" in table and "| full | 127K/1K |" not in table
    assert "**An incomplete run**: the 3 row(s) measured before it stopped." in table


def test_traffic_scenario_subprocess_server_and_merge(tmp_path):
    res = run(tmp_path, "traffic", "--variants", "orthros", "--rates", "20", "--num-prompts", "4", "--step-log-dir",
              str(tmp_path / "steps"), "--server-args=--no-prefix-caching --max-queue 64")
    assert "--no-prefix-caching --max-queue 64" in res["servers"]["orthros"]  # passed to the server
    assert any("orthros serve" in line for line in res["steps"]["orthros"]["server_log_tail"])  # its banner
    (row,) = res["rows"]
    assert row["completed"] == 4 and row["rate"] == 20 and "orthros serve --preset tiny" in res["servers"]["orthros"]
    assert all(16 <= q["prompt_len"] <= 256 and 4 <= q["output_len"] <= 16 for q in row["requests"])
    # a run split in two (one per variant) is joined into one table
    other = dict(res, rows=[dict(row, variant="full")], servers={"full": "(another run)"})
    (tmp_path / "b.json").write_text(json.dumps(other))
    merged = run(tmp_path, "traffic", "--from-json", str(tmp_path / "serve-traffic.json"), str(tmp_path / "b.json"),
                 "--tag", "serve-traffic")
    assert [r["variant"] for r in merged["rows"]] == ["orthros", "full"] and set(merged["servers"]) == {"orthros", "full"}


def test_interference_scenario(tmp_path):
    res = run(tmp_path, "interference", "--server", "inprocess", "--budgets", "16", "--step-log-dir",
              str(tmp_path / "steps"))
    for v in ("orthros", "full"):  # each server's engine steps, one JSON line each
        lines = (tmp_path / "steps" / f"serve-interference-{v}-budget16.jsonl").read_text().splitlines()
        assert len(lines) > 10 and all(json.loads(x)["ms"] >= 0 for x in lines)
        summary = res["steps"][f"{v} budget 16"]  # and its summary in the results
        assert summary["steps"] == len(lines) and summary["slowest"][0]["ms"] == summary["ms_max"] >= summary["ms_p50"]
    assert [(r["variant"], r["budget"]) for r in res["rows"]] == [("orthros", 16), ("full", 16)]
    for r in res["rows"]:
        assert not r["errors"] and not r["background_finished_early"]
        assert r["long_ttft_ms"] > 0 and r["itl_during_prefill"]["n"] > 0 and r["itl_before"]["n"] > 0


def test_documents_scenario_chats_reuse_their_documents(tmp_path):
    """Multi-turn chats about shared documents: every turn completes, a later turn's prompt is the
    earlier one + the server's answer + a question, and the prefix cache serves the documents and
    the history (the hit rate the table reports)."""
    res = run(tmp_path, "documents", "--server", "inprocess", "--rates", "inf", "--num-prompts", "6")
    assert [r["variant"] for r in res["rows"]] == ["orthros", "full"]
    for r in res["rows"]:
        assert r["completed"] == 18 and r["failed"] == 0  # 6 chats x 3 turns
        reqs = sorted(r["requests"], key=lambda q: (q["session"], q["turn"]))
        for a, b in zip(reqs, reqs[1:]):
            if a["session"] == b["session"]:  # the history resent: the previous prompt and answer, then more
                assert b["turn"] == a["turn"] + 1 and b["prompt_len"] > a["prompt_len"] + a["output_len"]
                assert b["cached"] >= a["prompt_len"] // 4 * 4 - 4  # (whole blocks of 4 tokens)
        assert r["total_input_tokens"] > 0 and 0.5 < r["prefix_hit_rate"] < 1
        assert r["prefix_hit_rate"] == sum(q["cached"] for q in reqs) / r["total_input_tokens"]
    assert "prefix hits" in (tmp_path / "serve-documents.md").read_text()


def test_each_run_draws_its_own_prompts():
    """Runs of one scenario never repeat each other's prompts (a repeat would be a prefix-cache
    hit, not a prefill); one run's prompts are the same for every variant (seeded per run); runs
    at different rates carry the same prompt and output lengths (the same work, arriving faster)."""
    import argparse

    from orthros.bench.serve import _load_runs, add_arguments, run_requests

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--scenario", "traffic", "--scale", "tiny", "--rates", "1", "2", "--num-prompts", "3"])
    (a, a_out), (b, b_out) = [run_requests(args, i, r) for i, r in enumerate(_load_runs(args))]
    assert len(a) == len(b) == 3 and all(16 <= len(x) <= 256 for x in a + b)
    assert [len(x) for x in a] == [len(x) for x in b] and a_out == b_out and len(set(map(len, a))) > 1
    assert not any(x[:8] == y[:8] for x in a for y in b)
    assert run_requests(args, 0, _load_runs(args)[0]) == (a, a_out)
    paper = p.parse_args(["--scenario", "paper", "--scale", "tiny"])
    (p1, _), (p2, _) = [run_requests(paper, i, r) for i, r in enumerate(_load_runs(paper))]
    assert not any(x[:8] == y[:8] for x in p1 for y in p2)  # 127K prompts are no prefixes of the 128K ones


def test_tiny_scale_runs_on_the_cpu_unless_told(monkeypatch):
    import argparse

    import torch

    from orthros.bench.serve import add_arguments
    from orthros.bench.serve_server import bench_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert bench_device(p.parse_args(["--scale", "tiny"])) == "cpu"
    assert bench_device(p.parse_args(["--scale", "gpu"])) == "cuda"
    assert bench_device(p.parse_args(["--scale", "tiny", "--device", "cuda"])) == "cuda"


def test_equal_tail_table_compares_throughput_at_no_higher_ttft_p99():
    from orthros.bench.serve_report import equal_tail_table

    def row(variant, rate, p99_s, req_s):
        return dict(variant=variant, run=f"rate {rate:g}/s", rate=rate, ttft={"p99": 1e3 * p99_s},
                    request_throughput=req_s, total_token_throughput=1e4 * req_s, total_input_tokens=1000)

    rows = [row("full", 0.1, 20, 0.1), row("full", 0.2, 60, 0.15), row("full", 0.05, 1, 0.05),
            row("orthros", 0.25, 5, 0.25), row("orthros", 0.5, 15, 0.48), row("orthros", 1.0, 40, 0.6)]
    lines = equal_tail_table(rows).splitlines()
    body = [line for line in lines if line.startswith("| rate")]
    assert body[0].startswith("| rate 0.05/s") and "none as low" in body[0]
    assert "| rate 0.5/s | 15.00 s | 0.480 | 4.80x |" in body[1]  # not 1.0/s: its p99 (40 s) is above 20 s
    assert "| rate 1/s | 40.00 s | 0.600 | 4.00x |" in body[2]
    assert equal_tail_table([r for r in rows if r["variant"] == "full"]) == ""
    rows[0]["total_input_tokens"] = 999  # runs with different prompts: no comparison
    assert equal_tail_table(rows) == ""


def test_long_scenario_low_bit_servers_size_themselves(tmp_path):
    res = run(tmp_path, "long", "--server", "inprocess", "--variants", "orthros", "--long-cases", "int2:4M",
              "fp8:4M", "--capacity-dtypes", "bf16", "int4", "--concurrency", "2")
    one, cap = res["rows"][:2], res["rows"][2:]
    assert [(r["kv_dtype"], r["input"], r["concurrency"]) for r in one] == [("int2", 8192, 1), ("fp8", 8192, 1)]
    for r in one:  # a server of --max-model-len auto: its length is what its pool holds
        assert r["completed"] == 1 and r["max_model_len"] > r["input"] and r["decode_tok_s"] > 0
        assert r["max_model_len"] == r["kv_blocks"] * r["block_size"]
    # the same memory holds more tokens in int2 than in fp8; a low-bit server picked 64-token blocks
    assert one[0]["max_model_len"] > one[1]["max_model_len"] and one[0]["block_size"] == 64
    assert [(r["kv_dtype"], r["concurrency"], r["completed"]) for r in cap] == [("bf16", 2, 2), ("int4", 2, 2)]
    assert cap[1]["pool_holds"] > cap[0]["pool_holds"] >= 2
    assert "int2" in (tmp_path / "serve-long.md").read_text()


@pytest.mark.parametrize("case, said", [("int3:1M", "KV_DTYPE:LENGTH"),
                                        ("int4:0", "--long-cases int4:0: must be >= 1, got 0")])
def test_long_scenario_bad_case_is_a_clear_error(tmp_path, capsys, case, said):
    assert main(["bench", "serve", "--scenario", "long", "--scale", "tiny", "--long-cases", case,
                 "--out-dir", str(tmp_path), "--docs", "/dev/null"]) != 0
    assert said in capsys.readouterr().err


def test_the_plot_goes_beside_the_json_unless_told(tmp_path, monkeypatch):
    """With --out-dir and no --plot-dir the plot went to benchmarks/results/serve, over the committed
    plot of the GPU run, wherever the JSON went."""
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "serve", "--scale", "tiny", "--variants", "orthros", "--server", "inprocess",
                 "--out-dir", "elsewhere"]) == 0
    assert (tmp_path / "elsewhere" / "serve-paper.png").is_file() and not (tmp_path / "benchmarks").exists()


@pytest.mark.parametrize("flags, said", [
    (["--budget", "0"], "--budget: must be >= 1, got 0"), (["--budget", "-5"], "--budget: must be >= 1, got -5"),
    (["--concurrency", "0"], "--concurrency: must be >= 1, got 0"),
    (["--scenario", "interference", "--budgets", "2048", "0"], "--budgets: must be >= 1, got 0"),
    (["--scenario", "custom", "--num-prompts", "0"], "--num-prompts: must be >= 1, got 0"),
    (["--warmup", "-1"], "--warmup: must be >= 0, got -1"),
    (["--scenario", "custom", "--output-range", "0", "8"], "--output-range: must be >= 1, got 0"),
    (["--scenario", "custom", "--input-len", "0K"], "--input-len: must be >= 1, got 0")])
def test_a_count_below_its_least_is_a_clear_error_before_a_server_starts(tmp_path, capsys, flags, said):
    """--budget 0, --concurrency 0 and --num-prompts 0 ran with the scenario's defaults; a negative
    budget started a server that refused it and ended in a traceback."""
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--scale", "tiny", "--variants", "orthros", "--out-dir", str(tmp_path), *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.splitlines()[-1] == f"orthros bench serve: error: argument {said}", err
    assert not list(tmp_path.iterdir()), "a refused run wrote files"


def test_long_scenario_without_capacity_and_full_attention_without_low_bit(tmp_path, capsys):
    res = run(tmp_path, "long", "--server", "inprocess", "--long-cases", "int4:1M", "fp8:1M", "--capacity-dtypes")
    assert [(r["variant"], r["kv_dtype"], r["completed"]) for r in res["rows"]] == [
        ("orthros", "int4", 1), ("orthros", "fp8", 1), ("full", "fp8", 1)]
    assert "full: no int4 KV cache (Orthros only)" in capsys.readouterr().out


def test_faults_scenario_every_check_holds(tmp_path):
    """A burst of 64 long prompts at 4 seats and a queue of 16: 503s for the overflow and no accepted
    request lost; a client gone while its request holds blocks: they are freed; a prompt one token over
    the limit: a 400 naming it. Each server is still serving after."""
    res = run(tmp_path, "faults", "--server", "inprocess")
    rows = {(r["variant"], r["run"]): r for r in res["rows"]}
    assert {v for v, _ in rows} == {"orthros", "full"} and len(rows) == 6
    for v in ("orthros", "full"):
        b = rows[v, "burst"]
        assert b["held"] and b["lost"] == 0 and b["served"] + b["refused_503"] == 64
        assert b["served"] >= 16 and b["refused_503"] >= 1 and b["alive_after"]
        assert sum(q["ok"] for q in b["requests"]) == b["served"]
        d = rows[v, "disconnect mid-prefill"]
        # closed while it held blocks, cut short (mid-prefill where the prefill outlasts the polls: on a GPU)
        assert d["held"] and d["blocks_held"] > 0 and d["tokens_before_abort"] < d["asked"]
        assert d["freed_after_s"] is not None
        t = rows[v, "one token over --max-model-len"]
        assert t["held"] and t["status"] == 400 and str(t["input_tokens"] - 1) in t["message"]
    assert "× 503" in (tmp_path / "serve-faults.md").read_text()


def test_a_run_cut_short_keeps_the_rows_it_measured(tmp_path, monkeypatch, capsys):
    """The JSON is written after every row: a server that dies at the second long case (here, a stand-in
    for the scenario's rows) leaves the first row and the error on disk, and says where."""
    from orthros.bench import serve

    def rows(args, variant, *_):
        yield dict(variant=variant, run="one int4 request", kv_dtype="int4", input=8192)
        raise RuntimeError("the server went away")

    monkeypatch.setattr(serve, "long_rows", rows)
    with pytest.raises(RuntimeError, match="the server went away"):  # not a user's mistake: its traceback
        main(["bench", "serve", "--scenario", "long", "--scale", "tiny", "--server", "inprocess",
              "--variants", "orthros", "--out-dir", str(tmp_path), "--docs", "/dev/null"])
    res = json.loads((tmp_path / "serve-long.json").read_text())
    assert [r["run"] for r in res["rows"]] == ["one int4 request"]
    assert res["error"] == "RuntimeError: the server went away" and res["complete"] is False
    assert f"the 1 row(s) measured before it stopped are in {tmp_path / 'serve-long.json'}" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.tmp"))


def test_the_client_counts_tokens_without_asking_for_the_prompt_back():
    """`stream_request` times each token from the usage every chunk reports, so the first chunk does
    not carry the prompt's ids back (what `return_token_ids` adds to it: ~1 MB at 128K tokens, all
    before the first token shows); asked for the ids (a chat resends its answer), it gets the same
    tokens, and the same ones a request without streaming gets."""
    import asyncio
    import random

    from orthros.bench.serve_client import http_client, stream_request
    from orthros.serve.config import EngineConfig
    from orthros.serve.launch import build_app, load_model, serve_in_thread

    model, tok, name = load_model(None, "tiny", "cpu", "fp32", window=16, max_model_len=512)
    app, eng = build_app(model, tok, name, EngineConfig(block_size=4, max_num_batched_tokens=64, kv_cache_gib=0.01))
    srv = serve_in_thread(app, eng)
    prompt = [random.Random(0).randrange(model.config.vocab_size) for _ in range(150)]
    sent = []

    async def go():
        async with http_client(1) as client:
            stream = client.stream
            client.stream = lambda *a, **kw: (sent.append(kw["json"]), stream(*a, **kw))[1]
            plain = await stream_request(client, srv.url, name, prompt, 6)
            ids = await stream_request(client, srv.url, name, prompt, 6, token_ids=True)
            whole = (await client.post(srv.url + "/completions", json=dict(
                model=name, prompt=prompt, max_tokens=6, temperature=0.0, ignore_eos=True,
                return_token_ids=True))).json()
        return plain, ids, whole

    try:
        plain, ids, whole = asyncio.run(go())
    finally:
        srv.stop()
    assert "return_token_ids" not in sent[0] and sent[1]["return_token_ids"] is True
    for r in (plain, ids):
        assert r.ok and r.error is None and r.tokens == 6 and len(r.chunk_times) == 6
        assert 0 < r.ttft <= r.e2el and len(r.itl) == 5
    assert plain.token_ids == [] and ids.token_ids == whole["choices"][0]["token_ids"] and len(ids.token_ids) == 6
