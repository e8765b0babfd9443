"""Perplexity on held-out text, read the way the model reads long prompts.

The held-out token stream is cut into rows of `seq_len` tokens. Each row is
fed in chunks of `chunk_size` through the model's KV cache: every position
of a chunk is an output position that attends to the whole row so far, so
the result equals one full forward of the row, with memory bounded by the
chunk (O(chunk · seq_len) scores instead of O(seq_len²)).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


@torch.no_grad()
def perplexity(model, tokens: torch.Tensor, seq_len: int, chunk_size: int | None = None, batch_size: int = 4,
               max_rows: int | None = None, progress=None) -> dict:
    """tokens: 1-D held-out ids -> {"ppl", "nll", "tokens", "rows"} (nll in nats per token).

    Every token of a row but the first is predicted from everything before it
    in the row; rows do not see each other.
    """
    if seq_len < 2:
        raise ValueError(f"perplexity seq_len must be >= 2, got {seq_len}")
    chunk = seq_len if not chunk_size else chunk_size
    if chunk < 1:
        raise ValueError(f"perplexity chunk_size must be >= 1, got {chunk_size}")
    n_rows = tokens.numel() // seq_len
    if max_rows is not None:
        n_rows = min(n_rows, max_rows)
    if n_rows == 0:
        raise ValueError(f"held-out text has {tokens.numel()} tokens, fewer than one row of seq_len={seq_len}")
    rows = tokens[: n_rows * seq_len].view(n_rows, seq_len)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for s in range(0, n_rows, batch_size):
            x = rows[s : s + batch_size].to(device)
            cache = model.new_cache()
            for a in range(0, seq_len - 1, chunk):
                b = min(a + chunk, seq_len - 1)  # positions a..b-1 predict tokens a+1..b
                logits = model(x[:, a:b], past_key_values=cache, use_cache=True).logits
                nll = F.cross_entropy(logits.flatten(0, 1).float(), x[:, a + 1 : b + 1].flatten(), reduction="sum")
                total += nll.item()
                count += (b - a) * x.shape[0]
            if progress is not None:
                progress.update(x.shape[0])
    finally:
        model.train(was_training)
    nll = total / count
    return {"ppl": math.exp(nll), "nll": nll, "tokens": count, "rows": n_rows}
