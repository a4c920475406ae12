"""One step's choice of drafts (rollout/engine/draft_choice.py) on synthetic acceptance and cost
tables, no model: full blocks when drafts are nearly always accepted and verifying is cheap, none
when they are rejected or verify rows are expensive, drafts for the good samples only in a mixed
batch (also when steps replay CUDA graphs: ragged ones do too, at the graph's price), a choice
monotone in acceptance that stops where acceptance falls, the limits and the token room kept."""

from __future__ import annotations

import numpy as np
import pytest
from spec_helpers import cost_table, linear_target

from rollout.engine.draft_choice import choose_drafts
from rollout.engine.step_cost import Curve, StepCost

K = 7


def choose(acc, limits=None, cost=None, room=10_000, graphs=False, prefill=0):
    acc = np.asarray(acc, dtype=np.float64)
    limits = np.full(len(acc), K) if limits is None else np.asarray(limits)
    return choose_drafts(acc, limits, cost or cost_table(), len(acc), len(acc) + prefill, room, graphs)[0].drafts


def uniform(a: float, num: int = 8) -> np.ndarray:
    return np.full((num, K), a)


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


def test_ragged_blocks_replay_graphs_and_are_priced_as_graphed_steps():
    """Ragged steps replay CUDA graphs (rollout.engine.graphs pads them): with mixed acceptance and
    eager steps far dearer than graphed ones, the budget still drafts for the good samples only, at
    the graph's price. (Before, a ragged step was priced and run eagerly, so graphs forced one block
    size for all: 8 x 7 drafts here.)"""
    eager, graph = linear_target(10.0, 0.0025, K + 1), linear_target(4.0, 0.0025, K + 1)
    cost = StepCost(eager, graph, Curve((1.0,), (0.0005,)), learn=False)
    acc = np.concatenate([uniform(0.9, 4), uniform(0.3, 4)])
    budget = choose_drafts(acc, np.full(8, K), cost, 8, 8, 10_000, graphs=True)[0]
    assert budget.drafts[:4].min() > budget.drafts[4:].max()  # the good samples' drafts only (ragged)
    assert budget.seconds < 5e-3  # the graph's price (an eager step: > 10 ms)
