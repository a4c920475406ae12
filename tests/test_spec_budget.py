"""The draft budget (rollout/engine/spec_budget.py) and the step-cost model (step_cost.py) on
synthetic acceptance and cost tables, no model: full blocks when drafts are nearly always accepted
and verifying is cheap, none when they are rejected or verify rows are expensive, drafts for the
good samples only in a mixed batch, a budget monotone in acceptance, the limits and the token room
kept; the acceptance estimates converge on a synthetic stream, follow a drift, and start a new
sample at the server-wide estimate; probes stay within their share of the time; the cost model
learns a kind of step's wall time and stays put when frozen."""

from __future__ import annotations

import numpy as np
import pytest
from spec_helpers import cost_table, linear_target

from rollout.engine.params import SamplingParams
from rollout.engine.sequence import SeqStatus, Sequence
from rollout.engine.spec_budget import PROBE_SHARE, AcceptanceEstimates, SpecBudget, choose_drafts
from rollout.engine.step_cost import Curve, StepCost, TargetCost

K = 7


def choose(acc, limits=None, cost=None, room=10_000, graphs=False, prefill=0):
    acc = np.asarray(acc, dtype=np.float64)
    limits = np.full(len(acc), K) if limits is None else np.asarray(limits)
    return choose_drafts(acc, limits, cost or cost_table(), len(acc), len(acc) + prefill, room, graphs)[0].drafts


def uniform(a: float, num: int = 8) -> np.ndarray:
    return np.full((num, K), a)


# -- the budget -------------------------------------------------------------------------------------


@pytest.mark.parametrize("graphs", [False, True])
def test_acceptance_near_one_and_cheap_verify_gives_full_blocks(graphs):
    cost = cost_table(decode_ms=5.0, token_ms=0.01, drafter_ms=0.5, graph=graphs)
    assert choose(uniform(0.97), cost=cost, graphs=graphs).tolist() == [K] * 8


def test_acceptance_near_zero_gives_no_drafts():
    cost = cost_table(decode_ms=5.0, token_ms=0.01, drafter_ms=0.5)
    assert choose(uniform(0.02), cost=cost).tolist() == [0] * 8


def test_expensive_verify_rows_give_no_drafts():
    """Compute-bound: a draft token costs as much as a decode row (batch 256); good acceptance
    (0.6) does not pay for a drafter forward plus rows that mostly miss."""
    cost = cost_table(decode_ms=0.0, token_ms=0.1, drafter_ms=5.0)
    assert choose(uniform(0.6, 256), cost=cost).sum() == 0


def test_mixed_batch_drafts_for_the_good_samples_only():
    cost = cost_table(decode_ms=2.0, token_ms=0.05, drafter_ms=0.2)
    acc = np.concatenate([uniform(0.95, 16), uniform(0.05, 16)])
    drafts = choose(acc, cost=cost)
    assert (drafts[:16] >= 4).all() and (drafts[16:] == 0).all()


def test_budget_is_monotone_in_acceptance():
    for cost in (cost_table(2.0, 0.05, 0.5), cost_table(1.0, 0.2, 2.0), cost_table(5.0, 0.01, 0.1, graph=True)):
        totals = [int(choose(uniform(a, 32), cost=cost, graphs=cost.graph is not None).sum())
                  for a in np.linspace(0.0, 1.0, 41)]
        assert totals == sorted(totals), totals
        assert totals[0] == 0 and totals[-1] == 32 * K


def test_per_position_budget_stops_where_acceptance_falls():
    """Conditional acceptance high for the first three drafts, then near zero: three drafts."""
    cost = cost_table(decode_ms=2.0, token_ms=0.05, drafter_ms=0.2)
    acc = np.tile([0.95, 0.95, 0.95, 0.05, 0.05, 0.05, 0.05], (16, 1))
    assert choose(acc, cost=cost).tolist() == [3] * 16


def test_limits_and_room_are_kept():
    cost = cost_table(decode_ms=5.0, token_ms=0.0)
    assert choose(uniform(0.99, 4), limits=[7, 2, 0, 5], cost=cost).tolist() == [7, 2, 0, 5]
    drafts = choose(uniform(0.99, 4), cost=cost, room=10)
    assert drafts.sum() <= 10 and drafts.sum() >= 8


def test_uniform_blocks_win_when_only_they_replay_a_graph():
    """Graphs make a ragged step pay the eager price: with mixed acceptance at small batch the
    budget picks one block size for all (a graph) over drafts for the good samples only (eager)."""
    eager, graph = linear_target(10.0, 0.0025, K + 1), linear_target(4.0, 0.0025, K + 1)
    cost = StepCost(eager, graph, Curve((1.0,), (0.0005,)), learn=False)
    acc = np.concatenate([uniform(0.9, 4), uniform(0.3, 4)])
    drafts = choose(acc, cost=cost, graphs=True)
    assert len(set(drafts.tolist())) == 1 and drafts[0] > 0
    assert len(set(choose(acc, cost=cost, graphs=False).tolist())) > 1  # eager: ragged is fine


# -- acceptance estimates ----------------------------------------------------------------------------


def _seq(i: int) -> Sequence:
    return Sequence(i, f"r{i}", 0, 0, [1, 2], SamplingParams(max_tokens=64), seed=i)


def _verify_stream(est: AcceptanceEstimates, seqs, truth: np.ndarray, steps: int, rng) -> None:
    """Full blocks verified against a true conditional acceptance [K]: accepted = leading passes."""
    for _ in range(steps):
        passes = rng.random((len(seqs), K)) < truth
        accepted = np.cumprod(passes, axis=1).sum(axis=1)
        est.observe(seqs, np.full(len(seqs), K), accepted)


def test_estimates_converge_on_a_synthetic_stream():
    rng = np.random.default_rng(0)
    truth = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3])
    est = AcceptanceEstimates(K)
    seqs = [_seq(i) for i in range(64)]
    _verify_stream(est, seqs, truth, 200, rng)
    error = np.abs(est.server_wide() - truth)
    assert error[:5].max() < 0.05 and error.max() < 0.1  # deep positions are tried less often
    per_sample = est.of(seqs)  # each an EMA over few drafts: noisy, centred on the truth
    assert np.abs(per_sample.mean(axis=0)[:4] - truth[:4]).max() < 0.05


def test_a_sample_whose_acceptance_drops_is_followed_and_a_new_one_starts_server_wide():
    rng = np.random.default_rng(1)
    est = AcceptanceEstimates(K)
    good, drifting = [_seq(i) for i in range(32)], _seq(99)
    _verify_stream(est, good + [drifting], np.full(K, 0.9), 50, rng)
    assert est.of([drifting])[0, 0] > 0.8
    for _ in range(10):
        est.observe([drifting], np.array([K]), np.array([0]))
        est.observe(good, np.full(32, K), np.full(32, K))
    assert est.of([drifting])[0, 0] < 0.4  # followed within 10 verify steps (shrunk towards 0.9 server-wide)
    newcomer = est.of([_seq(100)])[0]
    np.testing.assert_allclose(newcomer, est.server_wide())


def test_rows_of_finished_samples_are_reused():
    est = AcceptanceEstimates(K, capacity=4)
    first = [_seq(i) for i in range(4)]
    est.of(first)
    for s in first[:2]:
        s.status = SeqStatus.FINISHED
    est.of([_seq(10), _seq(11)])
    assert len(est.tried) == 4 and len(est.rows) == 4
    est.of([_seq(12)])  # full again: grows
    assert len(est.tried) == 8


# -- probes -------------------------------------------------------------------------------------------


def test_probes_stay_within_their_share():
    """Drafts never pay here, so only probes verify: about PROBE_SHARE of the time goes to them."""
    cost = cost_table(decode_ms=10.0, token_ms=0.5, drafter_ms=2.0)
    budget = SpecBudget(K, cost, graphs=False, max_graph_rows=0)
    seqs = [_seq(i) for i in range(8)]
    for s in seqs:
        s.num_computed_tokens = s.num_tokens - 1
    budget.acceptance.observe(seqs, np.full(8, K), np.zeros(8, dtype=np.int64))
    plain = float(cost.seconds(8, 8, False, 0))
    extra = float(cost.seconds(8, 8 + 8 * K, False, 8)) - plain
    probes = sum(sum(budget.caps(seqs, False, 2048).values()) > 0 for _ in range(2000))
    expected = 2000 * PROBE_SHARE * plain / extra
    assert budget.totals["probes"] == probes and 0.8 * expected <= probes <= expected + 1


# -- the cost model -----------------------------------------------------------------------------------


def test_tables_interpolate_and_extrapolate():
    c = Curve((1.0, 9.0, 17.0), (1.0, 2.0, 4.0))
    np.testing.assert_allclose(c([0, 1, 5, 17, 25]), [1.0, 1.0, 1.5, 4.0, 6.0])
    with pytest.raises(ValueError):
        Curve((2.0, 1.0), (1.0, 1.0))
    target = TargetCost((1, 16), (1.0, 2.0), (2.0, 6.0), q=5)  # a draft token: 0.25 (1 row), 1/16 (16 rows)
    np.testing.assert_allclose(target(1, [1, 3, 5, 9]), [1.0, 1.5, 2.0, 3.0])
    np.testing.assert_allclose(target(16, [16, 80]), [2.0, 6.0])
    assert float(target(32, 32)) == pytest.approx(2.0 + 16 / 15)  # rows extrapolated


def test_cost_model_learns_a_kind_of_step_and_a_frozen_one_does_not():
    learned, frozen = cost_table(1.0, 0.1), cost_table(1.0, 0.1)
    learned.learn = True
    for _ in range(60):  # verify steps take 3x the curve's prediction (say, sampling on many rows)
        truth = 3 * float(frozen.seconds(32, 256, False, 32))
        learned.observe(32, 256, False, 32, truth)
        frozen.observe(32, 256, False, 32, truth)
    assert learned.seconds(32, 256, False, 32) == pytest.approx(truth, rel=0.02)
    assert learned.seconds(64, 512, False, 64) > 2.5 * frozen.seconds(64, 512, False, 64)  # carried to other rows
    assert learned.seconds(32, 32, False, 0) == pytest.approx(frozen.seconds(32, 32, False, 0))  # decode untouched
    assert frozen.seconds(32, 256, False, 32) == pytest.approx(truth / 3)
