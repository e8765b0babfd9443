"""Weights for the tokens that need a long context (LongCE, with the source as the judge).

A converted model keeps, inside its window, what its source knew; what it has to learn again
is what lies past the window. Most tokens of a long row are predicted as well from the last W
tokens as from the whole row; a few (a name defined pages earlier, the second copy of a
passage) are not. LongCE ("What is Wrong with Perplexity for Long-context Language Modeling?",
ICLR 2025) finds them by comparing a model's prediction with the whole context and with a
short one, and weighs each token's loss by the ratio of the two probabilities, capped.

Here the judge is the source itself, once with full attention and once with the student's
window (sliding-window attention with the same sinks):

    w_t = min(p_full(x_t | x_<t) / p_window(x_t | x_<t), cap)

computed once for every training row before training (two no-grad forwards per row), so the
training step costs what it did. w_t is about 1 where the window is enough, up to `cap` where
only the far context gives the token, and below 1 where the far context misleads the source.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch


@torch.no_grad()
def long_context_weights(full, windowed, rows: np.ndarray, cap: float, device, batch: int = 1,
                         progress: bool = True) -> np.ndarray:
    """[N, T] float16 weights of `rows` [N, T] (indexed like labels: w[:, t] weighs predicting
    x_t): min(exp(log p_full - log p_windowed), cap); w[:, 0] = 1. The next-token losses are
    `eval.longrange.token_losses`', `block` rows at a time."""
    if cap < 1:
        raise ValueError(f"long_weight_cap={cap}: the cap is the largest weight, at least 1 (0 turns the weights off)")
    from tqdm.auto import tqdm

    from ..eval.longrange import token_losses

    cuda = torch.device(device).type == "cuda"
    out = np.ones(rows.shape, np.float16)
    block = 64 * batch  # rows whose int64 ids and losses are held at once
    with tqdm(total=2 * len(rows), desc="long-context weights", unit="row", disable=not progress, leave=False) as bar:
        for i in range(0, len(rows), block):
            x = torch.from_numpy(rows[i : i + block].astype(np.int64))
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                gain = token_losses(windowed, x, batch, bar) - token_losses(full, x, batch, bar)  # log p_full - log p_W
            out[i : i + block, 1:] = gain.exp().clamp(max=cap).numpy()
    return out


def source_long_weights(orthros_dir, rows: np.ndarray, window: int, sinks: int, cap: float, device,
                        work: Path) -> np.ndarray:
    """`long_context_weights` with the converted source as the judge (full attention, and
    sliding-window attention at `window` with `sinks` sinks), kept under `work` (.npy, named by the
    window, sinks, cap and rows) for every arm of the run that asks for the same ones."""
    digest = hashlib.sha1(rows[:, :64].tobytes()).hexdigest()[:10]
    cache = Path(work) / f"long-weights-w{window}-s{sinks}-cap{cap:g}-{digest}.npy"
    if cache.exists():
        w = np.load(cache)
        if w.shape == rows.shape:
            return w
    from ..train.distill import load_teacher

    full = load_teacher(orthros_dir, device, torch.float32, attention="full")
    windowed = load_teacher(orthros_dir, device, torch.float32, attention="swa", window_size=window, sink_tokens=sinks)
    w = long_context_weights(full, windowed, rows, cap, device)
    del full, windowed
    tmp = cache.with_suffix(".tmp.npy")
    np.save(tmp, w)
    tmp.replace(cache)
    return w
