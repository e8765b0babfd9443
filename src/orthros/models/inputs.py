"""The checks and choices of a transformers-style call, before any layer runs: which positions
are output positions (`select_outputs`), the cache it was given (`own_cache`), and one-line
errors for malformed inputs (`check_inputs`)."""

from __future__ import annotations

import torch
from transformers import Cache

from .cache import OrthrosCache
from .layout import pad_rows

IGNORE_INDEX = -100


def select_outputs(B: int, T: int, device, labels=None, logits_to_keep: int | torch.Tensor = 0):
    """The output positions of a call as (idx [B, N], valid [B, N]); see `forward`."""
    if torch.is_tensor(logits_to_keep):
        sel = logits_to_keep.to(device)
        if sel.dtype == torch.bool:
            if sel.shape != (B, T):
                raise ValueError(f"logits_to_keep as a bool mask must have shape {(B, T)}, got {tuple(sel.shape)}")
            return pad_rows(sel)
        sel = sel.long()
        if sel.dim() == 1:
            sel = sel[None].expand(B, -1)
        if sel.dim() != 2 or sel.shape[0] != B:
            raise ValueError(f"logits_to_keep index tensor must be [N] or [{B}, N], got {tuple(sel.shape)}")
        if sel.numel() and not torch.compiler.is_compiling() and (sel.max() >= T or sel.min() < -1):
            raise ValueError(f"logits_to_keep indices must lie in [0, {T}) (-1 = none); got {sel.min()}..{sel.max()}")
        valid = sel >= 0
        return sel.clamp_min(0), valid
    k = int(logits_to_keep)
    if k < 0:
        raise ValueError(f"logits_to_keep must be >= 0, got {k}")
    if k == 0 and labels is not None:
        nxt = torch.zeros(B, T, dtype=torch.bool, device=device)
        nxt[:, :-1] = labels[:, 1:] != IGNORE_INDEX
        return pad_rows(nxt)
    k = T if k == 0 else min(k, T)
    idx = torch.arange(T - k, T, device=device)[None].expand(B, -1)
    return idx, torch.ones_like(idx, dtype=torch.bool)


def own_cache(cache, model):
    """An empty transformers Cache of another kind (e.g. a DynamicCache made by a
    transformers utility) becomes an OrthrosCache; a filled one is an error."""
    if cache is None or isinstance(cache, OrthrosCache):
        return cache
    if isinstance(cache, Cache) and cache.get_seq_length() == 0:
        return model.new_cache()
    raise ValueError(f"past_key_values must be an OrthrosCache (model.new_cache()), got {type(cache).__name__}")


def check_inputs(config, input_ids, inputs_embeds, attention_mask, position_ids, labels, cache):
    """Clear errors for user mistakes instead of an index error deep in a kernel."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    x = input_ids if input_ids is not None else inputs_embeds
    if input_ids is not None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    elif inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.hidden_size:
        raise ValueError(f"inputs_embeds must be [batch, seq, {config.hidden_size}], got {tuple(inputs_embeds.shape)}")
    B, T = x.shape[:2]
    if B == 0 or T == 0:
        raise ValueError(f"empty input: shape {tuple(x.shape)}; need at least one sequence of one token")
    if input_ids is not None and not torch.compiler.is_compiling():
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {config.vocab_size}); got range [{lo}, {hi}]")
    past = 0 if cache is None else cache.get_seq_length()
    if cache is not None and past and cache.batch_size != B:
        raise ValueError(f"batch size {B} does not match the cache's {cache.batch_size}")
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[0] != B
                                       or attention_mask.shape[1] not in (T, past + T)):
        want = f"[{B}, {T}]" + (f" or [{B}, {past + T}]" if past else "")
        raise ValueError(f"attention_mask must be {want}, got {tuple(attention_mask.shape)}")
    if position_ids is not None and (position_ids.dim() != 2 or position_ids.shape[1] != T
                                     or position_ids.shape[0] not in (1, B)):
        raise ValueError(f"position_ids must be [{B}, {T}], got {tuple(position_ids.shape)}")
    if labels is not None and tuple(labels.shape) != (B, T):
        raise ValueError(f"labels must be [{B}, {T}] like input_ids, got {tuple(labels.shape)}")
