"""Exactness of speculative verification (Contract 2), statistically, at the verify level.

A synthetic target over a 6-token vocabulary whose next-token logits depend on the previous
tokens (so p_2 is conditioned on the first draft), truncated by the real Contract-1 policy
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

import rollout.spec.verify as verify_mod
from rollout.engine.sampler import PURPOSE_ACCEPT, RowParams, policy, uniform_of_keys

V = 6
N = 30000


def _tables(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    z1 = torch.randn(V, generator=g) * 1.5  # [V]
    z2 = torch.randn(V, V, generator=g) * 1.5  # [prev, V]
    z3 = torch.randn(V, V, V, generator=g) * 1.5  # [prev2, prev, V]
    return z1, z2, z3


def _rows(n: int, top_k: int = 5, top_p: float = 0.97, min_p: float = 0.02, temperature: float = 1.3):
    return RowParams(
        temperature=torch.full((n,), temperature), top_k=torch.full((n,), top_k, dtype=torch.int64),
        top_p=torch.full((n,), top_p), min_p=torch.full((n,), min_p),
    )


def _exact_joint(z1, z2):
    """p(t1, t2) = p_1(t1) p_2(t2 | t1) under the Contract-1 policy."""
    p1 = policy(z1[None].clone(), _rows(1)).probs()[0]  # [V]
    p2 = policy(z2.clone(), _rows(V)).probs()  # [V, V]
    return p1[:, None] * p2


def _sample_two_tokens(q_onehot: bool, seed: int = 0) -> torch.Tensor:
    """Run N samples through verify; returns committed (t1, t2) pairs [N, 2]."""
    z1, z2, z3 = _tables()
    g = torch.Generator().manual_seed(seed + 1)
    q1 = torch.softmax(torch.randn(V, generator=g) * 2, 0)
    q2 = torch.softmax(torch.randn(V, V, generator=g) * 2, 1)
    if q_onehot:
        d1 = torch.full((N,), int(q1.argmax()))
        d2 = q2.argmax(1)[d1]
        q = None
    else:
        d1 = torch.multinomial(q1, N, replacement=True, generator=g)
        d2 = torch.multinomial(q2[d1], 1, generator=g)[:, 0]
        q = torch.stack([q1.expand(N, V), q2[d1]], dim=1).reshape(2 * N, V)  # [D, V]
    logits = torch.stack([z1.expand(N, V), z2[d1], z3[d1, d2]], dim=1).reshape(3 * N, V)  # rows of N blocks
    pol = policy(logits, _rows(3 * N))
    drafts = torch.stack([d1, d2], dim=1).reshape(-1)  # [2N]
    cu = list(range(0, 3 * N + 1, 3))
    rows = torch.arange(3 * N).reshape(N, 3)
    judge = rows[:, :2].reshape(-1)
    seeds = (torch.arange(N) * 7919 + 12345).repeat_interleave(3)
    positions = torch.tensor([10, 11, 12]).repeat(N)
    q = None if q is None else proposal(q, drafts)
    res = verify(pol, drafts, q, [2] * N, cu, judge, torch.arange(2 * N), seeds, positions)
    t1, t2 = res.tokens[:, 0].clone(), res.tokens[:, 1].clone()
    short = res.num_accepted == 0  # the block committed only t1: a plain step draws t2 given t1
    m = int(short.sum())
    pol2 = policy(z2[t1[short]].clone(), _rows(m))
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


@pytest.mark.parametrize("q_onehot", [False, True], ids=["sampled-drafts", "greedy-drafts"])
def test_joint_law_of_two_committed_tokens_is_exact(q_onehot):
    stat, df = _chi2(_sample_two_tokens(q_onehot), _exact_joint(*_tables()[:2]))
    assert df >= 6
    assert stat < _critical(df), f"chi2 {stat:.1f} with {df} dof"


def test_negative_control_accept_everything_is_detected(monkeypatch):
    """A verifier that accepts every draft the target allows must fail the same test."""

    def accept_all(keys, purpose):
        u = uniform_of_keys(keys, purpose)
        return torch.zeros_like(u) if purpose == PURPOSE_ACCEPT else u

    monkeypatch.setattr(verify_mod, "uniform_of_keys", accept_all)
    stat, df = _chi2(_sample_two_tokens(q_onehot=False), _exact_joint(*_tables()[:2]))
    assert stat > 5 * _critical(df), f"broken verifier not detected: chi2 {stat:.1f} with {df} dof"


def test_greedy_rows_commit_exactly_the_argmax():
    z1, z2, z3 = _tables()
    n = 64
    g = torch.Generator().manual_seed(3)
    d = torch.randint(0, V, (n, 2), generator=g)
    logits = torch.stack([z1.expand(n, V), z2[d[:, 0]], z3[d[:, 0], d[:, 1]]], 1).reshape(3 * n, V)
    greedy = RowParams(temperature=torch.ones(3 * n), top_k=torch.ones(3 * n, dtype=torch.int64),
                       top_p=torch.ones(3 * n), min_p=torch.zeros(3 * n))
    pol = policy(logits, greedy)
    res = verify(pol, d.reshape(-1), None, [2] * n, list(range(0, 3 * n + 1, 3)),
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
