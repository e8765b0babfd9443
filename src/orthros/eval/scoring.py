"""Teacher-forced scoring of answer tokens: the shared core of the recall tasks.

A task marks its answer tokens in `labels` (-100 elsewhere). The model then
makes output positions only where an answer token is predicted (Orthros' SFT
phase: the other positions run the cheap base stream alone), and an answer
token counts as recalled when it is the top logit there.
"""

from __future__ import annotations

import torch

from ..models.model import IGNORE_INDEX


@torch.no_grad()
def answer_hits(model, input_ids: torch.Tensor, labels: torch.Tensor, batch_size: int = 16, progress=None):
    """input_ids, labels: [n, T] -> hits [n, T] bool, True at answer tokens (labels != -100)
    that the model predicts as its top choice."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    hits = torch.zeros(labels.shape, dtype=torch.bool)
    try:
        for s in range(0, input_ids.shape[0], batch_size):
            x = input_ids[s : s + batch_size].to(device)
            y = labels[s : s + batch_size].to(device)
            out = model(x, labels=y, use_cache=False)
            pos = out.output_positions  # [b, N], -1 = padding
            valid = pos >= 0
            tgt_pos = (pos + 1).clamp(0, x.shape[1] - 1)
            ok = (out.logits.argmax(-1) == y.gather(1, tgt_pos)) & valid
            h = torch.zeros(y.shape, dtype=torch.bool, device=device)
            h.scatter_(1, torch.where(valid, tgt_pos, 0), ok)  # padding rows write False to slot 0
            hits[s : s + batch_size] = h.cpu() & (labels[s : s + batch_size] != IGNORE_INDEX)
            if progress is not None:
                progress.update(x.shape[0])
    finally:
        model.train(was_training)
    return hits
