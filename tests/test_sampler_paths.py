"""The policy's paths (rollout.engine.sampler: top-k candidates, vocabulary order, top-p rows; more
on those in test_top_p.py) against the sampling-distribution reference where they are easiest to
get wrong: ties exactly at the k-th value, top-p exactly at a candidate's cumulative mass, top-p
supports of every size, the row chunks, mask rows, rows left without a token, and batches mixing
every kind of row. Draws per path and verification are covered statistically in test_sampler.py
and test_verify_stats.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from contract1_ref import reference_policy
from spec_helpers import verify_rows
from test_sampler import CASES, assert_row_matches, ref_keywords, row_params, support

import rollout.engine.sampler as sampler
import rollout.engine.top_p as top_p_mod
import rollout.engine.truncation as truncation
from rollout.engine.sampler import CAND, TOP_P, VOCAB, RowPlan, policy

NEG_INF = float("-inf")


def _tied_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Integer logits in -2..2: every value is shared by ~vocab / 5 tokens, so every cutoff falls
    inside a run of ties."""
    return torch.randint(-2, 3, (rows, vocab), generator=torch.Generator().manual_seed(seed)).float()


def _mismatches(z: torch.Tensor, specs: list[dict]) -> int:
    """Rows whose support (ids in order) or probabilities differ from the reference."""
    pol = policy(z.clone(), row_params(specs, vocab=z.shape[1]))
    bad = 0
    for r, spec in enumerate(specs):
        ref = reference_policy(z[r].tolist(), **ref_keywords(spec))
        ids, logp = support(pol, r)
        want = sorted(ref, key=lambda t: (-ref[t], t))
        bad += ids != want or not torch.allclose(logp.exp(), torch.tensor([ref[t] for t in want]), atol=1e-6)
    return bad


def _specs_cutting_ties(vocab: int, rows: int, **extra) -> list[dict]:
    return [dict(top_k=1 + (7 * r) % (vocab - 1), **extra) for r in range(rows)]


def _topk_highest_id_ties(z: torch.Tensor, k: int, dim: int = 1):
    """torch.topk as it is allowed to behave: values desc, ties at the cutoff to the highest ids."""
    flipped = z.flip(dims=[dim])  # equal values: the highest id comes first in a stable order
    vals, order = flipped.sort(dim=dim, descending=True, stable=True)
    return vals[:, :k], z.shape[dim] - 1 - order[:, :k]


@pytest.mark.parametrize("topk", ["torch", "highest-id-ties"])
@pytest.mark.parametrize("chunk_rows", [None, 5])
def test_ties_at_the_kth_value_keep_the_lowest_ids(topk, chunk_rows, monkeypatch):
    """Whichever tied tokens torch.topk returns (here also one that takes the highest ids), the
    candidates are those of a stable sort; rows also in chunks of 5."""
    if topk != "torch":
        monkeypatch.setattr(torch.Tensor, "topk", _topk_highest_id_ties)
    if chunk_rows:
        monkeypatch.setattr(truncation, "CHUNK_BYTES", 48 * truncation.TOPK_BYTES * chunk_rows)
    z = _tied_logits(64, 48, seed=1)
    assert _mismatches(z, _specs_cutting_ties(48, 64)) == 0
    assert _mismatches(z, _specs_cutting_ties(48, 64, top_p=0.7, min_p=0.1, temperature=0.7)) == 0
    wide = torch.randn(8, 3000, generator=torch.Generator().manual_seed(2)).bfloat16().float()  # bf16: ties
    assert _mismatches(wide, [dict(top_k=k) for k in (1, 2, 64, 200, 512, 999, 2048, 2999)]) == 0
    signed_zeros = torch.tensor([[0.0, -0.0, 1.0, -0.0, 0.0, -1.0]])
    assert _mismatches(signed_zeros, [dict(top_k=3)]) == 0  # -0.0 == 0.0: a tie, by id


def test_a_selection_that_breaks_ties_by_highest_id_is_detected(monkeypatch):
    """Negative control: the same check fails for a top-k whose ties at the cutoff go to the
    highest ids (what a bare torch.topk may do)."""
    monkeypatch.setattr(sampler, "top_candidates", lambda z, width: _topk_highest_id_ties(z, width)[1])
    assert _mismatches(_tied_logits(64, 48, seed=1), _specs_cutting_ties(48, 64)) > 20


@pytest.mark.parametrize("path", ["sort", "cand", "cand_wide"])
def test_top_p_reached_exactly_at_a_candidate(path):
    """Eight allowed tokens of equal logits: p = 1/8 and every prefix mass is exact in float32, so
    top_p equal to a prefix's mass keeps that prefix (ties by id), and one float32 step above
    it keeps one token more."""
    allowed = {3, 5, 6, 11, 20, 21, 30, 47}
    order = sorted(allowed)
    k = {"sort": {}, "cand": dict(top_k=8), "cand_wide": dict(top_k=20)}[path]
    z = torch.zeros(1, 48)
    for m in range(1, 9):
        mass = torch.tensor(m / 8)
        above = [(torch.nextafter(mass, torch.tensor(2.0)), m + 1)] if m < 8 else []
        for top_p, n in [(mass, m), *above]:
            spec = dict(top_p=float(top_p), allowed=allowed, **k)
            pol = policy(z.clone(), row_params([spec]))
            ids, logp = support(pol, 0)
            assert ids == order[:n], f"top_p={float(top_p)!r}: {ids}"
            assert torch.allclose(logp.exp(), torch.full((n,), 1 / n))
            assert set(reference_policy(z[0].tolist(), **ref_keywords(spec))) == set(order[:n])


@pytest.mark.parametrize("chunk_rows", [None, 3])
def test_top_p_only_rows_of_every_support_size(chunk_rows, monkeypatch):
    """Top-p rows without top-k: flat rows keep most of the vocabulary (past their 4 candidates:
    they sort), peaked rows a few tokens, tied rows cut inside a run of ties; alone, mixed with
    other rows, and in chunks of 3 rows (the batch's rows then sort in several pieces)."""
    monkeypatch.setattr(top_p_mod, "STAGE_WIDTHS", (4,))
    if chunk_rows:
        monkeypatch.setattr(truncation, "CHUNK_BYTES", 48 * truncation.SORT_BYTES * chunk_rows)
    g = torch.Generator().manual_seed(6)
    z = torch.cat([torch.randn(4, 48, generator=g) * 0.1, torch.randn(4, 48, generator=g) * 6,
                   _tied_logits(4, 48, seed=7)])  # flat, peaked, tied
    specs = [dict(top_p=p) for p in (0.95, 0.5, 0.99, 0.2)] * 3
    specs[2] = dict(top_p=0.9, min_p=0.2)
    pol = policy(z.clone(), row_params(specs))
    sizes = [len(support(pol, r)[0]) for r in range(len(specs))]
    assert max(sizes) > 40 and min(sizes) <= 2
    assert pol.in_cand.tolist() == [size <= 4 for size in sizes]  # more than 4 tokens: sorted
    for r, spec in enumerate(specs):
        assert_row_matches(pol, r, reference_policy(z[r].tolist(), **spec))
    mixed = specs + [dict(top_k=5), dict(), dict(temperature=0.0)]
    zm = torch.cat([z, torch.randn(3, 48, generator=g)])
    pol = policy(zm.clone(), row_params(mixed))
    for r, spec in enumerate(mixed):
        assert_row_matches(pol, r, reference_policy(zm[r].tolist(), **spec))


@pytest.mark.parametrize("chunk_rows", [None, 2])
def test_every_kind_of_row_in_one_batch(chunk_rows, monkeypatch):
    if chunk_rows:
        monkeypatch.setattr(truncation, "CHUNK_BYTES", 48 * truncation.SORT_BYTES * chunk_rows)
    specs = list(CASES.values()) + [dict(top_p=0.6, min_p=0.05), dict(min_p=0.2, temperature=1.4),
                                    dict(top_k=47), dict(top_k=2, temperature=0.5)]
    z = torch.randn(len(specs), 48, generator=torch.Generator().manual_seed(8)) * 2
    rows = row_params(specs)
    pol = policy(z.clone(), rows)
    plan = RowPlan.of(rows.top_k.tolist(), rows.top_p.tolist(), rows.min_p.tolist(), 48)
    assert {CAND, TOP_P, VOCAB} == set(plan.kind.tolist())
    assert pol.in_cand.tolist() == (plan.kind != VOCAB).tolist()  # top-p rows: their candidates suffice
    assert pol.cand_ids.shape == (len(specs), 48)  # top-p rows: the first width covers the vocabulary
    for r, spec in enumerate(specs):
        assert_row_matches(pol, r, reference_policy(z[r].tolist(), **ref_keywords(spec)))


def test_row_plan_from_request_parameters():
    top_k, top_p = [1, 5, 48, 48, 48, 48, 48], [1.0, 0.9, 1.0, 0.9, 1.0, 1.0, 0.5]
    min_p, masked = [0.0, 0.1, 0.0, 0.0, 0.3, 0.0, 0.0], [False] * 5 + [True] * 2
    plan = RowPlan.of(top_k, top_p, min_p, 48, masked=masked)
    assert plan.kind.tolist() == [CAND, CAND, VOCAB, TOP_P, VOCAB, CAND, CAND]
    assert plan.width == 48 and plan.min_p  # mask rows whose top_k is the vocabulary: all candidates
    assert not RowPlan.of([48], [0.5], [0.3], 48).min_p  # a top-p row applies its min-p while sorting
    assert RowPlan.of([48, 48], [1.0, 1.0], [0.0, 0.0], 48).width == 0


def test_rows_left_without_any_token():
    """The processors can leave a row nothing (a grammar allowing no token): no NaN anywhere, no
    support, and verification reports it."""
    specs = [dict(allowed=set()), dict(allowed=set(), top_k=4), dict(allowed=set(), top_p=0.5), dict(top_k=3),
             dict()]
    pol = policy(torch.randn(5, 48, generator=torch.Generator().manual_seed(9)), row_params(specs))
    assert pol.has_support.tolist() == [False, False, False, True, True]
    assert not pol.vocab_logp.isnan().any() and not pol.cand_logp.isnan().any()
    n = len(specs)
    empty = torch.zeros(0, dtype=torch.int64)
    res = verify_rows(pol, empty, None, [0] * n, list(range(n + 1)), empty, empty, torch.arange(n), torch.arange(n))
    assert res.has_support.tolist() == [False, False, False, True, True]
    assert torch.isneginf(res.logprobs[:3, 0]).all() and torch.isfinite(res.logprobs[3:, 0]).all()


def test_overwrite_works_in_place_with_the_same_result():
    specs = [CASES[name] for name in ("plain", "top_k", "top_p", "min_p", "hot", "greedy", "logit_bias")]
    z = torch.randn(len(specs), 48, generator=torch.Generator().manual_seed(10))
    copy = policy(z.clone(), row_params(specs))
    own = z.clone()
    inplace = policy(own, row_params(specs), overwrite=True)
    assert inplace.vocab_logp.data_ptr() == own.data_ptr()  # no [R, V] copy was made
    assert torch.equal(copy.cand_ids, inplace.cand_ids) and torch.equal(copy.cand_logp, inplace.cand_logp)
    assert torch.equal(copy.vocab_logp, inplace.vocab_logp)


def test_a_seeded_draw_does_not_depend_on_the_batch():
    """Rows of every path draw the same token alone as among other rows (whose kinds change the
    batch's layouts and candidate width)."""
    g = torch.Generator().manual_seed(11)
    specs = [dict(top_k=4), dict(), dict(top_p=0.8), dict(min_p=0.1), dict(temperature=0.0), dict(top_k=30)] * 30
    z = torch.randn(len(specs), 48, generator=g) * 2
    seeds = torch.randint(0, 2**62, (len(specs),), generator=g)
    pos = torch.randint(0, 1000, (len(specs),), generator=g)

    def draw(rows: list[int]):
        pol = policy(z[rows].clone(), row_params([specs[r] for r in rows]))
        n, empty = len(rows), torch.zeros(0, dtype=torch.int64)
        res = verify_rows(pol, empty, None, [0] * n, list(range(n + 1)), empty, empty, seeds[rows], pos[rows])
        return res.tokens[:, 0], res.logprobs[:, 0]

    every = list(range(len(specs)))
    tokens, logp = draw(every)
    for kind in range(6):
        alone = every[kind::6]
        t, lp = draw(alone)
        assert torch.equal(t, tokens[alone]) and torch.allclose(lp, logp[alone])
    assert len(set(tokens.tolist())) > 10
    assert np.unique(tokens[4::6].numpy()).size == np.unique(z[4::6].argmax(1).numpy()).size


@pytest.mark.parametrize("spec", ["none", "dflash"])
def test_engine_batch_of_every_kind_of_request(tiny_random_qwen3, random_drafters, spec):
    """One engine batch holding greedy, top-k (with masks), no-truncation, top-p-only and min-p-only
    samples, without and with sampled DFlash drafts: every sample runs to its length with finite
    log-probs, masks are well formed, and the greedy sample equals greedy decoding alone."""
    from test_masks_engine import _check_sample, _engine, _run

    from rollout.engine.params import SamplingParams

    base = dict(max_tokens=8, ignore_eos=True, seed=3)
    greedy = SamplingParams(temperature=0.0, **base)
    kinds = {"greedy": greedy, "top_k": SamplingParams(top_k=12, top_p=0.9, min_p=0.01, **base),
             "dense": SamplingParams(temperature=1.0, **base), "top_p": SamplingParams(top_p=0.8, **base),
             "min_p": SamplingParams(min_p=0.1, temperature=1.2, **base)}
    masks = {"greedy": "support", "top_k": "support"}
    prompt = [[5, 6, 7, 8, 9], [100, 101]]
    eng = _engine(tiny_random_qwen3, spec, random_drafters.get(spec))
    for name, params in kinds.items():
        eng.add_request(name, prompt, params, n=2, mask=masks.get(name))
    outs = _run(eng)
    assert len(outs) == 5 * 4
    for o in outs:
        assert len(o.token_ids) == 8 and all(math.isfinite(lp) and lp <= 0 for lp in o.token_logprobs)
        if o.request_id in masks:
            _check_sample(o, kinds[o.request_id], "support")
    alone = _engine(tiny_random_qwen3)
    alone.add_request("greedy", prompt, greedy)
    want = {o.prompt_index: o.token_ids for o in _run(alone)}
    assert all(o.token_ids == want[o.prompt_index] for o in outs if o.request_id == "greedy")


def test_drafter_draws_follow_the_q_it_hands_over(monkeypatch):
    """A sampling drafter's drafts follow q = softmax(z / T), the Proposal it hands to verify holds
    that q (tempered logits scaled in place, their logsumexp), greedy rows draft the argmax; the
    rows are drawn in chunks of 7."""
    from rollout.engine.sampler import PURPOSE_DRAFT, uniform
    from rollout.spec.proposer import _draw

    monkeypatch.setattr(truncation, "CHUNK_BYTES", 16 * truncation.ELEMENTWISE_BYTES * 7)
    n, vocab = 20000, 16
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(12)).expand(n, 2, vocab).clone()
    temp = torch.tensor([0.7, 1.0]).repeat(n // 2)[:, None, None]  # [n, 1, 1]
    greedy = (torch.arange(n) % 10 == 0)[:, None]  # [n, 1]
    u = uniform(torch.arange(n)[:, None].expand(n, 2), torch.arange(2).expand(n, 2), PURPOSE_DRAFT)
    raw = logits.clone()
    drafts, lse = _draw(logits, temp, greedy, u)
    assert torch.allclose(logits, raw / temp) and torch.allclose(lse, torch.logsumexp(raw / temp, dim=-1))
    assert (drafts[greedy[:, 0]] == raw[0, 0].argmax()).all()
    for t in (0.7, 1.0):
        rows = (temp[:, 0, 0] == t) & ~greedy[:, 0]
        tokens = drafts[rows].flatten()
        q = torch.softmax(raw[0, 0] / t, dim=0)
        counts = torch.bincount(tokens, minlength=vocab).double()
        stat = float(((counts - len(tokens) * q) ** 2 / (len(tokens) * q)).sum())
        assert stat < 60, f"T={t}: chi2 {stat:.1f} with {vocab - 1} dof"  # ~1e-6 tail at 15 dof
