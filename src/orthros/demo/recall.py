"""`orthros demo --recall`: tiny models trained live — recall of full attention, prefill of a sliding window.

Trains three tiny models of the same size on the same data for the same
steps — Orthros, a full-attention Transformer and sliding-window attention
(SWA) — on multi-query associative recall (MQAR) mixed with this machine's
Python sources. Then it measures

  1. recall: MQAR accuracy at sequence lengths far beyond the window W,
  2. prefill: the time to read a prompt and predict one token
     (`logits_to_keep=1`), Orthros vs full attention, at growing lengths,

prints both tables, saves a plot, saves the Orthros model and lets it write
some Python. No download, no GPU; `--quick` runs it in seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..data.tokenizer import ByteTokenizer
from ..errors import count_arg, positive_arg
from ..eval.mqar import MQARConfig
from ..eval.tasks import eval_mqar
from ..experiments.presets import LABELS, Preset
from ..experiments.recall import TrainData, train_model
from ..generate import generate

ARCHS = ("orthros", "full", "swa")
COLORS = {"orthros": "tab:blue", "full": "tab:orange", "swa": "tab:green"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The recall demo's own flags (--window, --max-new-tokens, --prompt, --out, --seed are shared)."""
    p.add_argument("--seconds", type=positive_arg, default=90.0,
                   help="--recall: training time of the Orthros model (default 90); the baselines get the same steps")
    p.add_argument("--quick", action="store_true", help="--recall: a smoke run in seconds (tiny budgets everywhere)")
    p.add_argument("--seq-len", type=count_arg(32), default=128,
                   help="--recall: training sequence length (MQAR and text)")
    p.add_argument("--batch-size", type=count_arg(1), default=8,
                   help="--recall: text sequences per step (MQAR: 4x as many)")
    p.add_argument("--lr", type=positive_arg, default=1e-3, help="--recall: learning rate")
    p.add_argument("--mqar-lengths", type=int, nargs="+", default=None,
                   help="--recall: MQAR evaluation lengths (default: 2x, 4x, 8x the training length)")


DEFAULTS = {"window": 32, "max_new_tokens": 200, "prompt": "def read_config(path):\n    ", "out": "runs/demo",
            "prefill_lengths": None}


def demo_preset(args) -> Preset:
    return Preset(hidden_size=64 if args.quick else 128, layers=2, heads=4, kv_heads=2, window=args.window,
                  lr=args.lr, warmup=20, mqar_train=MQARConfig(seq_len=args.seq_len, num_kv_pairs=4, vocab_size=32),
                  mqar_batch=4 * args.batch_size, text_seq_len=args.seq_len, text_batch=args.batch_size,
                  passkey_batch=0, text_bytes=200_000 if args.quick else 4_000_000)


@torch.no_grad()
def time_prefill(model, length: int, repeats: int = 3) -> float:
    """Median seconds of one prefill forward (`logits_to_keep=1`) of a [1, length] prompt."""
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
    model(ids[:, :64], logits_to_keep=1, use_cache=False)  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        model(ids, logits_to_keep=1, use_cache=False)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def plot(res: dict, W: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for arch, r in res["recall"].items():
        Ls = [int(L) for L in r["mqar"]]
        a.plot(Ls, [100 * x for x in r["mqar"].values()], "o-", color=COLORS[arch], label=LABELS[arch])
    a.set(xscale="log", xlabel="sequence length (tokens)", ylabel="MQAR accuracy %", ylim=(-3, 103),
          title=f"recall far beyond the window (W = {W})")
    a.set_xticks(Ls, [f"{L}\n({L // W}W)" for L in Ls])
    a.minorticks_off()
    a.legend()
    Ls = [int(L) for L in res["prefill"]]
    for arch in ("full", "orthros"):
        b.plot(Ls, [1000 * res["prefill"][str(L)][arch] for L in Ls], "o-", color=COLORS[arch], label=LABELS[arch])
    b.set(xscale="log", yscale="log", xlabel="prompt length (tokens)", ylabel="prefill time (ms)",
          title=f"prefill, logits_to_keep=1 ({res['device']})")
    b.set_xticks(Ls, [str(L) for L in Ls])
    b.minorticks_off()
    b.legend()
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check_args(args) -> None:
    """Every range check before the minutes of training."""
    from ..errors import UserError, check_output_dir

    if not args.prompt:
        raise UserError("--prompt must not be empty")
    mqar = demo_preset(args).mqar_train
    for L in args.mqar_lengths or []:
        try:
            dataclasses.replace(mqar, seq_len=L).validate()
        except ValueError as e:
            raise UserError(f"--mqar-lengths {L}: {e}") from None
    check_output_dir(args.out, "--out")


def run(args) -> int:
    check_args(args)
    if args.quick:
        args.seconds = min(args.seconds, 3.0)
        args.max_new_tokens = min(args.max_new_tokens, 20)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    preset = demo_preset(args)
    W, T = args.window, args.seq_len
    mqar_lengths = args.mqar_lengths or ([T, 2 * T] if args.quick else [2 * T, 4 * T, 8 * T])
    prefill_lengths = args.prefill_lengths or ([256, 512] if args.quick else [2048, 4096, 8192, 16384])
    print(f"Orthros demo on {torch.get_num_threads()} CPU thread(s): three models of one size, window W={W}, "
          f"trained on MQAR + Python sources (sequences of {T} tokens), then evaluated at up to "
          f"{max(mqar_lengths)} tokens ({max(mqar_lengths) // W}W).")
    # Test queries spread evenly over the sequence (power_a=1), so most keys lie far beyond
    # the window; training uses zoology's power law, which puts most queries near their keys.
    eval_cfg = dataclasses.replace(preset.mqar_train, power_a=1.0)
    data = TrainData(preset, args.seed)
    models, res = {}, {"recall": {}, "prefill": {}, "device": "cpu", "window": W, "seq_len": T}
    steps = None
    for i, arch in enumerate(ARCHS):
        desc = f"[{i + 1}/3] train {LABELS[arch]}"
        if steps is None:  # the first (Orthros) sets the step count by the time budget
            model, stats = train_model(arch, preset, data, args.seed, "cpu", desc, seconds=args.seconds)
            steps = stats["steps"]
        else:
            model, stats = train_model(arch, preset, data, args.seed, "cpu", desc, steps=steps)
        acc = eval_mqar(model, mqar_lengths, eval_cfg, 32 if args.quick else 128, seed=1234, batch_size=16)
        models[arch] = model
        res["recall"][arch] = {"steps": stats["steps"], "seconds": stats["seconds"],
                               "params": sum(p.numel() for p in model.parameters()),
                               "mqar": acc["by_length"], "mqar_by_distance": acc["by_distance"]}
        print(f"  {LABELS[arch]:<19} {stats['steps']} steps in {stats['seconds']:.0f}s; MQAR accuracy "
              + ", ".join(f"{L}: {100 * a:.0f}%" for L, a in acc["by_length"].items()), flush=True)

    for L in tqdm(prefill_lengths, desc="prefill timing", leave=False):
        res["prefill"][str(L)] = {arch: time_prefill(models[arch], L) for arch in ("full", "orthros")}

    # ------------------------------------------------------------- report
    cols = [f"{L} ({L // W}W)" for L in mqar_lengths]
    print(f"\nRecall: MQAR accuracy % ({preset.mqar_train.num_kv_pairs} key-value pairs, queries spread evenly; "
          f"guessing among the context's values: {100 / preset.mqar_train.num_kv_pairs:.0f}%)")
    print(f"  {'model':<20}{'params':>9}{'steps':>7}" + "".join(f"{c:>13}" for c in cols))
    for arch, r in res["recall"].items():
        print(f"  {LABELS[arch]:<20}{r['params'] / 1e6:>8.2f}M{r['steps']:>7}"
              + "".join(f"{100 * a:>13.1f}" for a in r["mqar"].values()))
    print("\nPrefill (logits_to_keep=1, batch 1, median of 3): milliseconds on this CPU")
    print(f"  {'length':>8}{'full':>12}{'Orthros':>12}{'speed-up':>10}")
    for L, t in res["prefill"].items():
        print(f"  {L:>8}{1000 * t['full']:>12.1f}{1000 * t['orthros']:>12.1f}{t['full'] / t['orthros']:>9.1f}x")
    plot(res, W, out / "demo.png")
    (out / "demo.json").write_text(json.dumps(res, indent=2))
    models["orthros"].save_pretrained(out)
    print(f"\nsaved the Orthros model to {out}/ (try: orthros generate {out} --prompt 'import os'), "
          f"the plot to {out / 'demo.png'}")

    tok = ByteTokenizer()
    ids = generate(models["orthros"], [tok.encode(args.prompt)], max_new_tokens=args.max_new_tokens,
                   temperature=0.8, top_k=40, seed=args.seed)
    print("-" * 60)
    print(tok.decode(ids[0].tolist()))
    print("-" * 60)
    return 0
