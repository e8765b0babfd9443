"""Peak memory of `orthros convert` on a synthetic Llama-3.1-8B-shaped checkpoint.

    python benchmarks/convert_memory.py --workdir /tmp/convmem              # full 32 layers (~16 GB bf16 on disk, x2)
    python benchmarks/convert_memory.py --workdir /tmp/convmem --layers 8   # smaller; extrapolate

Writes a bf16 checkpoint with Llama-3.1-8B's shapes (vocab 128256, hidden
4096, 32 layers, 5 GB shards) tensor by tensor (contents: a tiled random
block; values do not matter here), then converts it in a child process and
reports that process's peak RSS (VmHWM) minus its RSS once everything is
imported, i.e. the memory the conversion itself needed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

CHILD = r"""
import json, sys, time
import orthros
from orthros.convert import convert_checkpoint

def status():
    out = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[k] = int(v.split()[0]) * 1024
    return out

base = status()
t = time.time()
convert_checkpoint(sys.argv[1], sys.argv[2], window_size=128, dtype=sys.argv[3], progress=False)
end = status()
print(json.dumps({"baseline": base, "end": end, "seconds": time.time() - t}))
"""


def write_synthetic(src: Path, layers: int) -> int:
    from orthros.convert.safetensors_stream import PlannedTensor, ShardWriter, plan_shards
    from orthros.convert.tiny import tiny_hf_config

    cfg = tiny_hf_config("llama", 128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                         initializer_range=0.02)
    cfg.rope_parameters["original_max_position_embeddings"] = 8192
    src.mkdir(parents=True)
    (src / "config.json").write_text(cfg.to_json_string())
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    planned = [PlannedTensor(k, s, torch.bfloat16) for k, s in shapes.items()]
    shards = plan_shards(planned, 5 * 10**9)
    block = torch.randn(16 << 20, dtype=torch.bfloat16) * 0.02  # 32 MB, tiled
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        with ShardWriter(src / name, shard) as w:
            for t in shard:
                weight_map[t.name] = name
                n = t.nbytes // 2
                flat_rows = max(1, (16 << 20) // max(1, n // t.shape[0]))
                for r0 in range(0, t.shape[0], flat_rows):
                    r1 = min(t.shape[0], r0 + flat_rows)
                    m = (r1 - r0) * (n // t.shape[0])
                    w.write(t.name, block[:m].reshape((r1 - r0,) + t.shape[1:]))
                total += t.nbytes
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--workdir", required=True, help="scratch directory (needs ~2x the checkpoint size free)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints")
    args = p.parse_args()
    work = Path(args.workdir)
    if work.exists():
        raise SystemExit(f"{work} exists; give a new scratch directory")
    try:
        t = time.time()
        size = write_synthetic(work / "src", args.layers)
        print(f"wrote synthetic checkpoint: {size / 1e9:.2f} GB, {args.layers} layers, {time.time() - t:.0f} s")
        out = subprocess.run([sys.executable, "-c", CHILD, str(work / "src"), str(work / "dst"), args.dtype],
                             check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        out_size = sum(f.stat().st_size for f in (work / "dst").glob("*.safetensors"))
        gb = 1 / 2**30
        print(f"converted to {args.dtype}: {out_size / 1e9:.2f} GB in {r['seconds']:.0f} s")
        print(f"RSS after imports:       {r['baseline']['VmRSS'] * gb:.2f} GiB")
        print(f"peak RSS (VmHWM):        {r['end']['VmHWM'] * gb:.2f} GiB")
        print(f"extra for conversion:    {(r['end']['VmHWM'] - r['baseline']['VmRSS']) * gb:.2f} GiB")
        print(f"RssAnon / RssFile at end: {r['end']['RssAnon'] * gb:.2f} / {r['end']['RssFile'] * gb:.2f} GiB")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
