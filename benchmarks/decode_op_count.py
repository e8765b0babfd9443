"""Ops one eager decode step dispatches, per variant and per layer: a device-free count of what a
captured decode step launches (each op that is not a view is a kernel there).

    python benchmarks/decode_op_count.py                                  # tiny-moe: full, independent, bound, base
    python benchmarks/decode_op_count.py --model tiny --variants full orthros

Each variant's model (random weights, fp32, on the CPU) prefills 12 tokens, takes one decode step
(`decode_one_token_fast`), then a second one under a dispatch counter. The per-layer figure is the
difference between a model of --layers L+2 and one of L layers, over 2; the rest of a step is the
per-step figure. MoE layers run their plain loop here (the fused Triton step needs a GPU), so the
expert part differs from a GPU's; the routing, attention and the rest are the ops a GPU runs.
Prints a table, writes JSON to --out.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

VIEWS = {"view", "_unsafe_view", "reshape", "slice", "select", "expand", "as_strided", "unsqueeze", "squeeze", "t",
         "transpose", "permute", "detach", "alias", "unbind", "split", "split_with_sizes", "narrow", "lift_fresh",
         "empty", "empty_like", "empty_strided"}
VARIANTS = {"full": ("full", "independent"), "orthros": ("orthros", "independent"),
            "orthros-bound": ("orthros", "bound"), "orthros-base": ("orthros", "base")}


class Count(TorchDispatchMode):
    """Counts each op dispatched inside it by name, views left out."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def step_ops(model_name: str, variant: str, layers: int) -> collections.Counter:
    from orthros import OrthrosConfig, OrthrosForCausalLM
    from orthros.generate import decode_one_token_fast, new_static_cache, prefill

    attention, routing = VARIANTS[variant]
    torch.manual_seed(0)
    extra = {"output_routing": routing} if OrthrosConfig.from_name(model_name).num_experts else {}
    cfg = OrthrosConfig.from_name(model_name, attention=attention, window_size=4, num_hidden_layers=layers, **extra)
    model = OrthrosForCausalLM(cfg).eval()
    ids = torch.randint(0, min(200, cfg.vocab_size), (1, 12))
    with torch.no_grad():
        cache = new_static_cache(model, 1, 32)
        prefill(model, ids, cache=cache)
        decode_one_token_fast(model, ids[:, -1], cache)  # first-call work (kept shapes) out of the count
        with Count() as c:
            decode_one_token_fast(model, ids[:, -2], cache)
    return c.ops


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-moe", help="config name")
    p.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=list(VARIANTS))
    p.add_argument("--layers", type=int, default=3, help="the smaller model's layers (the other has 2 more)")
    p.add_argument("--out", default="benchmarks/results/moe/decode-op-count.json")
    a = p.parse_args(argv)
    if a.layers < 2:
        raise SystemExit("--layers: at least 2 (the last layer differs from the others)")
    rows = []
    for v in a.variants:
        small, big = step_ops(a.model, v, a.layers), step_ops(a.model, v, a.layers + 2)
        layer = {k: (big[k] - small[k]) / 2 for k in set(small) | set(big) if big[k] != small[k]}
        per_layer = sum(layer.values())
        rows.append(dict(variant=v, step=sum(small.values()), layers=a.layers, per_layer=per_layer,
                         per_step=sum(small.values()) - per_layer * a.layers, layer_ops=dict(sorted(layer.items()))))
    ref = rows[0]
    lines = [f"| variant | ops a step ({a.layers} layers) | a layer | the rest of a step | a layer against "
             f"{ref['variant']} |", "| --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        mine, theirs = r["layer_ops"], ref["layer_ops"]
        diff = {k: mine.get(k, 0) - theirs.get(k, 0) for k in set(mine) | set(theirs)}
        diff = ", ".join(f"{k} {v:+g}" for k, v in sorted(diff.items()) if v)
        lines.append(f"| {r['variant']} | {r['step']} | {r['per_layer']:g} | {r['per_step']:g} | {diff or '-'} |")
    print("\n".join(lines))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/decode_op_count.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out.write_text(json.dumps(dict(command=command.strip(), model=a.model, torch=torch.__version__,
                                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), rows=rows), indent=1))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"saved {out}, {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
