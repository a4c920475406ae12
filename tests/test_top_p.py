"""Top-p rows without top-k (rollout.engine.top_p): their most probable tokens first, more of them
for rows whose candidates fall short of top_p, the sort for rows short at the last width. Against
the sampling-distribution reference (tests/contract1_ref.py) on rows where the first candidates
suffice (peaked) and where they do not (flat, tied), with ties exactly at the boundary, at top_p
equal to each float32 running mass (the three paths keep the same prefix), with every kind of row
in one batch, seeded draws independent of the batch, the host reads counted, and draws through
`verify` following the law (chi-square, each path). Stage widths are set small here so that
vocabularies of tens to thousands of tokens take every path.
"""

from __future__ import annotations

import pytest
import torch
from contract1_ref import reference_policy
from spec_helpers import verify_rows
from test_sampler import (
    STAT_PATHS,
    _chi2,
    _critical,
    _draws,
    _expected,
    _stat_logits,
    assert_row_matches,
    ref_keywords,
    row_params,
    support,
)

import rollout.engine.top_p as top_p_mod
from rollout.engine.sampler import policy

# the widths that send a row to each path, for a row whose support needs n tokens
PATHS = {"first": lambda n: (n,), "escalated": lambda n: (n - 1, n), "sorted": lambda n: (n - 1,),
         "sorted_after_two": lambda n: (n - 2, n - 1)}


@pytest.fixture
def reads(monkeypatch) -> list[int]:
    """Counts the host reads: the number of rows each read covered, one entry per read."""
    found, real = [], top_p_mod._short_rows

    def counted(reached, reachable):
        found.append(len(reached))
        return real(reached, reachable)

    monkeypatch.setattr(top_p_mod, "_short_rows", counted)
    return found


def _tied_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(-2, 3, (rows, vocab), generator=torch.Generator().manual_seed(seed)).float()


def _float32_masses(z: torch.Tensor) -> torch.Tensor:
    """The running masses the top-p path compares with top_p: exp(z - max) / the row's sum, in
    the row's order by value desc, ties by id. z [V] -> [V]."""
    row_max, row_sum = top_p_mod._row_max_and_sum(z[None], torch.zeros(1, dtype=torch.int64))
    ordered = torch.tensor(sorted(z.tolist(), reverse=True))
    return ((ordered - row_max).exp() / row_sum).cumsum(dim=0)


@pytest.mark.parametrize("path", PATHS)
def test_top_p_at_each_float32_running_mass(path, monkeypatch):
    """At top_p equal to the float32 running mass of the first m tokens the support is those m
    tokens, one float32 step above it m + 1: the same on every path (the sort continues the
    candidates' running sums), also when the prefix ends inside or past the first candidates."""
    vocab = 40
    z = torch.randn(vocab, generator=torch.Generator().manual_seed(4)) * 2
    order = sorted(range(vocab), key=lambda t: (-float(z[t]), t))
    cum = _float32_masses(z)
    for m in (1, 2, 5, 6, 7, 17, 30):
        monkeypatch.setattr(top_p_mod, "STAGE_WIDTHS", PATHS[path](6))  # a boundary at 5, 6 or 7: each side
        for top_p, n in ((cum[m - 1], m), (torch.nextafter(cum[m - 1], torch.tensor(2.0)), m + 1)):
            pol = policy(z[None].clone(), row_params([dict(top_p=float(top_p))], vocab=vocab))
            ids, logp = support(pol, 0)
            assert ids == order[:n], f"m={m} top_p={float(top_p)!r}: {ids}"
            width = PATHS[path](6)[0]
            assert (pol.vocab_logp is None) == (n <= width)  # reached exactly at the last candidate: settled
            want = torch.softmax(z[order[:n]], dim=0)
            assert torch.allclose(logp.exp(), want, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
def test_ties_exactly_at_the_boundary(path, monkeypatch):
    """Eight allowed tokens of equal logits (p = 1/8, every prefix mass exact): top_p equal to a
    prefix's mass keeps that prefix, lowest ids first, one float32 step above keeps one more;
    whether the candidates (2 or 3 of them here) end inside the run of ties or not."""
    monkeypatch.setattr(top_p_mod, "STAGE_WIDTHS", PATHS[path](4))
    allowed = [3, 5, 6, 11, 20, 21, 30, 47]
    for m in range(1, 9):
        mass = torch.tensor(m / 8)
        above = [(torch.nextafter(mass, torch.tensor(2.0)), m + 1)] if m < 8 else []
        for top_p, n in [(mass, m), *above]:
            pol = policy(torch.zeros(1, 48), row_params([dict(top_p=float(top_p), allowed=set(allowed))]))
            ids, logp = support(pol, 0)
            assert ids == allowed[:n], f"top_p={float(top_p)!r}: {ids}"
            assert torch.allclose(logp.exp(), torch.full((n,), 1 / n))


def test_tied_rows_cut_inside_runs_of_ties(monkeypatch):
    """Logits in -2..2 (a fifth of the vocabulary shares each value): supports end inside runs
    of ties, within the first candidates, the second stage's, or past both."""
    monkeypatch.setattr(top_p_mod, "STAGE_WIDTHS", (5, 20))
    z = _tied_logits(24, 48, seed=1)
    specs = [dict(top_p=p) for p in (0.05, 0.13, 0.3, 0.45, 0.62, 0.8, 0.93, 0.99)] * 3
    specs[3] = dict(top_p=0.6, min_p=0.3, temperature=0.7)
    pol = policy(z.clone(), row_params(specs))
    sizes = [len(support(pol, r)[0]) for r in range(len(specs))]
    assert min(sizes) <= 5 and any(5 < s <= 20 for s in sizes) and max(sizes) > 20
    for r, spec in enumerate(specs):
        assert_row_matches(pol, r, reference_policy(z[r].tolist(), **spec))


def test_peaked_and_flat_rows_take_their_paths(reads, monkeypatch):
    """Peaked rows (a trained model's) are settled by their first candidates and stay in the
    candidate layout; flat rows need more, or the sort, and are in vocabulary order. One host read
    per stage that ran, each over the rows still open; the flattest rows skip the second stage: their
    first 16 candidates bound what 256 can reach (16's mass + 240 x the 16th's p) below top_p."""
    monkeypatch.setattr(top_p_mod, "STAGE_WIDTHS", (16, 256))
    g = torch.Generator().manual_seed(2)
    vocab = 3000
    peaked = torch.randn(4, vocab, generator=g) * 6
    middle = torch.randn(2, vocab, generator=g) * 3.5
    flat = torch.randn(2, vocab, generator=g) * 0.1
    z = torch.cat([peaked, middle, flat])
    specs = [dict(top_p=0.9)] * 8
    pol = policy(z.clone(), row_params(specs, vocab=vocab))
    sizes = [len(support(pol, r)[0]) for r in range(8)]
    assert max(sizes[:4]) <= 16 and all(16 < s <= 256 for s in sizes[4:6]) and min(sizes[6:]) > 256
    assert pol.in_cand.tolist() == [True] * 4 + [False] * 4
    assert pol.cand_ids.shape == (8, 16)
    assert reads == [8, 2]  # the middle rows only: the flat ones went to the sort
    for r, spec in enumerate(specs[:6]):
        assert_row_matches(pol, r, reference_policy(z[r].tolist(), **spec))
    for r in (6, 7):  # thousands of nearly equal float32 log-probs: their order here means nothing
        ref = reference_policy(z[r].tolist(), **specs[r])
        ids = torch.isfinite(pol.vocab_logp[r]).nonzero()[:, 0]
        assert set(ids.tolist()) == set(ref)
        assert torch.allclose(pol.vocab_logp[r, ids].exp(), torch.tensor([ref[t] for t in ids.tolist()]), rtol=1e-4)


def test_no_host_read_when_the_first_candidates_cover_the_vocabulary(reads):
    z = torch.randn(3, 48, generator=torch.Generator().manual_seed(3)) * 0.1  # flat: most of the row
    pol = policy(z.clone(), row_params([dict(top_p=0.99)] * 3))
    assert reads == [] and pol.in_cand is None and pol.cand_ids.shape == (3, 48)
    for r in range(3):
        assert_row_matches(pol, r, reference_policy(z[r].tolist(), top_p=0.99))


def _every_kind(vocab: int, g: torch.Generator) -> tuple[torch.Tensor, list[dict]]:
    specs = [dict(top_p=0.9), dict(top_p=0.95, min_p=0.01), dict(top_k=5, top_p=0.9), dict(), dict(min_p=0.1),
             dict(temperature=0.0), dict(top_p=0.5, temperature=1.5), dict(top_k=40)]
    scale = torch.tensor([6.0, 0.1, 2.0, 2.0, 2.0, 2.0, 0.3, 2.0])[:, None]  # top-p rows: peaked and flat
    return torch.randn(len(specs), vocab, generator=g) * scale, specs


def test_every_kind_of_row_in_one_batch(monkeypatch):
    monkeypatch.setattr(top_p_mod, "STAGE_WIDTHS", (8, 32))
    z, specs = _every_kind(300, torch.Generator().manual_seed(5))
    pol = policy(z.clone(), row_params(specs, vocab=300))
    assert pol.cand_ids.shape == (8, 40) and pol.in_cand[0] and not pol.in_cand[1]
    for r, spec in enumerate(specs):
        assert_row_matches(pol, r, reference_policy(z[r].tolist(), **ref_keywords(spec)))


def test_a_seeded_draw_does_not_depend_on_the_batch(monkeypatch):
    """Top-p rows of each path draw the same token alone as among rows of every kind."""
    monkeypatch.setattr(top_p_mod, "STAGE_WIDTHS", (8, 32))
    g = torch.Generator().manual_seed(6)
    parts = [_every_kind(300, g) for _ in range(20)]
    z = torch.cat([p[0] for p in parts])
    specs = [s for p in parts for s in p[1]]
    seeds = torch.randint(0, 2**62, (len(specs),), generator=g)
    pos = torch.randint(0, 1000, (len(specs),), generator=g)

    def draw(rows: list[int]):
        pol = policy(z[rows].clone(), row_params([specs[r] for r in rows], vocab=300))
        n, empty = len(rows), torch.zeros(0, dtype=torch.int64)
        res = verify_rows(pol, empty, None, [0] * n, list(range(n + 1)), empty, empty, seeds[rows], pos[rows])
        return res.tokens[:, 0], res.logprobs[:, 0]

    every = list(range(len(specs)))
    tokens, logp = draw(every)
    for kind in (0, 1, 6):
        alone = every[kind::8]
        t, lp = draw(alone)
        assert torch.equal(t, tokens[alone]) and torch.allclose(lp, logp[alone])
    assert len(set(tokens[1::8].tolist())) > 10  # flat rows: draws spread over their support


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("axis", ["seeds", "positions"])
def test_sampled_frequencies_on_each_path(axis, path, monkeypatch, reads):
    params = STAT_PATHS["top_p"]
    expected = _expected(params)
    monkeypatch.setattr(top_p_mod, "STAGE_WIDTHS", PATHS[path](len(expected)))
    stat, df = _chi2(_draws(policy, axis, params), expected)
    assert stat < _critical(df), f"chi2 {stat:.1f} with {df} dof"
    assert len(reads) == len(PATHS[path](0)) and _stat_logits().shape[0] > len(expected)  # a read per stage


def test_a_next_width_that_covers_the_row_is_the_sort(reads, monkeypatch):
    """Rows short of top_p at 16 candidates, where the next width (4096) covers the whole row
    (vocabulary 3000): they sort at once (one read, the first stage's), with the reference's supports."""
    monkeypatch.setattr(top_p_mod, "STAGE_WIDTHS", (16, 4096))
    sorted_rows, real_sort = [], top_p_mod.top_p_by_sort

    def counted_sort(z, rows, *args):
        sorted_rows.extend(rows.tolist())
        return real_sort(z, rows, *args)

    monkeypatch.setattr(top_p_mod, "top_p_by_sort", counted_sort)
    g = torch.Generator().manual_seed(7)
    z = torch.cat([torch.randn(2, 3000, generator=g) * 3.5, torch.randn(2, 3000, generator=g) * 0.1])
    specs = [dict(top_p=0.9)] * 4
    pol = policy(z.clone(), row_params(specs, vocab=3000))
    assert reads == [4] and sorted(sorted_rows) == [0, 1, 2, 3]  # not 4096 candidates: the sort
    for r in (0, 1):
        assert_row_matches(pol, r, reference_policy(z[r].tolist(), **specs[r]))
    for r in (2, 3):  # nearly equal float32 log-probs: compare the support as a set
        ref = reference_policy(z[r].tolist(), **specs[r])
        assert set(torch.isfinite(pol.vocab_logp[r]).nonzero()[:, 0].tolist()) == set(ref)
