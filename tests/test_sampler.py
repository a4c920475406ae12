"""The sampling distribution (docs/sampling.md) in rollout.engine.sampler, against the independent per-row reference
in tests/contract1_ref.py: every processor alone (temperature, top-k with ties, top-p, min-p,
penalties, logit bias, grammar bitmask, min_tokens bans, greedy), all combined, and a batch
whose rows each use different parameters. Then the random stream (`uniform`: in (0, 1),
a pure function of its inputs, uniform by a KS bound) and a chi-square test that tokens
sampled through `verify` with no drafts follow the reference probabilities, with negative
controls (top-p before top-k, a wrong temperature) that the same test must reject.
"""

from __future__ import annotations

import math

import pytest
import torch
from contract1_ref import reference_policy
from spec_helpers import verify_rows

from rollout.engine.intake import sample_seed
from rollout.engine.sampler import (
    PURPOSE_ACCEPT,
    PURPOSE_DRAFT,
    PURPOSE_SAMPLE,
    Policy,
    RowParams,
    draw_index,
    policy,
    uniform,
)

V = 48
EOS = V - 1
HISTORY = [3, 3, 3, 7, 12, 12, 0, 25, 40, 41]  # prompt + output tokens, with repeats


def row_params(specs: list[dict], vocab: int = V) -> RowParams:
    """RowParams for one row per spec (keywords of contract1_ref.reference_policy), built the
    way the engine's rows.py encodes them: greedy = temperature 1 and top-k 1, top-k off = V."""
    temp, top_k, top_p, min_p, bias, banned = [], [], [], [], ([], [], []), ([], [])
    counts = torch.zeros(len(specs), vocab)
    pens = torch.tensor([[1.0, 0.0, 0.0]]).repeat(len(specs), 1)
    words = -(-vocab // 32)
    bitmask = torch.full((len(specs), words), -1, dtype=torch.int32)
    for r, s in enumerate(specs):
        greedy = s.get("temperature", 1.0) == 0
        temp.append(1.0 if greedy else s.get("temperature", 1.0))
        top_k.append(1 if greedy else (s.get("top_k", 0) if s.get("top_k", 0) > 0 else vocab))
        top_p.append(1.0 if greedy else s.get("top_p", 1.0))
        min_p.append(0.0 if greedy else s.get("min_p", 0.0))
        for tok, b in s.get("logit_bias", {}).items():
            bias[0].append(r), bias[1].append(tok), bias[2].append(b)
        for tok in s.get("banned", ()):
            banned[0].append(r), banned[1].append(tok)
        for tok in s.get("history", ()):
            counts[r, tok] += 1
        pens[r] = torch.tensor([s.get("repetition_penalty", 1.0), s.get("frequency_penalty", 0.0),
                                s.get("presence_penalty", 0.0)])
        if "allowed" in s:
            bitmask[r] = _bits(s["allowed"], words)
    rows = RowParams(temperature=torch.tensor(temp), top_k=torch.tensor(top_k), top_p=torch.tensor(top_p),
                     min_p=torch.tensor(min_p))
    if bias[0]:
        rows.bias = (torch.tensor(bias[0]), torch.tensor(bias[1]), torch.tensor(bias[2]))
    if banned[0]:
        rows.banned = (torch.tensor(banned[0]), torch.tensor(banned[1]))
    if any("history" in s for s in specs):
        rows.counts, rows.penalties = counts, pens
    if any("allowed" in s for s in specs):
        rows.bitmask = bitmask
    return rows


def _bits(allowed: set[int], words: int) -> torch.Tensor:
    out = []
    for w in range(words):
        word = sum(1 << j for j in range(32) if 32 * w + j in allowed)
        out.append(word - (1 << 32) if word >= 1 << 31 else word)
    return torch.tensor(out, dtype=torch.int32)


def ref_keywords(spec: dict) -> dict:
    """The reference's keywords for a spec; `history` only matters with penalties."""
    return {k: v for k, v in spec.items() if k != "history" or any(
        p in spec for p in ("repetition_penalty", "frequency_penalty", "presence_penalty"))}


def support(pol: Policy, r: int) -> tuple[list[int], torch.Tensor]:
    """Row r's support sorted by probability desc, ties by id, and its log-probs, from whichever
    layout holds the row. A cand row must already be in that order, a prefix of its columns
    (-inf after it), without repeated ids in it (columns past a row's own candidates are filler); a
    vocab row is sorted here."""
    if pol.cand_ids is not None and (pol.in_cand is None or bool(pol.in_cand[r])):
        ids, logp = pol.cand_ids[r].tolist(), pol.cand_logp[r]
        n = int(torch.isfinite(logp).sum())
        assert torch.isfinite(logp[:n]).all() and torch.isneginf(logp[n:]).all(), f"row {r}: not a prefix"
        assert len(set(ids[:n])) == n and all(0 <= t < pol.vocab_size for t in ids)
        return ids[:n], logp[:n]
    logp = pol.vocab_logp[r]
    ids = sorted(torch.isfinite(logp).nonzero()[:, 0].tolist(), key=lambda t: (-float(logp[t]), t))
    return ids, logp[ids]


def assert_row_matches(pol: Policy, r: int, ref: dict[int, float]) -> None:
    ids, logp = support(pol, r)
    assert set(ids) == set(ref), f"row {r}: support {sorted(ids)} != {sorted(ref)}"
    assert ids == sorted(ref, key=lambda t: (-ref[t], t)), f"row {r}: not sorted by prob, ties by id"
    for tok, p in zip(ids, logp.exp().tolist()):
        assert abs(p - ref[tok]) <= 1e-5 + 1e-5 * ref[tok], f"row {r} token {tok}: {p} != {ref[tok]}"
    probs = pol.probs()[r]
    assert abs(float(probs.sum()) - 1.0) < 1e-5
    assert bool(pol.has_support[r])


def random_logits(n: int, seed: int, scale: float = 2.5) -> torch.Tensor:
    z = torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * scale  # [n, V]
    z[:, EOS] = z.max() + 1.0  # EOS is every row's argmax: min_tokens must remove it
    return z


CASES = {
    "plain": {},
    "temperature": dict(temperature=0.6),
    "hot": dict(temperature=1.7),
    "top_k": dict(top_k=5),
    "top_p": dict(top_p=0.7),
    "min_p": dict(min_p=0.08),
    "repetition": dict(repetition_penalty=1.6, history=HISTORY),
    "anti_repetition": dict(repetition_penalty=0.7, history=HISTORY),
    "frequency": dict(frequency_penalty=0.8, history=HISTORY),
    "presence": dict(presence_penalty=1.1, history=HISTORY),
    "negative_penalties": dict(frequency_penalty=-0.5, presence_penalty=-0.4, history=HISTORY),
    "logit_bias": dict(logit_bias={3: 4.0, 7: -100.0, 11: 2.5, EOS: -3.0}),
    "min_tokens": dict(banned=[EOS, 5, 9]),
    "grammar": dict(allowed={1, 2, 3, 5, 8, 13, 21, 34, EOS}),
    "greedy": dict(temperature=0.0),
    "greedy_min_tokens": dict(temperature=0.0, banned=[EOS]),
    "combined": dict(temperature=0.8, top_k=12, top_p=0.85, min_p=0.05, repetition_penalty=1.3,
                     frequency_penalty=0.4, presence_penalty=0.3, logit_bias={3: 3.0, 30: 5.0},
                     history=HISTORY, banned=[EOS, 30], allowed=set(range(0, V, 2)) | {3, EOS}),
}


@pytest.mark.parametrize("name", CASES)
def test_each_processor_matches_the_reference(name):
    spec = CASES[name]
    z = random_logits(4, seed=len(name))
    pol = policy(z.clone(), row_params([spec] * 4))
    for r in range(4):
        assert_row_matches(pol, r, reference_policy(z[r].tolist(), **ref_keywords(spec)))


def test_a_batch_of_rows_with_different_parameters():
    specs = list(CASES.values()) * 2
    z = random_logits(len(specs), seed=99)
    raw = z.clone()
    pol = policy(z, row_params(specs))
    assert torch.equal(z, raw), "policy must not modify its input logits"
    for r, spec in enumerate(specs):
        assert_row_matches(pol, r, reference_policy(raw[r].tolist(), **ref_keywords(spec)))


def test_reference_against_hand_computed_values():
    z = [2.0, 1.0, 0.0, -1.0]
    e = [math.exp(x) for x in z[:3]]
    two = e[0] + e[1]
    assert reference_policy(z, top_k=3, top_p=0.8) == pytest.approx({0: e[0] / two, 1: e[1] / two})
    assert reference_policy(z, top_k=3, top_p=0.8, min_p=0.4) == {0: 1.0}
    assert reference_policy(z, temperature=0.0, logit_bias={3: 3.5}) == {3: 1.0}
    assert reference_policy(z, temperature=0.0, history=[0], repetition_penalty=4.0) == {1: 1.0}


def test_processors_change_what_they_should():
    """Direct checks of each processor's effect, independent of the reference."""
    z = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0, -2.0]])
    spec = dict(repetition_penalty=2.0, history=[1, 2], frequency_penalty=0.0)
    p = policy(z.clone(), row_params([spec], vocab=6)).probs()[0]
    want = torch.softmax(torch.tensor([1.0, 1.0, -2.0, 0.5, 3.0, -2.0]), 0)  # 2 / 2, -1 * 2
    assert torch.allclose(p, want, atol=1e-6)
    spec = dict(frequency_penalty=0.5, presence_penalty=0.25, history=[4, 4, 0])
    p = policy(z.clone(), row_params([spec], vocab=6)).probs()[0]
    want = torch.softmax(torch.tensor([0.25, 2.0, -1.0, 0.5, 1.75, -2.0]), 0)
    assert torch.allclose(p, want, atol=1e-6)
    p = policy(z.clone(), row_params([dict(banned=[4, 1])], vocab=6)).probs()[0]
    assert p[4] == 0 and p[1] == 0 and abs(float(p.sum()) - 1) < 1e-6


def test_greedy_ties_go_to_the_lowest_id():
    z = torch.tensor([[0.0, 2.0, 5.0, 5.0, 1.0, 5.0]])
    pol = policy(z.clone(), row_params([dict(temperature=0.0)], vocab=6))
    ids, logp = support(pol, 0)
    assert ids == [2] and logp.tolist() == [0.0]
    biased = policy(z.clone(), row_params([dict(temperature=0.0, logit_bias={1: 3.0})], vocab=6))
    assert support(biased, 0)[0] == [1]  # 2 + 3 = 5: tie with 2, 3, 5, and 1 is lowest


def test_top_k_ties_at_the_cutoff_keep_the_lowest_ids():
    z = torch.tensor([[1.0, 3.0, 2.0, 2.0, 2.0, 0.0, 2.0]])
    for k, want in [(1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (4, [1, 2, 3, 4]), (6, [1, 2, 3, 4, 6, 0])]:
        pol = policy(z.clone(), row_params([dict(top_k=k)], vocab=7))
        ids, logp = support(pol, 0)
        assert ids == want, f"top_k={k}"
        tied = logp[1:][torch.tensor(ids[1:], dtype=torch.int64) != 0]
        assert torch.allclose(tied, tied[:1].expand_as(tied)), "tied tokens must keep equal probability"


def test_top_p_keeps_the_shortest_prefix_reaching_the_mass():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    z = p.log()[None]
    for top_p, want in [(0.5, 1), (0.51, 2), (0.8, 2), (0.81, 3), (0.96, 4), (1.0, 4)]:
        pol = policy(z.clone(), row_params([dict(top_p=top_p)], vocab=4))
        assert len(support(pol, 0)[0]) == want, f"top_p={top_p}"


def test_min_p_is_relative_to_the_most_likely_token():
    p = torch.tensor([0.4, 0.2, 0.1, 0.3])
    z = p.log()[None]
    for min_p, want in [(0.0, {0, 1, 2, 3}), (0.26, {0, 3, 1}), (0.5, {0, 3}), (0.76, {0}), (1.0, {0})]:
        pol = policy(z.clone(), row_params([dict(min_p=min_p)], vocab=4))
        assert set(support(pol, 0)[0]) == want, f"min_p={min_p}"


def test_logprob_of_is_minus_infinity_outside_the_support():
    z = random_logits(2, seed=5)
    pol = policy(z.clone(), row_params([dict(top_k=3)] * 2))
    inside = torch.tensor([support(pol, r)[0][-1] for r in range(2)])
    outside = torch.tensor([min(set(range(V)) - set(support(pol, r)[0])) for r in range(2)])
    rows = torch.tensor([0, 1])
    assert torch.equal(pol.logprob_of(rows, inside), torch.stack([support(pol, r)[1][-1] for r in range(2)]))
    assert torch.isneginf(pol.logprob_of(rows, outside)).all()


def test_draw_index_lands_on_positive_weights_only():
    weights = torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.0, 0.2, 0.0, 0.3], [0.0, 1e-30, 0.0, 0.0]])
    u = torch.tensor([1e-7, 1e-7, 1e-7])
    assert draw_index(weights.clone(), u).tolist() == [0, 1, 1]
    u = torch.full((3,), 1 - 2**-24)  # the largest uniform: never past the last positive weight
    assert draw_index(weights.clone(), u).tolist() == [2, 3, 1]
    u = torch.tensor([0.6, 0.3, 0.5])
    assert draw_index(weights.clone(), u).tolist() == [1, 1, 1]
    assert draw_index(torch.zeros(1, 4), torch.tensor([0.5])).tolist() == [3]  # no support: the last column


# -- the random stream --------------------------------------------------------------------------

_M32 = 0xFFFFFFFF


def _fmix(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _fmix_inverse(h: int) -> int:
    h ^= h >> 16
    h = (h * pow(0xC2B2AE35, -1, 1 << 32)) & _M32
    h ^= (h >> 13) ^ (h >> 26)
    h = (h * pow(0x85EBCA6B, -1, 1 << 32)) & _M32
    return h ^ (h >> 16)


def _position_hitting(seed: int, purpose: int, final_hash: int) -> int:
    """A position whose hash state before the final shift is `final_hash` (the murmur finaliser is
    a bijection, so every 32-bit state is reachable): the extreme draws of the stream."""
    h2 = _fmix(_fmix((seed & _M32) ^ 0x9E3779B9) ^ ((seed >> 32) & _M32))
    h3 = _fmix_inverse(final_hash) ^ ((purpose * 0x165667B1) & _M32)
    return ((_fmix_inverse(h3) ^ h2) * pow(0x27D4EB2F, -1, 1 << 32)) & _M32


@pytest.mark.parametrize("final_hash", [0, _M32, 0xFFFFFF00, 0x000000FF])
def test_uniform_never_reaches_zero_or_one(final_hash):
    for seed in (0, 12345, 2**62 + 7):
        pos = _position_hitting(seed, PURPOSE_SAMPLE, final_hash)
        u = uniform(torch.tensor([seed]), torch.tensor([pos]), PURPOSE_SAMPLE)
        assert 0.0 < float(u[0]) < 1.0, f"u={float(u[0])!r} at the extreme hash {final_hash:#x}"


def test_uniform_is_a_pure_function_of_seed_position_purpose():
    g = torch.Generator().manual_seed(0)
    seeds = torch.randint(0, 2**62, (1000,), generator=g)
    pos = torch.randint(0, 4096, (1000,), generator=g)
    a = uniform(seeds, pos, PURPOSE_SAMPLE)
    assert torch.equal(a, uniform(seeds.clone(), pos.clone(), PURPOSE_SAMPLE))
    assert torch.equal(a[::7], uniform(seeds[::7], pos[::7], PURPOSE_SAMPLE)), "must not depend on the batch"
    for other in (uniform(seeds, pos, PURPOSE_ACCEPT), uniform(seeds, pos, PURPOSE_DRAFT),
                  uniform(seeds, pos + 1, PURPOSE_SAMPLE), uniform(seeds ^ (1 << 40), pos, PURPOSE_SAMPLE)):
        assert (other == a).float().mean() < 0.01


def _ks(u: torch.Tensor) -> float:
    u, _ = torch.sort(u.double())
    n = len(u)
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    return max(float((grid - u).abs().max()), float((u - (grid - 1 / n)).abs().max()))


@pytest.mark.parametrize("axis", ["positions", "seeds", "high_seed_bits"])
def test_uniform_is_uniform(axis):
    n = 100_000
    idx = torch.arange(n)
    seeds, pos = {
        "positions": (torch.full((n,), 987654321), idx),
        "seeds": (torch.tensor([sample_seed(7, 0, s) for s in range(n)]), torch.full((n,), 3)),
        "high_seed_bits": (idx << 32, torch.zeros(n, dtype=torch.int64)),
    }[axis]
    u = uniform(seeds, pos, PURPOSE_SAMPLE)
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert _ks(u) < 1.95 / math.sqrt(n), f"KS distance {_ks(u):.5f}"  # ~0.1% tail
    u1 = uniform(seeds, pos + 1, PURPOSE_SAMPLE)
    corr = torch.corrcoef(torch.stack([u.double(), u1.double()]))[0, 1]
    assert abs(float(corr)) < 0.01, "neighbouring positions are correlated"


# -- sampled frequencies ----------------------------------------------------------------------------

SV = 16
STAT_PARAMS = dict(temperature=0.8, top_k=10, top_p=0.9, min_p=0.03)
N_DRAWS = 40_000


def _stat_logits() -> torch.Tensor:
    return torch.randn(SV, generator=torch.Generator().manual_seed(12))  # [SV]


def _draw(pol: Policy, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The engine's plain sampling path: verify with zero drafts per row."""
    n = len(seeds)
    empty = torch.zeros(0, dtype=torch.int64)
    res = verify_rows(pol, empty, None, [0] * n, list(range(n + 1)), empty, empty, seeds, positions)
    assert res.num_accepted.eq(0).all()
    return res.tokens[:, 0]


def _draws(policy_fn, axis: str, params: dict = STAT_PARAMS) -> torch.Tensor:
    z = _stat_logits().expand(N_DRAWS, SV).clone()
    one = row_params([params], vocab=SV)
    rows = RowParams(temperature=one.temperature.expand(N_DRAWS), top_k=one.top_k.expand(N_DRAWS),
                     top_p=one.top_p.expand(N_DRAWS), min_p=one.min_p.expand(N_DRAWS))
    pol = policy_fn(z, rows)
    idx = torch.arange(N_DRAWS)
    if axis == "seeds":  # many samples, one position each
        seeds = torch.tensor([sample_seed(3, 0, s) for s in range(N_DRAWS)])
        return _draw(pol, seeds, torch.full((N_DRAWS,), 17))
    return _draw(pol, torch.full((N_DRAWS,), sample_seed(5, 1, 2)), idx)  # one sample's token stream


def _chi2(tokens: torch.Tensor, probs: dict[int, float]) -> tuple[float, int]:
    counts = torch.bincount(tokens, minlength=SV).tolist()
    if any(c and t not in probs for t, c in enumerate(counts)):
        return math.inf, len(probs) - 1
    stat = sum((counts[t] - N_DRAWS * p) ** 2 / (N_DRAWS * p) for t, p in probs.items())
    return stat, len(probs) - 1


def _critical(df: int, z: float = 4.0) -> float:
    """Chi-square quantile at about the 3e-5 upper tail (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


# one case per path of the policy (rollout.engine.sampler): top-k candidates, the vocabulary in
# vocabulary order (no truncation; min-p only), and top-p rows (candidates; every top-p path: test_top_p.py)
STAT_PATHS = {
    "top_k": STAT_PARAMS,
    "dense": dict(temperature=0.8),
    "min_p": dict(temperature=0.8, min_p=0.15),
    "top_p": dict(temperature=0.8, top_p=0.8),
}


def _expected(params: dict = STAT_PARAMS) -> dict[int, float]:
    probs = reference_policy(_stat_logits().tolist(), **params)
    assert 5 <= len(probs) and min(probs.values()) * N_DRAWS > 20  # a test with teeth
    return probs


@pytest.mark.parametrize("path", STAT_PATHS)
@pytest.mark.parametrize("axis", ["seeds", "positions"])
def test_sampled_frequencies_follow_contract_1(axis, path):
    params = STAT_PATHS[path]
    if path != "dense":  # the truncation removes tokens: a draw outside the support is a failure
        assert len(_expected(params)) < SV
    stat, df = _chi2(_draws(policy, axis, params), _expected(params))
    assert stat < _critical(df), f"chi2 {stat:.1f} with {df} dof"


def _top_p_before_top_k(logits: torch.Tensor, rows: RowParams) -> Policy:
    """The bug a large engine shipped: top-p on the full softmax, then top-k."""
    z = logits / rows.temperature[:, None]
    sorted_z, ids = torch.sort(z, dim=1, descending=True, stable=True)
    probs = torch.softmax(sorted_z, dim=1)
    keep = (probs.cumsum(dim=1) - probs) < rows.top_p[:, None]
    keep &= torch.arange(z.shape[1])[None] < rows.top_k[:, None]
    keep &= probs >= rows.min_p[:, None] * probs[:, :1]
    logp = torch.log_softmax(sorted_z.masked_fill(~keep, float("-inf")), dim=1)
    return Policy(ids, logp, None, None, keep.any(dim=1), z.shape[1])


def _wrong_temperature(logits: torch.Tensor, rows: RowParams) -> Policy:
    rows.temperature = rows.temperature * 1.25
    return policy(logits, rows)


@pytest.mark.parametrize("wrong", [_top_p_before_top_k, _wrong_temperature])
def test_negative_control_a_wrong_distribution_is_detected(wrong):
    stat, df = _chi2(_draws(wrong, "seeds"), _expected())
    assert stat > 3 * _critical(df), f"{wrong.__name__} not detected: chi2 {stat:.1f} with {df} dof"


def test_all_greedy_fast_path_equals_the_full_policy():
    """A batch of greedy rows takes the argmax path (one column); it must pick the same token
    (lowest id among ties) with log-prob 0, after the same processors."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randint(-3, 4, (64, 40), generator=g).float()  # integer logits: many ties
    n = logits.shape[0]
    base = dict(temperature=torch.ones(n), top_k=torch.ones(n, dtype=torch.int64), top_p=torch.ones(n),
                min_p=torch.zeros(n), bias=(torch.arange(n), torch.full((n,), 7), torch.full((n,), 2.0)))
    full = policy(logits.clone(), RowParams(**base))
    fast = policy(logits.clone(), RowParams(**base, all_greedy=True))
    assert fast.cand_ids.shape == (n, 1) and fast.all_greedy
    assert [support(fast, r)[0] for r in range(n)] == [support(full, r)[0] for r in range(n)]
    assert torch.equal(fast.has_support, full.has_support) and torch.all(fast.cand_logp == 0)
    assert torch.equal(fast.probs(), full.probs())
    rows, toks = torch.arange(n), fast.cand_ids[:, 0]
    assert torch.equal(fast.logprob_of(rows, toks), full.logprob_of(rows, toks))
