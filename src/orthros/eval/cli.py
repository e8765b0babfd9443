"""Evaluate a saved model: MQAR recall, passkey retrieval, held-out perplexity.

    orthros eval runs/demo --task mqar passkey ppl
    orthros eval runs/demo --task mqar --mqar-lengths 256 512 1024 --mqar-kv-pairs 16

Prints one table per task and writes `eval.json` (and the passkey heatmap
`passkey.png`) to --out (default: MODEL/eval). Every generator is seeded:
two models evaluated with the same flags see the same questions.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..errors import count_arg

TASKS = ("mqar", "passkey", "ppl")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory (config.json + model.safetensors)")
    p.add_argument("--task", nargs="+", default=list(TASKS), help=f"any of {', '.join(TASKS)} (default: all)")
    p.add_argument("--out", default=None, help="where eval.json and plots go (default MODEL/eval)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch-size", type=count_arg(1), default=16)
    p.add_argument("--seed", type=int, default=1234, help="seed of every generator")
    p.add_argument("--attn-backend", default=None, help="override the model's attention op (auto, naive, ...)")
    g = p.add_argument_group("mqar")
    g.add_argument("--mqar-lengths", type=count_arg(1), nargs="+", default=[128, 256, 512])
    g.add_argument("--mqar-kv-pairs", type=count_arg(1), default=8)
    g.add_argument("--mqar-vocab", type=count_arg(4), default=None,
                   help="MQAR token range (default min(model vocab, 256))")
    g.add_argument("--mqar-power-a", type=float, default=0.01, help="query gap power law p(g) ~ g^(a-1)")
    g.add_argument("--mqar-samples", type=count_arg(1), default=256, help="sequences per length")
    g.add_argument("--mqar-filler", choices=["random", "zero"], default="random",
                   help="filler between queries: random value tokens (zoology's default) or token 0")
    g = p.add_argument_group("passkey")
    g.add_argument("--passkey-lengths", type=count_arg(1), nargs="+", default=[256, 512, 1024])
    g.add_argument("--passkey-depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    g.add_argument("--passkey-samples", type=count_arg(1), default=10, help="samples per (length, depth) cell")
    g.add_argument("--passkey-digits", type=count_arg(1), default=5)
    g = p.add_argument_group("perplexity")
    g.add_argument("--ppl-data", default="stdlib", help="'stdlib' (held-out split) or a text file / directory")
    g.add_argument("--ppl-seq-len", type=count_arg(2), default=1024,
                   help="tokens per row (the context each token sees)")
    g.add_argument("--ppl-chunk-size", type=count_arg(1), default=256, help="rows are fed through the cache in chunks")
    g.add_argument("--ppl-max-tokens", type=count_arg(1), default=100_000)


def load_model(path: str, device: str, dtype: str = "float32", attn_backend: str | None = None):
    """(model, tokenizer) of a model directory; everything is checked before a weight is read."""
    from ..data.tokenizer import load_tokenizer
    from ..loading import check_model_dir, load_model as load_checked, resolve_device

    dev = resolve_device(device)
    config = check_model_dir(path)
    tok = load_tokenizer(path, config.vocab_size)
    model = load_checked(path, dtype=getattr(torch, dtype), config=config).to(dev).eval()
    if attn_backend is not None:
        set_backend(model, attn_backend)
    return model, tok


def set_backend(model, backend: str) -> None:
    """Switch every attention layer of a loaded model to another op (same results, other speed)."""
    from ..ops import BACKENDS

    if backend not in BACKENDS:
        raise ValueError(f"--attn-backend must be one of {BACKENDS}, got {backend!r}")
    model.config.attn_backend = backend
    for m in model.modules():
        if hasattr(m, "backend"):
            m.backend = backend


def run_tasks(model, tok, args, out: Path) -> dict:
    from .mqar import MQARConfig
    from .passkey import PasskeyConfig
    from .tasks import eval_mqar, eval_passkey, eval_perplexity, passkey_heatmap

    results = {}
    if "mqar" in args.task:
        vocab = args.mqar_vocab or min(model.config.vocab_size, 256)
        cfg = MQARConfig(seq_len=max(args.mqar_lengths), num_kv_pairs=args.mqar_kv_pairs, vocab_size=vocab,
                         power_a=args.mqar_power_a, random_filler=args.mqar_filler == "random")
        for L in args.mqar_lengths:
            MQARConfig(**{**cfg.__dict__, "seq_len": L}).validate()
        results["mqar"] = eval_mqar(model, args.mqar_lengths, cfg, args.mqar_samples, args.seed, args.batch_size)
    if "passkey" in args.task:
        cfg = PasskeyConfig(args.passkey_lengths, args.passkey_depths, args.passkey_samples, args.passkey_digits)
        results["passkey"] = eval_passkey(model, tok, cfg, args.seed, max(1, args.batch_size // 2))
        passkey_heatmap(results["passkey"], out / "passkey.png", f"passkey retrieval: {Path(args.model).name}")
    if "ppl" in args.task:
        results["ppl"] = eval_perplexity(model, tok, args.ppl_seq_len, args.ppl_chunk_size, args.ppl_max_tokens,
                                         max(1, args.batch_size // 4), args.ppl_data)
    return results


def format_results(results: dict) -> str:
    lines = []
    if "mqar" in results:
        r = results["mqar"]
        lines.append(f"MQAR accuracy ({r['config']['num_kv_pairs']} kv pairs, {r['samples']} sequences per length)")
        lines.append("  length  " + "".join(f"{L:>8}" for L in r["by_length"]) + "    mean")
        lines.append("  acc %   " + "".join(f"{100 * a:8.1f}" for a in r["by_length"].values())
                     + f"{100 * r['mean']:8.1f}")
        lines.append("  by key-query distance: " + ", ".join(f"{k}: {100 * v:.1f}%" for k, v in r["by_distance"].items()))
    if "passkey" in results:
        r = results["passkey"]
        lengths, depths = r["config"]["lengths"], r["config"]["depths"]
        lines.append(f"passkey accuracy % (rows: depth, columns: length; {r['config']['samples']} samples per cell)")
        lines.append("  depth   " + "".join(f"{L:>8}" for L in lengths))
        for d in depths:
            lines.append(f"  {d:<6g}  " + "".join(f"{100 * r['grid'][f'{L}/{d:g}']:8.1f}" for L in lengths))
        lines.append(f"  mean    {100 * r['mean']:.1f}")
    if "ppl" in results:
        r = results["ppl"]
        lines.append(f"perplexity ({r['source']}, rows of {r['seq_len']}, {r['tokens']} tokens): {r['ppl']:.3f}"
                     f" (nll {r['nll']:.4f} nats/token)")
    return "\n".join(lines)


def check_args(args) -> None:
    """Range checks (and the held-out file) before the model is loaded."""
    bad = [t for t in args.task if t not in TASKS]
    if bad:
        raise ValueError(f"--task: unknown task(s) {', '.join(bad)}; choose from {', '.join(TASKS)}")
    if any(not 0 <= d <= 1 for d in args.passkey_depths):
        raise ValueError(f"--passkey-depths must lie in [0, 1], got {args.passkey_depths}")
    if "ppl" in args.task and args.ppl_data != "stdlib":
        from ..data.sources import expand_paths, read_text

        for f in expand_paths([args.ppl_data]):  # a binary or empty file fails here, naming it
            read_text(f)


def run(args) -> int:
    from ..errors import check_output_dir

    check_args(args)
    out = check_output_dir(Path(args.out) if args.out else Path(args.model) / "eval", "--out")
    model, tok = load_model(args.model, args.device, args.dtype, args.attn_backend)
    out.mkdir(parents=True, exist_ok=True)
    results = run_tasks(model, tok, args, out)
    print(format_results(results))
    (out / "eval.json").write_text(json.dumps({"model": str(args.model), **results}, indent=2))
    print(f"saved {out / 'eval.json'}" + (f" and {out / 'passkey.png'}" if "passkey" in results else ""))
    return 0
