"""Does the sink also bring back retrieval, zero-shot? The pass key through the chat template,
SmolLM2-135M-Instruct converted to Orthros (W = 128) untrained, with and without a base window
that also sees the first token (the library's `sink_tokens`, set on the loaded model; the first run,
2026-12-04 afternoon, patched the reference op's mask with the same result on unpadded rows).
A CPU run.

    PYTHONPATH=src .venv/bin/python benchmarks/sink_passkey_probe.py --samples 4

One prompt at a time (no left padding); greedy, `eval.longrange.chat_passkey`'s prompts and scoring.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import sink_probe  # noqa: E402  (its mask patch and model loading)

from orthros.eval.longrange import chat_passkey  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    ap.add_argument("--samples", type=int, default=4, help="keys per length and depth")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--backend", default="naive", help="the attention op (naive: the reference, as first run)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default="/tmp/sink")
    ap.add_argument("--out", default="/tmp/sink/sink_passkey_probe.json")
    args = ap.parse_args()
    t0 = time.time()
    model, tok = sink_probe.zero_shot(Path(args.work), args.window, args.threads)
    sink_probe.set_backend(model, args.backend)
    results = {}
    for S in (0, 1):
        sink_probe.set_sinks(model, S)
        t1 = time.time()
        with torch.no_grad():
            r = chat_passkey(model, tok, args.lengths, args.depths, args.samples, batch_size=1)
        results[f"orthros+sink{S}" if S else "orthros"] = r
        print(f"sinks {S}: pass key by length {r['by_length']} ({time.time() - t1:.0f}s); "
              f"e.g. {[e['answer'] for e in r['examples'][:3]]}", flush=True)
    sink_probe.set_sinks(model, 0)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results, "seconds": time.time() - t0},
                                         indent=1))


if __name__ == "__main__":
    main()
