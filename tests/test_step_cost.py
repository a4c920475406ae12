"""The step-cost model (rollout/engine/step_cost.py) the draft budget prices steps with, on synthetic
tables: curves interpolate and extrapolate; the model learns a kind of step's wall time (the plain
part and what drafting adds, each with its own correction) and stays put when frozen; a kind of step
whose time varies is priced at its mean time; drafting is never priced below the plain step, so an
untrained drafter gets no drafts; a graphed step is priced at its graph's padded tokens."""

from __future__ import annotations

import numpy as np
import pytest
from spec_helpers import cost_table, linear_target

from rollout.engine.draft_choice import choose_drafts
from rollout.engine.step_cost import Curve, StepCost, TargetCost

K = 7


def test_tables_interpolate_and_extrapolate():
    c = Curve((1.0, 9.0, 17.0), (1.0, 2.0, 4.0))
    points, values = [0, 1, 5, 17, 25], [1.0, 1.0, 1.5, 4.0, 6.0]
    np.testing.assert_allclose(c(np.array(points, dtype=float)), values)
    assert [c.at(x) for x in points] == pytest.approx(values)
    with pytest.raises(ValueError):
        Curve((2.0, 1.0), (1.0, 1.0))
    target = TargetCost((1, 16), (1.0, 2.0), (2.0, 6.0), q=5)  # a draft token: 0.25 (1 row), 1/16 (16 rows)
    assert [target.at(1, t) for t in (1, 3, 5, 9)] == pytest.approx([1.0, 1.5, 2.0, 3.0])
    assert [target.at(16, t) for t in (16, 80)] == pytest.approx([2.0, 6.0])
    assert target.at(32, 32) == pytest.approx(2.0 + 16 / 15)  # rows extrapolated
    cost = StepCost(target, drafter=Curve((1, 4), (0.5, 1.0)), learn=False)
    np.testing.assert_allclose(cost.ragged_seconds(4, 4, np.array([1, 2, 4])),
                               [cost.seconds(4, 4, False, rows, n) for n, rows in ((1, 1), (2, 2), (3, 4))])


def test_cost_model_learns_a_kind_of_step_and_a_frozen_one_does_not():
    learned, frozen = cost_table(1.0, 0.1, drafter_ms=0.5), cost_table(1.0, 0.1, drafter_ms=0.5)
    learned.learn = True
    plain = frozen.seconds(32, 32)
    extra = frozen.seconds(32, 32, False, 32, 224) - plain
    truth = plain + 3 * extra  # drafting adds 3x what the tables say (say, sampling on many rows)
    for _ in range(60):
        learned.observe(32, 32, False, 32, 224, truth)
        frozen.observe(32, 32, False, 32, 224, truth)
    assert learned.seconds(32, 32, False, 32, 224) == pytest.approx(truth, rel=0.02)
    carried = learned.seconds(64, 64, False, 64, 448) - learned.seconds(64, 64)  # to other rows
    assert carried > 2.5 * (frozen.seconds(64, 64, False, 64, 448) - frozen.seconds(64, 64))
    assert learned.seconds(32, 32) == pytest.approx(plain)  # plain steps untouched
    assert frozen.seconds(32, 32, False, 32, 224) == pytest.approx(plain + extra)
    for _ in range(60):  # plain steps take 2x the tables' prediction: the drafting steps were seen whole,
        learned.observe(32, 32, False, 0, 0, 2 * plain)  # so their price stays what they took (_rebase)
    assert learned.seconds(32, 32) == pytest.approx(2 * plain, rel=0.02)
    assert learned.seconds(32, 32, False, 32, 224) == pytest.approx(truth, rel=0.02)
    for _ in range(60):  # then drafting steps take longer too: their price follows
        learned.observe(32, 32, False, 32, 224, 2 * plain + 3 * extra)
    assert learned.seconds(32, 32, False, 32, 224) == pytest.approx(2 * plain + 3 * extra, rel=0.02)


def test_the_learned_correction_prices_a_kind_of_step_at_its_mean_time():
    """Throughput follows the mean step time: steps of one kind alternating between 1x and 3x the
    tables' time are priced at 2x, not at the geometric mean (1.73x, which underpriced steps whose
    time varies, e.g. drafting steps, so drafting was bought where it lost)."""
    cost, tables = cost_table(1.0, 0.1, drafter_ms=0.5), cost_table(1.0, 0.1, drafter_ms=0.5)
    cost.learn = True
    plain = tables.seconds(32, 32)
    extra = tables.seconds(32, 32, False, 32, 224) - plain
    for i in range(400):
        cost.observe(32, 32, False, 0, 0, plain * (1 + 2 * (i % 2)))
        cost.observe(32, 32, False, 32, 224, 2 * plain + extra * (1 + 2 * (i % 2)))
    assert cost.seconds(32, 32) == pytest.approx(2 * plain, rel=0.1)
    assert cost.seconds(32, 32, False, 32, 224) - cost.seconds(32, 32) == pytest.approx(2 * extra, rel=0.1)


@pytest.mark.parametrize("graphed", [False, True])
def test_drafting_is_never_priced_below_the_plain_step_whatever_was_learned(graphed):
    """Plain steps take 1.5x the tables' time, drafting steps of 64 drafting rows take what the tables
    say for them: a step drafting a few tokens costs at least the plain step, and an untrained drafter
    (acceptance ~0.003) gets no drafts. (With one correction per kind of step, a 1-slot step was priced
    at the drafting correction, below the plain one: such steps were chosen nearly every step.)"""
    cost = cost_table(decode_ms=13.0, token_ms=0.01, drafter_ms=1.0, graph=graphed)
    cost.learn = True
    tables = cost_table(decode_ms=13.0, token_ms=0.01, drafter_ms=1.0, graph=graphed)
    for _ in range(40):
        cost.observe(256, 256, graphed, 0, 0, 1.5 * tables.seconds(256, 256, graphed))
        cost.observe(256, 256, graphed, 64, 64 * K, tables.seconds(256, 256, graphed, 64, 64 * K))
    plain = cost.seconds(256, 256, graphed)
    assert plain == pytest.approx(1.5 * tables.seconds(256, 256, graphed), rel=0.02)
    for rows, drafts in ((1, 1), (4, 4), (64, 64 * K)):
        assert cost.seconds(256, 256, graphed, rows, drafts) > plain
    assert (cost.ragged_seconds(256, 256, np.arange(1, 65), graphed) > plain).all()
    budget = choose_drafts(np.full((256, K), 0.003), np.full(256, K), cost, 256, 256, 10_000, graphs=graphed)[0]
    assert budget.k == 0 or not budget.drafts.any(), budget


def test_plain_steps_seen_late_give_back_what_drafting_absorbed():
    """A bucket where only drafting steps ran borrows its kind's plain correction, taught by plain
    steps at another bucket that cost less: its drafting correction absorbs the plain prediction's
    error. Once plain steps at that bucket teach its true cost, drafting there is priced at its true
    cost again (before the rebase it was priced high by the same error until probes unlearned it).
    Once the bucket's plain correction is its own, its later moves carry drafting steps along."""
    rows = [1, 16, 256]
    target = TargetCost(rows, [0.30e-3, 0.32e-3, 0.38e-3], [0.30e-3, 0.35e-3, 0.57e-3], 8)
    cost = StepCost(target, target, Curve(rows, [0.2e-3, 0.23e-3, 0.43e-3]))
    plain_16, plain_256, drafting = 3.0e-3, 4.8e-3, 2.0e-3  # true seconds (a host-bound engine)
    for _ in range(50):
        cost.observe(16, 16, True, 0, 0, plain_16)
    for _ in range(30):
        cost.observe(256, 256, True, 256, 1792, plain_256 + drafting)
    assert cost.seconds(256, 256, True) < 0.8 * plain_256  # borrowed: priced low
    assert cost.seconds(256, 256, True, 256, 1792) == pytest.approx(plain_256 + drafting)
    for _ in range(10):
        cost.observe(256, 256, True, 0, 0, plain_256)
    assert cost.seconds(256, 256, True) == pytest.approx(plain_256)
    assert cost.seconds(256, 256, True, 256, 1792) == pytest.approx(plain_256 + drafting, rel=0.01)
    assert cost.seconds(16, 16, True) == pytest.approx(plain_16, rel=0.01)  # the other bucket kept
    for _ in range(60):  # now settled: plain steps that get slower are the engine's speed changing,
        cost.observe(256, 256, True, 0, 0, 2 * plain_256)  # and drafting steps' plain part moves with them
    assert cost.seconds(256, 256, True, 256, 1792) == pytest.approx(2 * plain_256 + drafting, rel=0.01)


def test_buckets_not_drafted_yet_start_from_a_kind_that_gave_back_what_it_absorbed():
    """The first graphed steps all draft (no plain graphed step has run: the plain price is the CUDA
    graph's table, a tenth of a host-bound step), so the kind's drafting correction, where buckets not
    drafted yet start, absorbs the plain prediction's error as the bucket's does. Once plain steps
    teach the plain cost, a smaller bucket the batch drains to prices drafting at what drafting took,
    not at that error (the H200 long tail declined drafts at every bucket it drained to)."""
    rows = [1, 16, 256]
    target = TargetCost(rows, [0.30e-3, 0.32e-3, 0.38e-3], [0.30e-3, 0.35e-3, 0.57e-3], 8)
    drafter = Curve(rows, [0.2e-3, 0.23e-3, 0.43e-3])
    cost, tables = StepCost(target, target, drafter), StepCost(target, target, drafter, learn=False)
    plain_256, drafting = 4.8e-3, 2.0e-3  # true seconds
    for _ in range(30):
        cost.observe(256, 256, True, 256, 1792, plain_256 + drafting)
    for _ in range(10):
        cost.observe(256, 256, True, 0, 0, plain_256)

    def adds(model, rows):  # what drafting a full block a row adds to the plain step
        return model.seconds(rows, rows, True, rows, rows * K) - model.seconds(rows, rows, True)

    ratio = drafting / adds(tables, 256)  # the drafting correction the steps taught
    assert adds(cost, 256) == pytest.approx(drafting, rel=0.01)
    assert adds(cost, 64) == pytest.approx(ratio * adds(tables, 64), rel=0.01)  # (without the give-back: 3.2x)


def test_a_kind_far_off_its_tables_is_priced_at_its_steps_time_once_one_step_lands_within_bounds():
    """A host-bound engine's graphed steps take 10x the graph table (the device's time alone): steps
    the MAX_STEP_RATIO bound cuts move the correction to the bound without counting in the mean, so
    the first step within bounds sets the price (counted, they stayed in the running mean: priced
    ~30% low after a few steps, for good where few such steps run). A step slow once on a kind with
    a measured price (a graph captured) moves it by its weight towards the bound, and steps of the
    usual time bring it back."""
    rows = [1, 16, 256]
    target = TargetCost(rows, [0.30e-3, 0.32e-3, 0.38e-3], [0.30e-3, 0.35e-3, 0.57e-3], 8)
    cost = StepCost(target, target, Curve(rows, [0.2e-3, 0.23e-3, 0.43e-3]))
    true = 10 * cost.seconds(64, 64, True)
    seen = []
    for _ in range(4):
        cost.observe(64, 64, True, 0, 0, true)
        seen.append(cost.seconds(64, 64, True) / true)
    assert seen[0] == pytest.approx(0.3) and seen[1] == pytest.approx(0.9) and seen[2:] == pytest.approx([1, 1])
    assert cost.timed(64, True, False)
    cost.observe(64, 64, True, 0, 0, 40 * true)  # a graph captured: slow once
    assert cost.seconds(64, 64, True) == pytest.approx((1 + 2 / 3) * true)  # a third of the way to 3x (2 counted)
    for _ in range(30):
        cost.observe(64, 64, True, 0, 0, true)
    assert cost.seconds(64, 64, True) == pytest.approx(true, rel=0.05)


def test_a_bucket_that_only_drafted_learns_its_plain_price_from_one_plain_step():
    """A host-bound engine's graphed steps all drafted so far (a good drafter, or a full-blocks run):
    the plain graphed price is the CUDA graph's table, a tenth of the step. The first plain step there
    (a declined draft) counts at once, up to what the bucket's drafting steps took, where the 3x bound
    alone took two or three of them, each a declined draft; a plain step slow once (a graph captured)
    is cut to the drafting steps' time and does not count."""
    rows = [1, 16, 256]
    target = TargetCost(rows, [0.30e-3, 0.32e-3, 0.38e-3], [0.30e-3, 0.35e-3, 0.57e-3], 8)
    drafter = Curve(rows, [0.2e-3, 0.23e-3, 0.43e-3])
    plain, drafting = 2.6e-3, 2.75e-3  # true seconds
    for slow_once in (False, True):
        cost = StepCost(target, target, drafter)
        for _ in range(20):
            cost.observe(1, 1, True, 1, K, drafting)
        assert cost.seconds(1, 1, True) < 0.2 * plain  # the table's price
        cost.observe(1, 1, True, 0, 0, 40 * plain if slow_once else plain)
        assert cost.timed(1, True, False) is not slow_once
        assert cost.seconds(1, 1, True) == pytest.approx(drafting if slow_once else plain)
        assert cost.seconds(1, 1, True, 1, K) > cost.seconds(1, 1, True)  # drafting never priced below plain


def test_graphed_steps_are_priced_at_their_graphs_padded_tokens():
    """The cost model prices a graphed step at the tokens its graph computes (padded_shape): a uniform
    step its batch bucket's blocks, a ragged one its tokens padded to a TOKEN_STEPS mark; the drafter
    (graphed whenever the target has graphs) at its batch bucket's rows."""
    graph = linear_target(4.0, 0.01, K + 1)
    cost = StepCost(linear_target(10.0, 0.01, K + 1), graph, Curve((1.0, 256.0), (0.0, 0.255)), learn=False)
    assert cost.seconds(200, 200 * 8, True) == pytest.approx(graph.at(256, 256 * 8))  # uniform: bucket x q
    assert cost.seconds(256, 271, True) == pytest.approx(graph.at(256, 320))  # ragged: 256 x 1.25
    assert cost.seconds(256, 271, False) == pytest.approx(cost.eager.at(256, 271))
    # the same tokens as 15 drafts of 15 rows: the plain step plus the extra tokens and the drafter (bucket 16)
    assert cost.seconds(256, 256, True, 15, 15) == pytest.approx(graph.at(256, 320) + cost.drafter.at(16))
    counts = np.arange(1, 200)  # [N] drafters
    np.testing.assert_allclose(cost.ragged_seconds(256, 256, counts, True),
                               [cost.seconds(256, 256, True, d, n) for n, d in zip(counts, counts)])
    assert cost.seconds(256, 256, True, 20) - cost.seconds(256, 256, True) == pytest.approx(31e-3)  # bucket 32
    no_graphs = StepCost(cost.eager, None, cost.drafter, learn=False)
    assert no_graphs.seconds(256, 256, False, 20) - no_graphs.seconds(256, 256, False) == pytest.approx(19e-3)
