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

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


@torch.no_grad()
def token_logprobs(model, x: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
    """log p(x_t | x_<t) [B, T] (fp32; t = 0, which has no context, gets 0), the LM head applied
    `chunk` positions at a time."""
    rows = model(input_ids=x, use_cache=False, lm_head=False).output_rows  # [B, T, C]: every position
    head = model.get_output_embeddings()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for s in range(0, x.shape[1] - 1, chunk):
        e = min(s + chunk, x.shape[1] - 1)
        logits = head(rows[:, s:e]).float()
        out[:, s + 1 : e + 1] = -F.cross_entropy(logits.transpose(1, 2), x[:, s + 1 : e + 1], reduction="none")
    return out


@torch.no_grad()
def long_context_weights(full, windowed, rows: np.ndarray, cap: float, device, batch: int = 1,
                         progress: bool = True) -> np.ndarray:
    """[N, T] float16 weights of `rows` [N, T] (indexed like labels: w[:, t] weighs predicting
    x_t): min(exp(log p_full - log p_windowed), cap); w[:, 0] = 1."""
    if cap < 1:
        raise ValueError(f"long_weight_cap={cap}: the cap is the largest weight, at least 1 (0 turns the weights off)")
    from tqdm.auto import tqdm

    dev = torch.device(device)
    out = np.empty(rows.shape, np.float16)
    for i in tqdm(range(0, len(rows), batch), desc="long-context weights", unit="row", unit_scale=batch,
                  disable=not progress, leave=False):
        x = torch.from_numpy(rows[i : i + batch].astype(np.int64)).to(dev)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            gain = token_logprobs(full, x) - token_logprobs(windowed, x)
        out[i : i + batch] = gain.exp().clamp(max=cap).cpu().numpy()
    return out


def source_long_weights(orthros_dir, rows: np.ndarray, window: int, sinks: int, cap: float, device,
                        cache: Path) -> np.ndarray:
    """`long_context_weights` with the converted source as the judge (full attention, and
    sliding-window attention at `window` with `sinks` sinks), kept in `cache` (.npy) for every arm
    of the run that asks for the same ones."""
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
