"""Multi-query associative recall (MQAR), zoology-style.

A sequence opens with `num_kv_pairs` key-value pairs, then asks for keys
again at power-law distributed places further on; the model must answer each
queried key with its value. Everything else is filler. Only the answers are
scored, so only the positions holding a queried key are output positions —
exactly Orthros' SFT phase (`labels` = -100 everywhere else).

    k1 v1 k2 v2 … kn vn  f f k3 v3 f f f k1 v1 f … f k7 v7 f …
    └──── context ────┘  └──────── queries at gaps ~ g^(a-1) ────────┘

Token ids: keys come from [1, V/2), values from [V/2, V) (V = `vocab_size`);
filler is drawn from the value range (or is token 0), so a key occurs only in
the context and at its query and every question has one right answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.model import IGNORE_INDEX


@dataclass
class MQARConfig:
    seq_len: int = 256
    """tokens per sequence"""
    num_kv_pairs: int = 8
    """key-value pairs at the start of each sequence (each is queried once)"""
    vocab_size: int = 256
    """MQAR token ids lie in [0, vocab_size): keys in the lower half, values in the upper"""
    power_a: float = 0.01
    """query gaps g (in pairs) are drawn with p(g) ~ g^(a-1); small a: most queries come early"""
    min_gap: int = 0
    """the first place a query may go, in pairs after the context (0 = right after it)"""
    random_filler: bool = True
    """filler between queries: random value tokens (zoology's default), or token 0 (zoology's
    random_non_queries=False; never a key or value)"""
    num_queries: int | None = None
    """queries per sequence (default: num_kv_pairs, each key asked once); more than
    num_kv_pairs asks keys again, up to every pair slot after the context (dense training data)"""

    def validate(self) -> None:
        if self.num_kv_pairs < 1:
            raise ValueError(f"mqar num_kv_pairs must be >= 1, got {self.num_kv_pairs}")
        if self.vocab_size < 4 or self.vocab_size // 2 - 1 < self.num_kv_pairs:
            raise ValueError(f"mqar vocab_size={self.vocab_size} is too small for {self.num_kv_pairs} distinct keys "
                             f"(need vocab_size >= {2 * self.num_kv_pairs + 2})")
        if self.seq_len < 4 * self.num_kv_pairs + 2 * self.min_gap:
            raise ValueError(f"mqar seq_len={self.seq_len} must be >= 4 * num_kv_pairs + 2 * min_gap "
                             f"= {4 * self.num_kv_pairs + 2 * self.min_gap}")
        space = (self.seq_len - 2 * self.num_kv_pairs) // 2 - self.min_gap
        if self.num_queries is not None and not 1 <= self.num_queries <= space:
            raise ValueError(f"mqar num_queries must lie in [1, {space}] (the pair slots after the context), "
                             f"got {self.num_queries}")
        if not self.power_a > 0:
            raise ValueError(f"mqar power_a must be > 0, got {self.power_a}")


def mqar_batch(n: int, cfg: MQARConfig, seed: int | None = None, generator: torch.Generator | None = None):
    """`n` MQAR sequences -> (input_ids [n, T], labels [n, T]).

    `labels` holds the value at each answer position and -100 elsewhere, in
    the model's convention (shifted inside: position t predicts labels[t+1]),
    so the output positions are exactly the queried keys. Deterministic for a
    given `seed` (or `generator`), on any machine.
    """
    cfg.validate()
    g = generator if generator is not None else torch.Generator().manual_seed(0 if seed is None else seed)
    T, P, V = cfg.seq_len, cfg.num_kv_pairs, cfg.vocab_size
    half = V // 2
    # Distinct keys and values per row: the first P of a random permutation.
    keys = 1 + torch.rand(n, half - 1, generator=g).argsort(1)[:, :P]
    values = half + torch.rand(n, V - half, generator=g).argsort(1)[:, :P]
    context = torch.stack([keys, values], 2).flatten(1)  # [n, 2P]
    # Query slots: pairs (key, value) at gaps g in [min_gap, space) after the context, no two alike.
    space = (T - 2 * P) // 2
    gaps = torch.arange(1, space - cfg.min_gap + 1, dtype=torch.float64)
    p = (cfg.power_a * gaps ** (cfg.power_a - 1)).expand(n, -1)
    Q = P if cfg.num_queries is None else cfg.num_queries
    gap = cfg.min_gap + torch.multinomial(p, Q, replacement=False, generator=g)  # [n, Q]
    # Which pair each query asks about: every key once, then again, in random order.
    reps = -(-Q // P)
    order = torch.cat([torch.rand(n, P, generator=g).argsort(1) for _ in range(reps)], 1)[:, :Q]
    ids = half + torch.randint(0, V - half, (n, T), generator=g)  # filler: value tokens, never keys
    if not cfg.random_filler:
        ids.zero_()
    ids[:, : 2 * P] = context
    labels = torch.full((n, T), IGNORE_INDEX, dtype=torch.long)
    kpos = 2 * P + 2 * gap
    ids.scatter_(1, kpos, keys.gather(1, order))
    ids.scatter_(1, kpos + 1, values.gather(1, order))
    labels.scatter_(1, kpos + 1, values.gather(1, order))
    return ids, labels


def key_distances(ids: torch.Tensor, labels: torch.Tensor, num_kv_pairs: int) -> torch.Tensor:
    """[n, T] long: at each answer position, how many tokens separate the query's key
    from the same key in the context (0 elsewhere)."""
    ctx = ids[:, : 2 * num_kv_pairs : 2]  # [n, P] context keys
    prev = torch.cat([ids[:, :1], ids[:, :-1]], 1)  # the key before each answer
    match = prev[:, :, None] == ctx[:, None, :]  # [n, T, P]
    where = 2 * match.float().argmax(-1)  # position of that key in the context
    t = torch.arange(ids.shape[1])[None] - 1
    return torch.where(labels != IGNORE_INDEX, t - where, torch.zeros_like(ids))
