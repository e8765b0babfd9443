"""Process bodies for the context-parallel tests (importable by spawned children).

The parent builds the models and the single-process references; each case
ships (config, weights, prompt, tokens) to the ranks, which run the sharded
prefill + decoding and save their logits for the parent to compare.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from orthros import OrthrosForCausalLM
from orthros.parallel import CPGroup, cp_decode_one_token, cp_generate, cp_prefill


def run_case(case: dict, cp: CPGroup):
    """Sharded prefill, then decode the case's tokens: logits [steps + 1, B, V].
    (`generate` cases: the generated ids; `mismatch` cases: the error message.)"""
    model = OrthrosForCausalLM(case["config"]).eval()
    model.load_state_dict(case["state"])
    if case.get("cuda"):  # NCCL: one GPU per rank
        dev = torch.device("cuda", torch.cuda.current_device())
        model = model.to(dev)
        case = dict(case, ids=case["ids"].to(dev), tokens=[t.to(dev) for t in case["tokens"]],
                    mask=None if case.get("mask") is None else case["mask"].to(dev))
    if "generate" in case:
        return cp_generate(model, case["ids"], case["generate"], cp=cp, shard_sizes=case.get("sizes"))
    if case.get("mismatch"):  # each rank holds a different prompt
        try:
            cp_prefill(model, case["ids"] + cp.rank, cp=cp)
        except ValueError as e:
            return str(e)
        return "no error"
    logits, cache = cp_prefill(model, case["ids"], case.get("mask"), cp=cp, shard_sizes=case.get("sizes"))
    out = [logits]
    for tok in case["tokens"]:
        out.append(cp_decode_one_token(model, tok, cache))
    assert cache.get_seq_length() == case["ids"].shape[1] + len(case["tokens"])
    return torch.stack(out)


def load_bench():
    """benchmarks/cp_prefill.py as a module (the benchmarks folder is not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "cp_prefill.py"
    spec = importlib.util.spec_from_file_location("cp_prefill_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cases_worker(rank: int, world: int, cases: list, out_dir: str, bench_argv: list | None = None,
                 cli_argv: list | None = None):
    """Each case runs on the first `case['world']` ranks (a subgroup when smaller than the world);
    then, on the whole world, the benchmark script (`bench_argv`) and `python -m orthros.parallel`
    (`cli_argv`, stdout saved per rank)."""
    torch.set_num_threads(1)
    groups = {w: (None if w == world else dist.new_group(list(range(w)))) for w in sorted({c["world"] for c in cases})}
    for i, case in enumerate(cases):
        w = case["world"]
        if rank < w:
            logits = run_case(case, CPGroup(groups[w]))
            torch.save(logits.cpu() if torch.is_tensor(logits) else logits, os.path.join(out_dir, f"case{i}_rank{rank}.pt"))
    if bench_argv is not None:
        load_bench().main(bench_argv)
    if cli_argv is not None:
        import contextlib
        import io

        from orthros.parallel.__main__ import main

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = main(cli_argv)
        with open(os.path.join(out_dir, f"cli_rank{rank}.txt"), "w") as f:
            f.write(f"{code}\n{buf.getvalue()}")
    if world > 1:
        dist.barrier()


def sharded_partials(q, k, v, q_slot, q_doc, k_doc, window, cuts, key_chunk=4):
    """`partial_attention` over the key shards `cuts` [(a, b)], merged by lse: (o, lse)."""
    from orthros.parallel import lse_merge, partial_attention

    parts = [partial_attention(q, k[:, a:b], v[:, a:b], q_slot - a, q_doc, k_doc[:, a:b], window, key_chunk=key_chunk)
             for a, b in cuts]
    return lse_merge(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))


def partials_case(seed: int = 0):
    """Queries over 41 keys of two rows (one padded, one query that sees nothing), and the key shards."""
    g = torch.Generator().manual_seed(seed)
    B, M, H, Hkv, D, S = 2, 3, 4, 2, 16, 41
    q = torch.randn(B, M, H, D, generator=g)
    k, v = torch.randn(B, S, Hkv, D, generator=g), torch.randn(B, S, Hkv, D, generator=g)
    q_slot = torch.tensor([[40, 25, 3]])
    q_doc = torch.tensor([[0, 0, 0], [1, 1, -2]])
    k_doc = torch.zeros(B, S, dtype=torch.long)
    k_doc[1] = 1
    k_doc[1, 30:] = -1
    return (q, k, v, q_slot, q_doc, k_doc), [(0, 5), (5, 22), (22, 23), (23, 41)]


def check_triton_partials() -> str:
    """Run under TRITON_INTERPRET=1: the split-KV kernel's (o, lse) through `partial_attention`
    merge to the reference op's. Returns the worst relative error as text."""
    from orthros.ops.naive import naive_attention

    errs = []
    for window in (None, 7):
        args, cuts = partials_case()
        ref, ref_lse = naive_attention(*args, window=window, return_lse=True)
        o, lse = sharded_partials(*args, window, cuts)
        seen = torch.isfinite(ref_lse)
        assert torch.equal(seen, torch.isfinite(lse))
        errs += [((o - ref).norm() / ref.norm()).item(), ((lse - ref_lse)[seen].norm() / ref_lse[seen].norm()).item()]
    return f"max_err={max(errs):.3g}"
