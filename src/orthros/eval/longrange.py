"""Does a model use its long context? Three probes on real text.

    token_losses   the loss of every token of held-out rows [N, T] -> perplexity
                   at T, and the loss by position (binned) over 0..T
    copy_probe     a ~100-token segment repeated G tokens later: the loss on the
                   second copy (low = the model looks back G tokens and copies)
    chat_passkey   a pass key hidden in filler text, asked for through the chat
                   template, answered by greedy generation

Each is a function of a model with the project's interface (OrthrosForCausalLM,
any attention), returns plain JSON-ready numbers, and is seeded. With
`kv_dtype` (e.g. "int4") each reads its text through the fast path's cache of
that dtype instead of one cache-less forward: the rows are fed in `chunk`-token
pieces and every scored position reads the past as a decode step there would
(`new_cache`: a cache built some other way, e.g. a `LowBitStaticCache` with
non-default groups, for layout studies).
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

from ..data.retrieval import eval_key


CHUNK = 256  # prompt piece fed through a cache (kv_dtype given)


@torch.no_grad()
def cached_losses(model, x: torch.Tensor, pos: torch.Tensor, kv_dtype: str | None, chunk: int = CHUNK,
                  new_cache=None) -> torch.Tensor:
    """Next-token losses [B, N] of x [B, T] at positions pos [N] (sorted, < T - 1), the rows fed
    through a fast-path cache of `kv_dtype` (or new_cache(model, B, T)) in `chunk`-token pieces
    (only `pos` are output positions)."""
    from ..generate import new_static_cache

    B, T = x.shape
    cache = new_cache(model, B, T) if new_cache is not None else new_static_cache(model, B, T, kv_dtype)
    pos = pos.to(x.device)
    out = []
    for a in range(0, x.shape[1], chunk):
        sel = pos[(pos >= a) & (pos < a + chunk)]
        logits = model(x[:, a : a + chunk], past_key_values=cache, use_cache=True, logits_to_keep=sel - a).logits
        if sel.numel():
            tgt = x[:, sel + 1]
            out.append(F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten(), reduction="none")
                       .view(x.shape[0], -1))
    return torch.cat(out, 1)


@torch.no_grad()
def token_losses(model, rows: torch.Tensor, batch_size: int = 4, progress=None, kv_dtype: str | None = None,
                 chunk: int = CHUNK) -> torch.Tensor:
    """rows: [N, T] ids -> [N, T-1] fp32 losses (token t+1 predicted from tokens <= t)."""
    device = next(model.parameters()).device
    out = []
    for s in range(0, rows.shape[0], batch_size):
        x = rows[s : s + batch_size].to(device)
        if kv_dtype is None:
            logits = model(x[:, :-1], use_cache=False).logits  # every position an output position
            loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten(), reduction="none")
        else:
            loss = cached_losses(model, x, torch.arange(x.shape[1] - 1), kv_dtype, chunk)
        out.append(loss.view(x.shape[0], -1).cpu())
        if progress is not None:
            progress.update(x.shape[0])
    return torch.cat(out)


def loss_summary(losses: torch.Tensor, bins: int = 32) -> dict:
    """[N, T-1] losses -> perplexity and the mean loss of `bins` equal position ranges."""
    n, t = losses.shape
    edges = [round(i * t / bins) for i in range(bins + 1)]
    by_pos = [losses[:, a:b].mean().item() for a, b in zip(edges, edges[1:])]
    nll = losses.mean().item()
    return {"ppl": math.exp(nll), "nll": nll, "rows": n, "tokens": n * t,
            "by_position": {"start": edges[:-1], "end": edges[1:], "loss": by_pos}}


@torch.no_grad()
def copy_probe(model, stream: torch.Tensor, gaps: list[int], samples: int = 32, seg_len: int = 100,
               prefix: int = 64, seed: int = 0, batch_size: int = 8, kv_dtype: str | None = None,
               chunk: int = CHUNK, new_cache=None) -> dict:
    """Loss on the second copy of a `seg_len`-token segment repeated after `gap` other tokens.

    Each sample: prefix (filler) | segment | filler of `gap` tokens | segment. Filler and
    segments are different random spans of `stream` (1-D held-out ids). Returns, per gap,
    the mean loss over the second copy's tokens 2..seg_len and over the first copy's
    (the same tokens read without a copy to look at)."""
    device = next(model.parameters()).device
    rng = random.Random(seed)
    res = {}
    for gap in gaps:
        L = prefix + 2 * seg_len + gap
        if stream.numel() < L + 2 * seg_len:
            raise ValueError(f"copy probe: {stream.numel()} held-out tokens are too few for gap {gap}")
        seqs = []
        for _ in range(samples):
            a = rng.randrange(0, stream.numel() - L)
            filler = stream[a : a + prefix + gap]
            while True:  # a segment that does not overlap the filler
                b = rng.randrange(0, stream.numel() - seg_len)
                if b + seg_len <= a or b >= a + prefix + gap:
                    break
            seg = stream[b : b + seg_len]
            seqs.append(torch.cat([filler[:prefix], seg, filler[prefix:], seg]))
        ids = torch.stack(seqs)
        first = torch.arange(prefix, prefix + seg_len - 1)  # positions predicting the segment's tokens 2..
        second = first + seg_len + gap
        pos = torch.cat([first, second])
        tot = torch.zeros(2)
        for s in range(0, samples, batch_size):
            x = ids[s : s + batch_size].to(device)
            if kv_dtype is None and new_cache is None:
                logits = model(x, logits_to_keep=pos.to(device), use_cache=False).logits  # [b, 2(seg-1), V]
                tgt = x[:, pos.to(device) + 1]
                loss = F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten(), reduction="none")
            else:
                loss = cached_losses(model, x, pos, kv_dtype, chunk, new_cache)
            loss = loss.view(x.shape[0], 2, -1)
            tot += loss.mean(-1).sum(0).cpu()
        first_loss, second_loss = (tot / samples).tolist()
        res[str(gap)] = {"first": first_loss, "second": second_loss}
    return {"samples": samples, "seg_len": seg_len, "by_gap": res}


FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? Answer with the number only."


def passkey_prompt(tok, length: int, depth: float, key: str) -> list[int]:
    """A chat prompt of about `length` tokens: filler with the needle at `depth`, then the question."""
    unit = len(tok(FILLER, add_special_tokens=False)["input_ids"])
    overhead = len(tok.apply_chat_template([{"role": "user", "content": NEEDLE.format(key=key) + QUESTION}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False))
    n = max(1, (length - overhead) // unit)
    k = round(depth * n)
    text = FILLER * k + NEEDLE.format(key=key) + FILLER * (n - k) + "\n" + QUESTION
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    return list(ids)


@torch.no_grad()
def chat_passkey(model, tok, lengths: list[int], depths: list[float], samples: int = 4, seed: int = 0,
                 max_new_tokens: int = 12, batch_size: int = 8, kv_dtype: str | None = None) -> dict:
    """Greedy answers to a pass-key question through the chat template; accuracy per length and depth
    (kv_dtype: generated on the fast path with that cache)."""
    from ..generate import generate

    rng = random.Random(seed)
    cells, answers = {}, []
    eos = tok.eos_token_id
    for L in lengths:
        for d in depths:
            keys = [eval_key(rng) for _ in range(samples)]  # never a training sample's key
            prompts = [passkey_prompt(tok, L, d, k) for k in keys]
            hits = 0
            for s in range(0, samples, batch_size):
                batch = prompts[s : s + batch_size]
                out = generate(model, batch, max_new_tokens=max_new_tokens, temperature=0.0, stop_tokens=eos,
                               fast=kv_dtype is not None, kv_dtype=kv_dtype or "auto")[:, max(map(len, batch)):]  # the new tokens (prompts are left-padded)
                for k, ids in zip(keys[s : s + batch_size], out):
                    text = tok.decode([i for i in ids.tolist() if i != eos and i >= 0], skip_special_tokens=True)
                    hits += k in text
                    answers.append({"length": L, "depth": d, "key": k, "answer": text.strip()[:40]})
            cells[f"{L}@{d}"] = hits / samples
    by_length = {str(L): sum(cells[f"{L}@{d}"] for d in depths) / len(depths) for L in lengths}
    return {"by_cell": cells, "by_length": by_length, "mean": sum(by_length.values()) / len(lengths),
            "prompt_tokens": {str(L): len(passkey_prompt(tok, L, 0.5, "12345")) for L in lengths},
            "examples": answers[:: max(1, len(answers) // 12)]}
