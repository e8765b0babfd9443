"""Context-parallel prefill + decoding == the single process, on 2 and 4 gloo ranks.

All cases run in one group of 4 forked CPU processes (2-rank cases on a
subgroup), so the file pays the process start-up once. The parent builds each
tiny model and its single-process reference (`generate.prefill` then 8
`decode_one_token` steps); the ranks run `cp_prefill` + `cp_decode_one_token`
and save their logits; each test compares one case, on every rank.
"""

from __future__ import annotations


import pytest
import torch

from orthros.generate import decode_one_token, generate, prefill
from orthros.ops.naive import naive_attention
from orthros.parallel import balanced_bounds, cp_decode_one_token, cp_prefill, shard_bounds
from orthros.parallel import spawn

from ..conftest import DEVICE, make_model, rel_err, run_triton_interpreted
from .workers import cases_worker, load_bench, partials_case, sharded_partials

TOL = 1e-5
STEPS = 8

# name: world size, attention kind, window, prompt length, shard sizes (None = even), batch, left padding per row
CASES = {
    "w2-orthros-even": dict(world=2, attention="orthros", W=16, T=67),
    "w2-orthros-last-shard-shorter-than-window": dict(world=2, attention="orthros", W=16, T=37, sizes=[30, 7]),
    "w2-orthros-window-larger-than-prompt": dict(world=2, attention="orthros", W=50, T=40, sizes=[25, 15]),
    "w2-orthros-qk-norm": dict(world=2, attention="orthros", W=9, T=31, qk_norm=True),
    "w2-full-uneven": dict(world=2, attention="full", W=16, T=45, sizes=[20, 25]),
    "w2-swa": dict(world=2, attention="swa", W=8, T=45),
    "w2-padded-batch": dict(world=2, attention="orthros", W=6, T=30, B=2, pad=[0, 11]),
    "w4-orthros-halo-spans-ranks": dict(world=4, attention="orthros", W=16, T=50, sizes=[5, 20, 3, 22]),
    "w4-orthros-window-covers-all-shards": dict(world=4, attention="orthros", W=40, T=30, sizes=[10, 7, 8, 5]),
    "w4-orthros-window-1": dict(world=4, attention="orthros", W=1, T=21),
    "w4-full-uneven": dict(world=4, attention="full", W=16, T=29, sizes=[3, 12, 6, 8]),
    "w4-swa-one-token-shards": dict(world=4, attention="swa", W=5, T=23, sizes=[1, 1, 1, 20]),
    # a one-token shard keeps its two streams apart (joined, its last layer would ask alone for a halo)
    "w4-orthros-one-token-shards": dict(world=4, attention="orthros", W=5, T=23, sizes=[1, 20, 1, 1]),
    "w4-padded-batch-shard-of-padding": dict(world=4, attention="orthros", W=7, T=33, B=2, pad=[9, 2]),
    # MoE: an output row routed by its base row, which only the last rank holds
    "w2-moe-bound": dict(world=2, attention="orthros", W=6, T=29, moe="bound"),
    "w4-moe-base-padded": dict(world=4, attention="orthros", W=5, T=27, sizes=[6, 9, 2, 10], B=2, pad=[0, 7],
                               moe="base"),
    # attention sinks: the first shard's first slots, broadcast into every halo; a window spanning ranks
    "w2-orthros-sinks": dict(world=2, attention="orthros", W=6, T=40, sinks=3),
    "w4-orthros-sinks-halo-spans-ranks": dict(world=4, attention="orthros", W=7, T=37, sizes=[4, 3, 20, 10], sinks=4,
                                              B=2),
    "w4-swa-sinks": dict(world=4, attention="swa", W=5, T=30, sinks=2),
}
GENERATE = dict(world=4, attention="orthros", W=6, T=26, sizes=[4, 9, 2, 11], new=6)
CLI_PROMPT = "def main():\n    return sum(range(10))\n"
BENCH = ["--preset", "tiny", "--window", "8", "--lengths", "37,64", "--attention", "orthros,full", "--device", "cpu",
         "--warmup", "0", "--repeats", "1", "--crossover", "20", "--decode-steps", "2"]


def build_case(spec: dict, seed: int):
    """(case for the ranks, single-process reference logits [STEPS + 1, B, V])."""
    extra = {"qk_norm": True} if spec.get("qk_norm") else {}
    if spec.get("sinks"):
        extra["sink_tokens"] = spec["sinks"]
    if spec.get("moe"):
        extra.update(base="tiny-moe", output_routing=spec["moe"])
    model = make_model(spec["attention"], window=spec["W"], seed=seed, **extra).cpu()
    g = torch.Generator().manual_seed(seed)
    B, T = spec.get("B", 1), spec["T"]
    ids = torch.randint(0, 256, (B, T), generator=g)
    mask = None
    if "pad" in spec:
        mask = torch.ones(B, T, dtype=torch.long)
        for row, p in enumerate(spec["pad"]):
            mask[row, :p] = 0
    tokens = [torch.randint(0, 256, (B,), generator=g) for _ in range(STEPS)]
    logits, cache = prefill(model, ids, mask)
    ref = [logits]
    for tok in tokens:
        mask = None if mask is None else torch.cat([mask, mask.new_ones(B, 1)], 1)
        ref.append(decode_one_token(model, tok, mask, cache))
    case = dict(world=spec["world"], config=model.config, state=model.state_dict(), ids=ids,
                mask=None if "pad" not in spec else mask[:, :T], tokens=tokens, sizes=spec.get("sizes"))
    return case, torch.stack(ref)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Run every case on the ranks once; {name: (reference, [logits of each rank])}."""
    out = tmp_path_factory.mktemp("cp")
    names = list(CASES)
    built = [build_case(CASES[n], seed=i) for i, n in enumerate(names)]
    gen_case, _ = build_case(GENERATE, seed=99)
    gen_case["generate"] = GENERATE["new"]
    bad_case = dict(built[0][0], world=2, mismatch=True)
    bench = BENCH + ["--out", str(out / "bench.jsonl")]
    model_dir = out / "model"
    make_model("orthros", window=5, seed=7).cpu().save_pretrained(model_dir)
    cli = [str(model_dir), "--prompt", CLI_PROMPT, "--max-new-tokens", "12", "--device", "cpu"]
    # a fork after CUDA (and its autograd threads) started in this process can kill a child
    method = "spawn" if torch.cuda.is_initialized() else "fork"
    spawn(cases_worker, 4, [c for c, _ in built] + [gen_case, bad_case], str(out), bench, cli, start_method=method)
    res = {}
    for i, (name, (case, ref)) in enumerate(zip(names, built)):
        res[name] = ref, [torch.load(out / f"case{i}_rank{r}.pt") for r in range(case["world"])]
    model = make_model("orthros", window=GENERATE["W"], seed=99).cpu()
    want = generate(model, gen_case["ids"], max_new_tokens=GENERATE["new"])
    got = [torch.load(out / f"case{len(names)}_rank{r}.pt") for r in range(GENERATE["world"])]
    res["generate"] = want, got
    res["mismatch"] = [torch.load(out / f"case{len(names) + 1}_rank{r}.pt") for r in range(2)]
    res["bench"] = out / "bench.jsonl"
    res["cli"] = model_dir, cli, [(out / f"cli_rank{r}.txt").read_text() for r in range(4)]
    return res


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_prefill_and_decode_match_single_process(results, name):
    ref, ranks = results[name]
    assert len(ranks) == CASES[name]["world"]
    for r, got in enumerate(ranks):
        assert got.shape == ref.shape
        for step in range(STEPS + 1):  # step 0: the prefill's logits; then each decoded token
            assert rel_err(got[step], ref[step]) < TOL, (name, r, step)
    # every rank holds the same logits (the output stream is replicated)
    for got in ranks[1:]:
        assert torch.equal(got, ranks[0])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (the same cases run on gloo above)")
def test_nccl_on_two_gpus(tmp_path):
    """The GPU path (NCCL, FlexAttention, split-KV partials) against the fp32 CPU reference."""
    names = ["w2-orthros-last-shard-shorter-than-window", "w2-full-uneven", "w2-padded-batch"]
    built = [build_case(CASES[n], seed=list(CASES).index(n)) for n in names]
    spawn(cases_worker, 2, [dict(c, cuda=True) for c, _ in built], str(tmp_path), backend="nccl")
    for i, (name, (_, ref)) in enumerate(zip(names, built)):
        for r in range(2):
            got = torch.load(tmp_path / f"case{i}_rank{r}.pt")
            for step in range(STEPS + 1):
                assert rel_err(got[step], ref[step]) < 1e-4, (name, r, step)


def test_cp_generate_matches_generate(results):
    want, got = results["generate"]
    for tokens in got:
        assert torch.equal(tokens, want)


def test_different_prompts_on_ranks_are_an_error(results):
    for msg in results["mismatch"]:
        assert "same whole prompt on every rank" in msg


def test_benchmark_script_runs_and_reports(results, tmp_path):
    """benchmarks/cp_prefill.py on 4 gloo ranks (in the group above) and on one process;
    the report turns both into speedup / efficiency rows and a plot."""
    bench = load_bench()
    path = results["bench"]
    four = bench.load_rows([path])
    assert {(r["attention"], r["T"]) for r in four} == {(k, t) for k in ("orthros", "full") for t in (37, 64)}
    for r in four:
        assert r["world"] == 4 and r["status"] == "ok" and r["seconds"] > 0 and sum(r["shards"]) == r["T"]
        assert r["decode_ms_per_token"] > 0
        if r["attention"] == "full":  # causal cost grows along the prompt: later shards are shorter
            assert r["shards"][0] > r["shards"][-1]
        else:
            assert max(r["shards"]) - min(r["shards"]) <= 1
    assert bench.main(BENCH + ["--out", str(path), "--lengths", "37"]) == 0  # one process, appended
    rows = bench.load_rows([path])
    assert {r["attention"] for r in rows if r["world"] == 1} == {"orthros", "orthros/model", "full", "full/model"}
    plot = tmp_path / "cp.png"
    table = bench.report(rows, str(plot))
    assert plot.stat().st_size > 0
    lines = [line for line in table.splitlines() if line.startswith("| orthros | 37 |")]
    assert [line.split("|")[3].strip() for line in lines] == ["1", "4"]
    assert "100%" in lines[0] and lines[1].split("|")[8].strip().endswith("x")  # efficiency, vs full
    assert float(lines[1].split("|")[9]) > 0  # decode ms per token
    with pytest.raises(ValueError, match="--attention"):
        bench.parse_args(["--attention", "ring"])


def test_module_entry_point_generates_like_one_process(results, capsys):
    """`python -m orthros.parallel MODEL --prompt ...` on 4 ranks prints (on rank 0 only)
    the greedy continuation of the single-process `generate`."""
    from orthros.data.tokenizer import ByteTokenizer
    from orthros.parallel.__main__ import main

    model_dir, argv, outputs = results["cli"]
    model = make_model("orthros", window=5, seed=7).cpu()
    tok = ByteTokenizer()
    prompt = tok.encode(CLI_PROMPT)
    ids = generate(model, [prompt], max_new_tokens=12, stop_tokens=tok.eos_token_id)
    want = tok.decode(ids[0, len(prompt):].tolist())
    assert outputs[0] == f"0\n{want}\n"
    assert all(o == "0\n" for o in outputs[1:])
    assert main(argv) == 0  # one process, same code
    assert capsys.readouterr().out == f"{want}\n"
    assert main([str(model_dir / "missing"), "--prompt", "x"]) == 2
    assert "not a model directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # the sampling flags as `orthros generate` checks them, in the parser
        main([str(model_dir), "--prompt", "x", "--top-p", "0"])
    assert e.value.code == 2 and "argument --top-p: must be > 0 and <= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([str(model_dir), "--prompt", "x", "--shard-sizes", "4,x"])
    assert e.value.code == 2 and "argument --shard-sizes: a whole number, not 'x'" in capsys.readouterr().err


# ------------------------------------------------------- single-process pieces
def test_shard_bounds():
    assert shard_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert shard_bounds(5, 2, [1, 4]) == [(0, 1), (1, 5)]
    with pytest.raises(ValueError, match="cannot be split over 4 ranks"):
        shard_bounds(3, 4)
    with pytest.raises(ValueError, match="shard_sizes"):
        shard_bounds(10, 2, [3, 6])
    with pytest.raises(ValueError, match="shard_sizes"):
        shard_bounds(10, 2, [0, 10])


def test_balanced_bounds_equalise_causal_cost():
    T, world, k = 100_000, 8, 20_000.0
    bounds = balanced_bounds(T, world, k)
    sizes = [b - a for a, b in bounds]
    assert bounds[0][0] == 0 and bounds[-1][1] == T and sizes == sorted(sizes, reverse=True)
    costs = [(b - a) + (b * b - a * a) / (2 * k) for a, b in bounds]
    assert max(costs) / min(costs) < 1.001
    assert balanced_bounds(T, world, float("inf")) == shard_bounds(T, world)
    assert balanced_bounds(9, 4, 1.0) == shard_bounds(9, 4, [b - a for a, b in balanced_bounds(9, 4, 1.0)])


@pytest.mark.parametrize("window", [None, 7])
def test_partial_attention_over_key_shards_merges_to_the_full_op(window):
    """Splitting the keys into shards (and each shard into key chunks) and merging by lse
    is exact, including shards that see nothing (lse = -inf)."""
    args, cuts = partials_case()
    ref, ref_lse = naive_attention(*args, window=window, return_lse=True)
    o, lse = sharded_partials(*args, window, cuts)
    assert rel_err(o, ref) < 1e-6
    seen = torch.isfinite(ref_lse)
    assert torch.equal(seen, torch.isfinite(lse)) and rel_err(lse[seen], ref_lse[seen]) < 1e-6
    assert (o[1, 2] == 0).all()


def test_partials_from_the_triton_kernel_merge_exactly():
    """The GPU path of `partial_attention` (split-KV kernel with return_lse) under the Triton
    interpreter on CPU, in a subprocess (the flag must precede `import triton`)."""
    code = "from tests.parallel.workers import check_triton_partials as c; print(c())"
    out = run_triton_interpreted("-c", code, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.strip().split("=")[1]) < 1e-5


@pytest.mark.parametrize("attention", ["orthros", "full"])
def test_one_process_is_plain_prefill(attention):
    """Without a process group the same code runs one shard: equals `prefill` (on the test
    device: on a GPU this is the FlexAttention + split-KV path)."""
    model = make_model(attention, window=5)
    ids = torch.randint(0, 256, (1, 19), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ref, cache = prefill(model, ids)
    got, sharded = cp_prefill(model, ids)
    tol = TOL if DEVICE.type == "cpu" else 1e-4
    assert rel_err(got, ref) < tol
    for t in (3, 200, 7):
        tok = torch.tensor([t], device=DEVICE)
        assert rel_err(cp_decode_one_token(model, tok, sharded), decode_one_token(model, tok, None, cache)) < tol


def test_errors_name_the_mistake():
    model = make_model("orthros", window=5).cpu()
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="shard_sizes"):
        cp_prefill(model, ids, shard_sizes=[3, 4])
    with pytest.raises(ValueError, match="attention_mask"):
        cp_prefill(model, ids, attention_mask=torch.ones(1, 7))
    with pytest.raises(ValueError, match="input_ids"):
        cp_prefill(model, ids[0])
    model.train()
    with pytest.raises(ValueError, match="model.eval"):
        cp_prefill(model, ids)
    sinks = make_model("orthros", window=3, sink_tokens=2).cpu()
    with pytest.raises(ValueError, match="attention sinks.*left-padded"):
        cp_prefill(sinks, torch.zeros(2, 8, dtype=torch.long), attention_mask=torch.tensor([[1] * 8, [0] + [1] * 7]))
