"""The three evaluations, as functions of a model: MQAR, passkey, perplexity.

Each returns a plain dict (JSON-ready). Generators are seeded, so two runs
(or two architectures) see exactly the same questions.
"""

from __future__ import annotations

import dataclasses

import torch
from tqdm import tqdm

from ..data.stdlib import stdlib_text
from ..data.tokenizer import encode
from .mqar import MQARConfig, key_distances, mqar_batch
from .passkey import PasskeyConfig, passkey_batch
from .perplexity import perplexity
from .scoring import answer_hits

DISTANCE_BINS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 1 << 30)


def eval_mqar(model, lengths: list[int], cfg: MQARConfig, samples: int = 256, seed: int = 1234,
              batch_size: int = 16, progress: bool = True) -> dict:
    """Accuracy over answers at each sequence length, and by key-to-query distance."""
    if cfg.vocab_size > model.config.vocab_size:
        raise ValueError(f"mqar vocab_size={cfg.vocab_size} exceeds the model's vocabulary ({model.config.vocab_size})")
    out = {"config": dataclasses.asdict(cfg), "samples": samples, "seed": seed, "by_length": {}, "by_distance": {}}
    hit_d, all_d = torch.zeros(len(DISTANCE_BINS) - 1), torch.zeros(len(DISTANCE_BINS) - 1)
    bar = tqdm(total=samples * len(lengths), desc="mqar", unit="seq", disable=not progress, leave=False)
    for L in lengths:
        c = dataclasses.replace(cfg, seq_len=L)
        ids, labels = mqar_batch(samples, c, seed=seed + L)
        hits = answer_hits(model, ids, labels, batch_size, bar)
        mask = labels != -100
        out["by_length"][str(L)] = hits.sum().item() / mask.sum().item()
        dist = key_distances(ids, labels, c.num_kv_pairs)[mask]
        b = torch.bucketize(dist, torch.tensor(DISTANCE_BINS[1:]), right=True)
        hit_d += torch.bincount(b, hits[mask].float(), len(DISTANCE_BINS) - 1)
        all_d += torch.bincount(b, minlength=len(DISTANCE_BINS) - 1).float()
    bar.close()
    for i in range(len(DISTANCE_BINS) - 1):
        if all_d[i] > 0:
            out["by_distance"][f"{DISTANCE_BINS[i]}-{DISTANCE_BINS[i + 1] - 1}"] = (hit_d[i] / all_d[i]).item()
    out["mean"] = sum(out["by_length"].values()) / len(lengths)
    return out


def heldout_tokens(tok, max_chars: int, source: str = "stdlib") -> list[int]:
    """Token ids of held-out text: the stdlib held-out split, or a text file / directory."""
    if source == "stdlib":
        text = stdlib_text("heldout", max_bytes=max_chars)
    else:
        from ..data.sources import expand_paths, read_text

        text = "\n\n".join(read_text(p) for p in expand_paths([source]))[:max_chars]
    return encode(tok, text)


def eval_passkey(model, tok, cfg: PasskeyConfig, seed: int = 1234, batch_size: int = 8,
                 haystack: list[int] | None = None, progress: bool = True) -> dict:
    """Exact-match accuracy of the pass key for every (length, depth) cell."""
    cfg.validate()
    if haystack is None:
        haystack = heldout_tokens(tok, max(200_000, 8 * max(cfg.lengths)))
    grid = {}
    bar = tqdm(total=cfg.samples * len(cfg.lengths) * len(cfg.depths), desc="passkey", unit="seq",
               disable=not progress, leave=False)
    for L in cfg.lengths:
        for j, d in enumerate(cfg.depths):
            ids, labels, _ = passkey_batch(haystack, lambda s: encode(tok, s), cfg.samples, L, d, cfg.digits,
                                           seed=seed + 1000 * L + j)
            hits = answer_hits(model, ids, labels, batch_size, bar)
            ok = (hits | (labels == -100)).all(1)  # every answer token right
            grid[f"{L}/{d:g}"] = ok.float().mean().item()
    bar.close()
    return {"config": dataclasses.asdict(cfg), "seed": seed, "grid": grid,
            "mean": sum(grid.values()) / len(grid)}


def eval_perplexity(model, tok, seq_len: int = 1024, chunk_size: int | None = None, max_tokens: int = 200_000,
                    batch_size: int = 4, source: str = "stdlib", progress: bool = True) -> dict:
    """Perplexity (per token) of held-out text, rows of `seq_len` fed in chunks through the cache."""
    ids = torch.tensor(heldout_tokens(tok, 6 * max_tokens, source)[:max_tokens], dtype=torch.long)
    rows = ids.numel() // seq_len
    bar = tqdm(total=rows, desc="perplexity", unit="row", disable=not progress, leave=False)
    res = perplexity(model, ids, seq_len, chunk_size, batch_size, progress=bar)
    bar.close()
    return {**res, "seq_len": seq_len, "chunk_size": chunk_size, "source": source}


def passkey_heatmap(result: dict, path, title: str = "passkey retrieval") -> None:
    """Save the (length x depth) accuracy grid as a PNG heatmap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths, depths = result["config"]["lengths"], result["config"]["depths"]
    acc = [[result["grid"][f"{L}/{d:g}"] for L in lengths] for d in depths]
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.0 + 0.5 * len(depths)))
    im = ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for i, row in enumerate(acc):
        for j, a in enumerate(row):
            ax.text(j, i, f"{100 * a:.0f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [str(L) for L in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
