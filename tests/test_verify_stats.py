"""Exactness of speculative verification (docs/verification.md), statistically, at the verify level.

A synthetic target over a 6-token vocabulary whose next-token logits depend on the previous
tokens (so p_2 is conditioned on the first draft), truncated by the real policy (docs/sampling.md)
(top-k, top-p, min-p, penalties-free here; processors are covered in test_sampler). Many
independent samples draft two tokens from a proposal q, are verified in one batched call,
and samples whose block ended after one token draw their second token in a plain K=0 step,
exactly as the engine would. The joint law of the first two committed tokens must equal
p_1(t_1) p_2(t_2 | t_1). A verifier that accepts every draft the target allows fails the same
test (negative control).
"""

from __future__ import annotations

import math

import pytest
import torch
from spec_helpers import proposal
from spec_helpers import verify_rows as verify

import rollout.engine.top_p as top_p_mod
import rollout.engine.verify as verify_mod
from rollout.engine.sampler import PURPOSE_ACCEPT, RowParams, policy, uniform_of_keys

V = 6
N = 30000


def _tables(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    z1 = torch.randn(V, generator=g) * 1.5  # [V]
    z2 = torch.randn(V, V, generator=g) * 1.5  # [prev, V]
    z3 = torch.randn(V, V, V, generator=g) * 1.5  # [prev2, prev, V]
    return z1, z2, z3


# the policy's paths (rollout.engine.sampler): top-k candidates, the vocabulary in vocabulary order
# (no truncation; min-p only), top-p rows (their candidates; the other top-p paths below), and a
# batch whose samples mix all of them
KINDS = {
    "top_k": dict(top_k=5, top_p=0.97, min_p=0.02),
    "dense": dict(),
    "min_p": dict(min_p=0.1),
    "top_p": dict(top_p=0.8),
}


def _rows(n: int, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, temperature: float = 1.3):
    return RowParams(
        temperature=torch.full((n,), temperature), top_k=torch.full((n,), top_k if top_k > 0 else V),
        top_p=torch.full((n,), top_p), min_p=torch.full((n,), min_p),
    )


def _mixed_rows(kinds: list[str], kind_of: torch.Tensor) -> RowParams:
    """Row r takes the parameters of KINDS[kinds[kind_of[r]]]; kind_of: [R] int64."""
    table = [_rows(1, **KINDS[k]) for k in kinds]
    return RowParams(*(torch.cat([getattr(r, f) for r in table])[kind_of]
                       for f in ("temperature", "top_k", "top_p", "min_p")))


def _exact_joint(z1, z2, params: dict):
    """p(t1, t2) = p_1(t1) p_2(t2 | t1) under the policy (docs/sampling.md)."""
    p1 = policy(z1[None].clone(), _rows(1, **params)).probs()[0]  # [V]
    p2 = policy(z2.clone(), _rows(V, **params)).probs()  # [V, V]
    return p1[:, None] * p2


def _sample_two_tokens(q_onehot: bool, kinds: list[str], seed: int = 0) -> torch.Tensor:
    """Run N samples through verify, sample i with the parameters KINDS[kinds[i % len(kinds)]]
    (all in one batch); returns committed (t1, t2) pairs [N, 2]. With sampled drafts, every
    fifth sample drafts greedily (one-hot q rows among sampled ones)."""
    z1, z2, z3 = _tables()
    g = torch.Generator().manual_seed(seed + 1)
    q1 = torch.softmax(torch.randn(V, generator=g) * 2, 0)
    q2 = torch.softmax(torch.randn(V, V, generator=g) * 2, 1)
    if q_onehot:
        d1 = torch.full((N,), int(q1.argmax()))
        d2 = q2.argmax(1)[d1]
        q = None
    else:
        greedy = torch.arange(N) % 5 == 0
        d1 = torch.where(greedy, q1.argmax(), torch.multinomial(q1, N, replacement=True, generator=g))
        d2 = torch.where(greedy, q2.argmax(1)[d1], torch.multinomial(q2[d1], 1, generator=g)[:, 0])
        q = torch.stack([q1.expand(N, V), q2[d1]], dim=1).reshape(2 * N, V)  # [D, V]
    logits = torch.stack([z1.expand(N, V), z2[d1], z3[d1, d2]], dim=1).reshape(3 * N, V)  # rows of N blocks
    kind_of = torch.arange(N) % len(kinds)  # [N] each sample's kind
    pol = policy(logits, _mixed_rows(kinds, kind_of.repeat_interleave(3)))
    drafts = torch.stack([d1, d2], dim=1).reshape(-1)  # [2N]
    cu = list(range(0, 3 * N + 1, 3))
    rows = torch.arange(3 * N).reshape(N, 3)
    judge = rows[:, :2].reshape(-1)
    seeds = (torch.arange(N) * 7919 + 12345).repeat_interleave(3)
    positions = torch.tensor([10, 11, 12]).repeat(N)
    if q is not None:
        q = proposal(q, drafts, greedy.repeat_interleave(2))
    res = verify(pol, drafts, q, [2] * N, cu, judge, torch.arange(2 * N), seeds, positions)
    t1, t2 = res.tokens[:, 0].clone(), res.tokens[:, 1].clone()
    short = (res.num_accepted == 0).nonzero()[:, 0]  # only t1 committed: a plain step draws t2
    pol2 = policy(z2[t1[short]].clone(), _mixed_rows(kinds, kind_of[short]))
    m = len(short)
    res2 = verify(pol2, torch.zeros(0, dtype=torch.int64), None, [0] * m, list(range(m + 1)),
                  torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                  seeds.reshape(N, 3)[short, 0], torch.full((m,), 11))
    t2[short] = res2.tokens[:, 0]
    return torch.stack([t1, t2], dim=1)


def _chi2(pairs: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    obs = torch.zeros(V, V)
    obs.index_put_((pairs[:, 0], pairs[:, 1]), torch.ones(len(pairs)), accumulate=True)
    exp = expected * len(pairs)
    impossible = obs[exp == 0].sum().item()
    assert impossible == 0, f"{impossible} samples outside the policy's support"
    cells = exp >= 5
    stat = (((obs - exp) ** 2) / exp.clamp(min=1e-12))[cells].sum().item()
    return stat, int(cells.sum()) - 1


def _critical(df: int, z: float = 4.0) -> float:
    """Chi-square quantile at ~3e-5 upper tail (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("kinds", [["top_k"], ["dense"], ["min_p"], ["top_p"], list(KINDS)],
                         ids=["top_k", "dense", "min_p", "top_p", "mixed"])
@pytest.mark.parametrize("q_onehot", [False, True], ids=["sampled-drafts", "greedy-drafts"])
def test_joint_law_of_two_committed_tokens_is_exact(q_onehot, kinds):
    pairs = _sample_two_tokens(q_onehot, kinds)
    for j, kind in enumerate(kinds):  # each kind's samples against its own law
        stat, df = _chi2(pairs[j::len(kinds)], _exact_joint(*_tables()[:2], KINDS[kind]))
        assert df >= 6
        assert stat < _critical(df), f"{kind}: chi2 {stat:.1f} with {df} dof"


@pytest.mark.parametrize("widths", [(2,), (2, 4)], ids=["sorted", "escalated"])
@pytest.mark.parametrize("q_onehot", [False, True], ids=["sampled-drafts", "greedy-drafts"])
def test_top_p_rows_past_their_first_candidates_verify_exactly(q_onehot, widths, monkeypatch):
    """Top-p rows without top-k whose first candidates (2 of 6 tokens) do not reach top_p: some rows
    of the batch are settled by the candidates (the candidate layout), the others by more candidates
    or the sort (vocabulary order). The law is the one computed with candidates covering the row."""
    expected = _exact_joint(*_tables()[:2], KINDS["top_p"])
    reads = []
    real = top_p_mod._short_rows
    monkeypatch.setattr(top_p_mod, "STAGE_WIDTHS", widths)
    monkeypatch.setattr(top_p_mod, "_short_rows", lambda *flags: reads.append(real(*flags)) or reads[-1])
    stat, df = _chi2(_sample_two_tokens(q_onehot, ["top_p"]), expected)
    assert 0 < reads[0][0].mean() < 1  # both layouts in the verified batch (reads: short, next stage)
    assert stat < _critical(df), f"chi2 {stat:.1f} with {df} dof"


def test_negative_control_accept_everything_is_detected(monkeypatch):
    """A verifier that accepts every draft the target allows must fail the same test."""

    def accept_all(keys, purpose):
        u = uniform_of_keys(keys, purpose)
        return torch.zeros_like(u) if purpose == PURPOSE_ACCEPT else u

    monkeypatch.setattr(verify_mod, "uniform_of_keys", accept_all)
    stat, df = _chi2(_sample_two_tokens(False, ["top_k"]), _exact_joint(*_tables()[:2], KINDS["top_k"]))
    assert stat > 5 * _critical(df), f"broken verifier not detected: chi2 {stat:.1f} with {df} dof"


@pytest.mark.parametrize("all_greedy", [True, False], ids=["fast-path", "planned"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy-drafts", "sampled-drafts"])
def test_greedy_rows_commit_exactly_the_argmax(sampled, all_greedy):
    """Whatever q the drafts came from (a sampling drafter's, or one-hot), greedy rows commit the
    target's argmax chain: p(d) is 1 or 0, and the residual after a rejection is the argmax."""
    z1, z2, z3 = _tables()
    n = 64
    g = torch.Generator().manual_seed(3)
    d = torch.randint(0, V, (n, 2), generator=g)
    logits = torch.stack([z1.expand(n, V), z2[d[:, 0]], z3[d[:, 0], d[:, 1]]], 1).reshape(3 * n, V)
    greedy = RowParams(temperature=torch.ones(3 * n), top_k=torch.ones(3 * n, dtype=torch.int64),
                       top_p=torch.ones(3 * n), min_p=torch.zeros(3 * n), all_greedy=all_greedy)
    pol = policy(logits, greedy)
    q = proposal(torch.softmax(torch.randn(2 * n, V, generator=g), 1), d.reshape(-1)) if sampled else None
    res = verify(pol, d.reshape(-1), q, [2] * n, list(range(0, 3 * n + 1, 3)),
                 torch.arange(3 * n).reshape(n, 3)[:, :2].reshape(-1), torch.arange(2 * n),
                 torch.arange(3 * n), torch.arange(3 * n))
    arg = logits.reshape(n, 3, V).argmax(-1)  # [n, 3]
    for i in range(n):
        a = int(res.num_accepted[i])
        assert d[i, :a].tolist() == arg[i, :a].tolist()
        if a < 2:
            assert d[i, a] != arg[i, a]
        assert int(res.tokens[i, a]) == int(arg[i, a])
        assert res.logprobs[i, : a + 1].abs().max() == 0
