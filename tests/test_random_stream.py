"""The resolution of the random stream (`rollout.engine.sampler.uniform`, 23 random bits): a KS
bound on its uniformity (tests/test_sampler.py) passes a stream cut to 8 bits (256 levels), which
then draws a token below probability 1/256 at 0 or ~40 times its rate. Two statistics that do not:

* distinct values among a million uniforms of each purpose: at least as many as a stream with 2^22
  levels would give (a 23-bit stream gives ~944k, a 22-bit one ~890k, an 8-bit one 256), and
  two of them no further apart than 2^-22 (the stream's step);
* eight tokens of probability 1e-4 each, drawn a million times through the engine's sampling path
  (policy, then verify with no drafts), each at its rate: chi-square over the rare tokens.

Negative control: `uniform_of_keys` cut to 8 random bits (wherever it is imported) must fail both.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from spec_helpers import verify_rows

import rollout.engine.sampler as sampler_mod
from rollout.engine.intake import sample_seed
from rollout.engine.sampler import PURPOSE_ACCEPT, PURPOSE_DRAFT, PURPOSE_SAMPLE, RowParams, policy, uniform

N_UNIFORMS = 1_000_000
MIN_LEVELS = 1 << 22
RARE = 1e-4  # each rare token's probability
NUM_RARE = 8
N_DRAWS = 1_000_000
CHUNK = 250_000


def _distinct_and_gap(purpose: int) -> tuple[int, float]:
    """Distinct values among N_UNIFORMS uniforms (many samples' seeds and positions) and the
    smallest gap between distinct values (the stream's step)."""
    g = torch.Generator().manual_seed(purpose)
    seeds = torch.randint(0, 2**62, (N_UNIFORMS,), generator=g)
    positions = torch.randint(0, 1 << 16, (N_UNIFORMS,), generator=g)
    values = torch.unique(uniform(seeds, positions, purpose).double())  # sorted
    return values.numel(), float(values.diff().min())


def _expected_distinct(levels: int, n: int) -> float:
    return levels * (1 - math.exp(-n / levels))


def _rare_logits() -> tuple[torch.Tensor, list[int]]:
    """[V] logits where NUM_RARE tokens, spread over the vocabulary, have probability RARE each and
    the rest share the remaining mass unevenly; returns them and the rare ids."""
    v = 24
    rare = [1, 4, 9, 12, 16, 19, 22, 23]
    common = [t for t in range(v) if t not in rare]
    weights = torch.linspace(1.0, 3.0, len(common), dtype=torch.float64)
    probs = torch.zeros(v, dtype=torch.float64)
    probs[common] = weights / weights.sum() * (1 - NUM_RARE * RARE)
    probs[rare] = RARE
    return probs.log().float(), rare


def _rare_counts() -> list[int]:
    """How often each rare token is drawn in N_DRAWS draws of one sample's stream (positions 0..)."""
    logits, rare = _rare_logits()
    counts = torch.zeros(logits.numel(), dtype=torch.int64)
    seed = sample_seed(11, 0, 0)
    for start in range(0, N_DRAWS, CHUNK):
        n = min(CHUNK, N_DRAWS - start)
        rows = RowParams(temperature=torch.ones(n), top_k=torch.full((n,), logits.numel()), top_p=torch.ones(n),
                         min_p=torch.zeros(n))
        pol = policy(logits.expand(n, -1).clone(), rows)
        empty = torch.zeros(0, dtype=torch.int64)
        res = verify_rows(pol, empty, None, [0] * n, list(range(n + 1)), empty, empty, torch.full((n,), seed),
                          torch.arange(start, start + n))
        counts += torch.bincount(res.tokens[:, 0], minlength=logits.numel())
    return counts[rare].tolist()


def _rare_chi2(counts: list[int]) -> tuple[float, float]:
    """Chi-square of the rare tokens' counts against N_DRAWS * RARE each, and its critical value
    at about 3e-5 (Wilson-Hilferty, z = 4)."""
    expected = N_DRAWS * RARE
    stat = sum((c - expected) ** 2 / expected for c in counts)
    df = len(counts)
    return stat, df * (1 - 2 / (9 * df) + 4.0 * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("purpose", [PURPOSE_SAMPLE, PURPOSE_ACCEPT, PURPOSE_DRAFT])
def test_uniforms_resolve_at_least_22_bits(purpose):
    distinct, gap = _distinct_and_gap(purpose)
    assert distinct >= _expected_distinct(MIN_LEVELS, N_UNIFORMS) - 2000, f"{distinct} distinct values"
    assert gap <= 1 / MIN_LEVELS, f"the closest uniforms are {gap:.3g} apart"


def test_tokens_of_probability_1e4_are_drawn_at_their_rate():
    counts = _rare_counts()
    stat, crit = _rare_chi2(counts)
    assert stat < crit, f"rare tokens drawn {counts} times, {N_DRAWS * RARE:.0f} expected each (chi2 {stat:.1f})"
    assert abs(sum(counts) - N_DRAWS * RARE * NUM_RARE) < 4 * math.sqrt(N_DRAWS * RARE * NUM_RARE)


def _eight_bit_stream(monkeypatch) -> None:
    """`uniform_of_keys` keeps its top 8 random bits (256 levels, each centred), in every rollout
    module that holds it."""
    real = sampler_mod.uniform_of_keys

    def eight_bits(keys, purpose):
        return (torch.floor(real(keys, purpose) * 256) + 0.5) / 256

    for name, module in list(sys.modules.items()):
        if name.startswith("rollout.") and getattr(module, "uniform_of_keys", None) is real:
            monkeypatch.setattr(module, "uniform_of_keys", eight_bits)


def test_negative_control_an_eight_bit_stream_fails_both(monkeypatch):
    _eight_bit_stream(monkeypatch)
    distinct, gap = _distinct_and_gap(PURPOSE_SAMPLE)
    assert distinct < _expected_distinct(MIN_LEVELS, N_UNIFORMS) - 2000 and gap > 1 / MIN_LEVELS
    stat, crit = _rare_chi2(_rare_counts())
    assert stat > 10 * crit, f"an 8-bit stream draws rare tokens at their rate: chi2 {stat:.1f}"
