"""`orthros bench decode` / `orthros bench e2e` at tiny sizes: they run, write JSON, a table
spliced into the docs page and a plot, and reject bad arguments with clear errors."""

import json

import pytest

from orthros.cli import main


def run(tmp_path, *argv):
    doc = tmp_path / "bench.md"
    tags = ("decode", "e2e", "fp8", "capacity", "decode-int2")
    doc.write_text("".join(f"<!-- {t}-table:begin -->\n(pending)\n<!-- {t}-table:end -->\n" for t in tags))
    assert main(["bench", *argv, "--model", "tiny", "--no-compile", "--out-dir", str(tmp_path), "--docs", str(doc)]) == 0
    return doc.read_text()


def interrupt_at(monkeypatch, module, name: str, length: int):
    """module.name raises KeyboardInterrupt (a time limit, Ctrl-C) when its second argument is `length`."""
    real = getattr(module, name)

    def stopping(first, n, *a, **kw):
        if n == length:
            raise KeyboardInterrupt
        return real(first, n, *a, **kw)

    monkeypatch.setattr(module, name, stopping)


def test_bench_decode(tmp_path):
    doc = run(tmp_path, "decode", "--contexts", "40", "100", "--batches", "1", "2", "--steps", "2", "--warmup", "1",
              "--window", "8")
    res = json.loads((tmp_path / "decode.json").read_text())
    assert {(r["variant"], r["batch"], r["context"]) for r in res["rows"]} == \
        {(v, b, c) for v in ("orthros", "full") for b in (1, 2) for c in (40, 100)}
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 and r["bytes"] > 0 for r in res["rows"])
    # the full model's step reads fewer K/V bytes than Orthros' (no base-stream window)
    o = next(r for r in res["rows"] if r["variant"] == "orthros")
    f = next(r for r in res["rows"] if r["variant"] == "full" and r["batch"] == o["batch"] and r["context"] == o["context"])
    assert o["bytes"] > f["bytes"]
    assert "| 100 | 2 |" in doc and "(pending)" in doc.split("decode-table:end")[1]
    assert (tmp_path / "decode.png").stat().st_size > 0
    assert all(r["fill_s"] >= 0 and r["warmup_s"] > 0 for r in res["rows"])  # where a row's time went
    assert not (tmp_path / "decode.partial.json").exists()  # removed once the whole run is saved
    # no --bandwidth: the roofline is this device's measured copy bandwidth, and each row's share of it
    bw = res["bandwidth_tb_s"]
    assert 0 < bw < 100 and all(r["roofline_tok_s"] == pytest.approx(r["batch"] * bw * 1e12 / r["bytes"])
                                for r in res["rows"])


def test_copy_bandwidth_counts_bytes_read_and_written(monkeypatch):
    """copy_bandwidth: 2 x nbytes over the best copy's time."""
    import torch

    from orthros.bench import common

    clock = iter([0.0, 0.5, 1.0, 1.25, 2.0, 3.0])
    monkeypatch.setattr(common, "now", lambda device: next(clock))
    assert common.copy_bandwidth(torch.device("cpu"), nbytes=1000, repeats=3) == pytest.approx(2 * 1000 / 0.25 / 1e12)


def test_bench_decode_keeps_the_rows_of_a_stopped_run(tmp_path, monkeypatch, capsys):
    """Each row is saved as it ends: a run stopped at its second context keeps the first,
    and stderr said which phase each row was in."""
    from orthros.bench import decode

    interrupt_at(monkeypatch, decode, "fill_random", 100)  # fill_random(cache, context)
    assert main(["bench", "decode", "--variants", "orthros", "--contexts", "40", "100", "--batches", "1", "--steps",
                 "2", "--warmup", "1", "--window", "8", "--model", "tiny", "--no-compile", "--out-dir", str(tmp_path),
                 "--docs", "none"]) == 130
    part = json.loads((tmp_path / "decode.partial.json").read_text())
    assert [(r["variant"], r["context"], r["status"]) for r in part["rows"]] == [("orthros", 40, "ok")]
    err = capsys.readouterr().err
    assert "ctx=40: auto cache filled in" in err and "ctx=40: warm-up took" in err
    assert main(["bench", "decode", "--from-json", str(tmp_path / "decode.partial.json"), "--out-dir", str(tmp_path),
                 "--docs", "none"]) == 0


def test_bench_e2e_and_interpolated_long_output(tmp_path):
    doc = run(tmp_path, "e2e", "--settings", "50/6", "30/20", "--batch", "2", "--max-timed-steps", "6", "--window", "8")
    res = json.loads((tmp_path / "e2e.json").read_text())
    rows = {(r["variant"], r["T_in"], r["n_out"]): r for r in res["rows"]}
    assert len(rows) == 4 and all(r["status"] == "ok" and r["batch"] == 2 for r in rows.values())
    assert not rows[("orthros", 50, 6)]["extrapolated"] and rows[("orthros", 30, 20)]["extrapolated"]
    for r in rows.values():
        assert r["e2e_s"] == pytest.approx(r["ttft_s"] + r["decode_s"])
    assert "| 30 / 20 † | 2 |" in doc and (tmp_path / "e2e.png").exists()


def test_bench_fp8_agreement(tmp_path):
    doc = run(tmp_path, "e2e", "--agreement", "--settings", "64/12", "--dtype", "fp32", "--tag", "fp8")
    res = json.loads((tmp_path / "fp8.json").read_text())
    assert 0 < res["max_abs_logit_diff"] < res["logit_range"] and res["top1_agreement"] >= 0.9
    assert "top-1 agreement" in doc


def test_bench_decode_moe_counts_the_experts_read(tmp_path):
    """A MoE shape: each row says how many experts a sparse layer read in a step; a pair routed by its
    base row (bound / base) reads no more than one routed independently, and never more than the
    batch's rows x k; the step's bytes count those experts, not all."""
    doc = tmp_path / "bench.md"
    doc.write_text("<!-- decode-table:begin -->\n(pending)\n<!-- decode-table:end -->\n")
    assert main(["bench", "decode", "--model", "tiny-moe", "--no-compile", "--out-dir", str(tmp_path), "--docs",
                 str(doc), "--contexts", "40", "--batches", "1", "4", "--steps", "2", "--warmup", "1", "--window", "8",
                 "--variants", "full", "orthros", "orthros-bound", "orthros-base"]) == 0
    rows = {(r["variant"], r["batch"]): r for r in json.loads((tmp_path / "decode.json").read_text())["rows"]}
    E, k = 4, 2  # tiny-moe
    for (v, B), r in rows.items():
        assert r["status"] == "ok" and 1 <= r["experts_per_layer"] <= min(E, 2 * B * k) and r["expert_bytes"] > 0
    # one pair routed by its base row reads exactly its k experts a layer; routed alone, at least those
    # (at batch 4 the output rows' own last-layer choices differ between modes: no order there)
    assert rows[("orthros-bound", 1)]["experts_per_layer"] == rows[("orthros-base", 1)]["experts_per_layer"] == k
    assert rows[("orthros", 1)]["experts_per_layer"] >= k
    assert rows[("full", 1)]["experts_per_layer"] <= k
    assert "experts a layer" in doc.read_text()
    # a run without the `orthros` variant compares its first Orthros variant with full attention
    from orthros.bench.decode import table

    res = json.loads((tmp_path / "decode.json").read_text())
    res["rows"] = [r for r in res["rows"] if r["variant"] in ("full", "orthros-bound")]
    head, row = [ln for ln in table(res).splitlines() if ln.startswith("| ")][:3:2]
    assert "| orthros-bound / full |" in head and row.count("×") == 1
    assert main(["bench", "decode", "--model", "tiny", "--variants", "orthros-bound", "--out-dir", str(tmp_path)]) == 2


def test_profile_groups_moe_kernels_against_the_experts_read():
    """--profile: the fused MoE kernels are their own group, measured against the bytes of the experts
    a step read; the GEMMs against the weights outside the experts (not every expert of every layer)."""
    from orthros.bench.common import KERNEL_GROUPS
    from orthros.bench.decode import expert_bytes, group_bandwidth, weight_bytes
    from orthros.generate import new_static_cache

    from ..conftest import make_model

    def group(name):
        return next(g for g, subs in KERNEL_GROUPS if any(s in name.lower() for s in subs))

    assert group("moe_up") == group("moe_down") == "fused MoE experts"
    assert group("nvjet_sm90_tst_64x8") == "GEMM (linear layers)"
    model = make_model(window=3, base="tiny-moe")
    cache = new_static_cache(model, 1, 16, "auto")
    prof = {"steps": 2, "groups_ms": {"GEMM (linear layers)": 1.0, "fused MoE experts": 0.5}}
    out = group_bandwidth(prof, model, cache, 1, 8, experts_read=2)
    dense = weight_bytes(model, experts_read=0)
    assert 0 < dense < weight_bytes(model) and expert_bytes(model, 2) < expert_bytes(model)
    assert out["GEMM (linear layers)"] == pytest.approx(dense * 2 / 1e-3 / 1e9)
    assert out["fused MoE experts"] == pytest.approx(expert_bytes(model, 2) * 2 / 0.5e-3 / 1e9)
    assert "fused MoE experts" not in group_bandwidth(prof, model, cache, 1, 8)  # experts read unknown


def test_graphed_step_gives_the_eager_step_s_logits():
    """The bench's graphed MoE step: on a GPU its CUDA graph replays the eager step's logits; where no
    graph can be captured (no CUDA) it runs the eager step and records why."""
    import torch

    from orthros.bench.decode import GraphedStep
    from orthros.generate import decode_one_token_fast, new_static_cache, prefill

    from ..conftest import DEVICE, make_model

    model = make_model(window=3, base="tiny-moe", output_routing="bound").to(DEVICE)
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    outs = []
    for step in (None, GraphedStep()):
        cache = new_static_cache(model, 2, 16, "auto")
        with torch.no_grad():
            prefill(model, ids, cache=cache)
            tok = ids[:, -1]
            outs.append([decode_one_token_fast(model, tok, cache, *([step] if step else [])) for _ in range(2)])
    if DEVICE.type == "cuda":
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
        assert step.note is None and step.graph is not None
    else:
        torch.testing.assert_close(outs[1], outs[0])
        assert step.note.startswith("capture failed") and step.graph is None


def test_bench_decode_lowbit_reads_fewer_bytes(tmp_path):
    """--kv-dtype int2 (Orthros only): the step's byte count uses the packed size beyond the window."""
    common = ("decode", "--contexts", "300", "--batches", "1", "--steps", "2", "--warmup", "1", "--window", "8",
              "--variants", "orthros", "--bandwidth", "1.0")  # one ceiling for both runs: the rooflines differ by bytes
    run(tmp_path, *common, "--kv-dtype", "bf16")
    bf16 = json.loads((tmp_path / "decode.json").read_text())["rows"][0]
    doc = run(tmp_path, *common, "--kv-dtype", "int2", "--tag", "decode-int2")  # its own files and marks
    int2 = json.loads((tmp_path / "decode-int2.json").read_text())["rows"][0]
    assert "KV cache int2" in doc.split("decode-int2-table:begin")[1] and (tmp_path / "decode-int2.png").exists()
    assert int2["status"] == "ok" and int2["tokens_per_s"] > 0
    assert int2["bytes"] < bf16["bytes"] and int2["cache_gib"] < bf16["cache_gib"]
    assert int2["roofline_tok_s"] > bf16["roofline_tok_s"]


def test_bench_capacity(tmp_path):
    doc = run(tmp_path, "capacity", "--kv-dtypes", "bf16", "int4", "--lengths", "300", "100", "--new", "4",
              "--warmup", "1", "--window", "8", "--chunk-size", "128")
    res = json.loads((tmp_path / "capacity.json").read_text())
    assert [(r["kv_dtype"], r["prompt"]) for r in res["rows"]] == [("bf16", 100), ("bf16", 300), ("int4", 100),
                                                                   ("int4", 300)]
    assert all(r["status"] == "ok" and r["prefill_s"] > 0 and r["tokens_per_s"] > 0 for r in res["rows"])
    assert "Longest prompt that prefilled and decoded: bf16 300, int4 300." in doc
    run(tmp_path, "capacity", "--kv-dtypes", "bf16:64", "int4:200,100", "--lengths", "300", "--new", "4",
        "--warmup", "1", "--window", "8", "--chunk-size", "128")
    res = json.loads((tmp_path / "capacity.json").read_text())
    assert [(r["kv_dtype"], r["prompt"]) for r in res["rows"]] == [("bf16", 64), ("int4", 100), ("int4", 200)]
    assert not (tmp_path / "capacity.partial.json").exists()  # removed once the whole run is saved
    with pytest.raises(SystemExit):
        main(["bench", "capacity", "--kv-dtypes", "int3:1M"])


def test_bench_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # argparse: usage + one line, exit 2
        main(["bench", "e2e", "--settings", "128K"])
    assert e.value.code == 2
    assert main(["bench", "decode", "--from-json", str(tmp_path / "nope.json")]) == 2
    assert main(["bench", "decode", "--model", "no-such-model", "--out-dir", str(tmp_path)]) == 2
    assert main(["bench", "decode", "--model", "tiny", "--kv-dtype", "int4", "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--from-json" in err and "no-such-model" in err and "add --variants orthros" in err


def test_bench_capacity_keeps_the_rows_of_a_stopped_run(tmp_path, monkeypatch):
    """A run stopped part-way (a time limit, Ctrl-C) leaves the rows it measured in
    <tag>.partial.json, which --from-json renders."""
    from orthros.bench import capacity

    interrupt_at(monkeypatch, capacity, "try_length", 200)  # try_length(model, T, ...)
    assert main(["bench", "capacity", "--kv-dtypes", "int4:100,200", "--new", "4", "--warmup", "1", "--window", "8",
                 "--chunk-size", "128", "--model", "tiny", "--out-dir", str(tmp_path), "--docs", "none",
                 "--no-compile"]) == 130  # the compiled step is test_bench_capacity's
    part = json.loads((tmp_path / "capacity.partial.json").read_text())
    assert [(r["kv_dtype"], r["prompt"], r["status"]) for r in part["rows"]] == [("int4", 100, "ok")]
    assert main(["bench", "capacity", "--from-json", str(tmp_path / "capacity.partial.json"), "--out-dir",
                 str(tmp_path), "--docs", "none"]) == 0
