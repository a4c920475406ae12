"""An independent, deliberately plain reference of the sampling distribution (docs/sampling.md) for the tests: one row
at a time, Python floats in double precision, written from the contract's text rather than
from rollout.engine.sampler. `reference_policy` returns the truncated, renormalised
distribution p_j as {token id: probability} over its support S_j.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

NEG_INF = float("-inf")


def processed_logits(z: Iterable[float], *, logit_bias: dict[int, float] | None = None,
                     history: Iterable[int] = (), repetition_penalty: float = 1.0,
                     frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                     allowed: set[int] | None = None, banned: Iterable[int] = ()) -> list[float]:
    """Step 1, the processors, in order: logit bias; repetition / frequency / presence penalties over
    `history` (prompt + output tokens before j); grammar (`allowed`); min_tokens (`banned`)."""
    z = [float(x) for x in z]
    for tok, bias in (logit_bias or {}).items():
        z[tok] += bias
    for tok, count in Counter(history).items():
        z[tok] = z[tok] / repetition_penalty if z[tok] > 0 else z[tok] * repetition_penalty
        z[tok] -= frequency_penalty * count + presence_penalty
    if allowed is not None:
        z = [x if i in allowed else NEG_INF for i, x in enumerate(z)]
    for tok in banned:
        z[tok] = NEG_INF
    return z


def truncate(z: list[float], *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             min_p: float = 0.0) -> dict[int, float]:
    """Steps 2-3 on processed logits."""
    if temperature == 0:
        best = max(z)
        return {min(i for i, x in enumerate(z) if x == best): 1.0}
    z = [x / temperature for x in z]
    kept = sorted((i for i, x in enumerate(z) if x > NEG_INF), key=lambda i: (-z[i], i))
    if top_k > 0:
        kept = kept[:top_k]
    top = z[kept[0]]
    weights = [math.exp(z[i] - top) for i in kept]
    total = sum(weights)
    probs = sorted(((i, w / total) for i, w in zip(kept, weights)), key=lambda ip: (-ip[1], ip[0]))
    tails = [0.0] * (len(probs) + 1)  # tails[n]: mass after the first n, summed from the small end
    for n in range(len(probs) - 1, -1, -1):
        tails[n] = tails[n + 1] + probs[n][1]
    # the shortest prefix whose mass reaches top_p: its tail holds at most 1 - top_p
    size = next(n for n in range(1, len(probs) + 1) if tails[n] <= 1.0 - top_p)
    prefix = probs[:size]
    p_max = prefix[0][1]
    final = [(i, p) for i, p in prefix if p >= min_p * p_max]
    total = sum(p for _, p in final)
    return {i: p / total for i, p in final}


def reference_policy(z: Iterable[float], *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                     min_p: float = 0.0, **processors) -> dict[int, float]:
    """p_j for raw logits `z` (see `processed_logits` for the processor keywords)."""
    return truncate(processed_logits(z, **processors), temperature=temperature, top_k=top_k,
                    top_p=top_p, min_p=min_p)
