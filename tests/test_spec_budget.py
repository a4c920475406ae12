"""The draft budget (rollout/engine/spec_budget.py) on synthetic acceptance and cost tables, no
model: probes stay within their share of the time and are charged what they took beyond their
prediction; full choices come as often as the budget's cadence says; at start-up the prior's choices
verify drafts of a few samples only at a large batch, while a good drafter still reaches full blocks
within a few steps; a choice of a kind of step not timed yet serves one step; prompts waiting for
the token budget leave drafts no room. (tests/test_draft_choice.py: one step's choice;
tests/test_spec_acceptance.py: the acceptance estimates; tests/test_step_cost.py: the cost model.)"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from spec_helpers import budget_seq, cost_table

from rollout.engine import spec_budget, step_cost
from rollout.engine.draft_choice import EXPLORE_SHARE, choose_drafts, slot_gains
from rollout.engine.params import SamplingParams
from rollout.engine.sequence import Sequence
from rollout.engine.spec_budget import (
    MAX_DOUBLINGS,
    PROBE_ROWS,
    PROBE_SHARE,
    RECHOOSE_STEPS,
    REUSE_STEPS,
    SpecBudget,
)

K = 7


# -- probes -------------------------------------------------------------------------------------------


def test_probes_stay_within_their_share():
    """Drafts never pay here, so only probes verify: about PROBE_SHARE of the time goes to them."""
    cost = cost_table(decode_ms=10.0, token_ms=0.5, drafter_ms=2.0)
    budget = SpecBudget(K, cost, graphs=False, max_graph_rows=0)
    seqs = [budget_seq(i) for i in range(8)]
    for s in seqs:
        s.num_computed_tokens = s.num_tokens - 1
    budget.acceptance.observe(seqs, np.full(8, K), np.zeros(8, dtype=np.int64))
    plain = float(cost.seconds(8, 8, False, 0))
    extra = float(cost.seconds(8, 8, False, 8, 8 * K)) - plain
    probes = sum(sum(budget.caps(seqs, 2048).values()) > 0 for _ in range(2000))
    expected = 2000 * PROBE_SHARE * plain / extra
    assert budget.totals["probes"] == probes and 0.8 * expected <= probes <= expected + 1


def _unpaying_budget(monkeypatch):
    """A budget over 8 decoding samples whose drafts were never accepted (so it declines them and
    probes on its PROBE_SHARE, 0.05 here): (its cost table, the budget, the samples, a plain step's
    predicted seconds)."""
    monkeypatch.setattr(spec_budget, "PROBE_SHARE", 0.05)
    cost = cost_table(decode_ms=10.0, token_ms=0.5, drafter_ms=2.0)
    budget = SpecBudget(K, cost, graphs=False, max_graph_rows=0)
    seqs = _decoding(8)
    budget.acceptance.observe(seqs, np.full(8, K), np.zeros(8, dtype=np.int64))
    return cost, budget, seqs, float(cost.seconds(8, 8, False))


def test_probes_are_charged_what_they_took_beyond_their_prediction(monkeypatch):
    """The cost model prices drafting at a fifth of what the steps take (it is not learning here):
    each probe's step is recorded at its real time, and the time beyond the prediction is charged
    to the credit, so probes still take about PROBE_SHARE of all the steps' time. (Charged at the
    prediction only, probes came five times as often and took ~5x PROBE_SHARE.)"""
    cost, budget, seqs, plain = _unpaying_budget(monkeypatch)
    real_extra = 5 * (float(cost.seconds(8, 8, False, 8, 8 * K)) - plain)
    total = probing = 0.0
    for _ in range(4000):
        caps = budget.caps(seqs, 2048)
        seconds = plain + (real_extra if caps else 0.0)
        budget.record(_step(seqs, caps), [0] * 8 if caps else None, seconds, False)
        total, probing = total + seconds, probing + (real_extra if caps else 0.0)
    assert budget.totals["probes"] >= 10
    assert probing <= 0.05 * total + real_extra, (probing / total, budget.totals["probes"])


def test_a_probe_is_charged_at_its_own_step_when_a_drafted_one_is_recorded_first(monkeypatch):
    """Overlapped scheduling chooses step n+1's drafts before the drafted step n is recorded
    (rollout.engine.overlap): the engine stamps each step with its choice (`choices` at its launch),
    and the probe's overrun is charged when the probe's own step is recorded, not step n's."""
    cost, budget, seqs, plain = _unpaying_budget(monkeypatch)
    for _ in range(4000):
        caps = budget.caps(seqs, 2048)
        if caps:
            break
        budget.record(_step(seqs, caps), None, plain, False, budget.choices)
    assert caps, "no probe came"
    probe_choice, credit = budget.choices, budget.credit
    budget.record(_step(seqs, caps), [0] * 8, 1.0, False, probe_choice - 1)  # step n, drafted, chosen before
    assert budget.credit == credit
    budget.record(_step(seqs, caps), [0] * 8, 1.0, False, probe_choice)  # the probe's own step
    predicted = float(cost.seconds(8, 8, False, 8, 8 * K))
    assert budget.credit == pytest.approx(credit - (1.0 - predicted))
    budget.record(_step(seqs, caps), [0] * 8, 1.0, False, probe_choice + 1)  # charged once
    assert budget.credit == pytest.approx(credit - (1.0 - predicted))


def test_a_wide_batch_that_declined_every_draft_probes_a_few_samples_in_turn():
    """64 samples whose drafts never pay: each probe verifies full blocks for PROBE_ROWS of them (the
    next ones at each probe, so all 64 in eight probes), priced as that ragged step, so probes come
    about 64 / PROBE_ROWS times as often as full probes of all 64 would and still take about
    PROBE_SHARE of the time."""
    cost = cost_table(decode_ms=10.0, token_ms=0.5, drafter_ms=2.0)
    budget = SpecBudget(K, cost, graphs=False, max_graph_rows=0)
    seqs = _decoding(64)
    budget.acceptance.observe(seqs, np.full(64, K), np.zeros(64, dtype=np.int64))
    plain = float(cost.seconds(64, 64, False))
    extra = float(cost.seconds(64, 64, False, PROBE_ROWS, PROBE_ROWS * K)) - plain
    probed = [[i for i, s in enumerate(seqs) if caps.get(s)] for caps in (budget.caps(seqs, 4096) for _ in range(3000))]
    probed = [p for p in probed if p]
    expected = 3000 * PROBE_SHARE * plain / extra
    assert budget.totals["probes"] == len(probed) and 0.8 * expected <= len(probed) <= expected + 1
    assert all(len(p) == PROBE_ROWS for p in probed)
    assert sorted(i for p in probed[:8] for i in p) == list(range(64))  # in turn: every sample once


# -- the budget's cadence -------------------------------------------------------------------------------


def _step(seqs, drafts: dict) -> SimpleNamespace:
    """What SpecBudget.record reads of a StepBatch: a decode step of these samples."""
    num_draft = [drafts.get(s, 0) for s in seqs]
    meta = SimpleNamespace(slot_mapping=torch.zeros(len(seqs) + sum(num_draft)))
    return SimpleNamespace(tokens=SimpleNamespace(items=seqs, meta=meta),
                           rows=SimpleNamespace(entries=seqs, num_draft=num_draft))


def _run_steps(budget: SpecBudget, seqs, steps: int, accept) -> list:
    """caps then record, `steps` times, each draft accepted by `accept(position)`; the caps chosen."""
    chosen = []
    for _ in range(steps):
        caps = budget.caps(seqs, 4096)
        chosen.append(caps)
        step = _step(seqs, caps)
        accepted = [sum(1 for _ in itertools.takewhile(accept, range(k))) for k in step.rows.num_draft]
        budget.record(step, accepted, 1e-3, False)
    return chosen


def _counted_budget(monkeypatch, num: int) -> tuple[SpecBudget, list, list[int]]:
    """A budget on a cheap-verify table (MEASURED 0: no start-up exploration, whose steps choose every
    step), `num` caught-up samples, and the list its full choices append their sample counts to."""
    monkeypatch.setattr(spec_budget, "MEASURED", 0.0)
    full = []
    monkeypatch.setattr(spec_budget, "choose_drafts", lambda *a: full.append(len(a[1])) or choose_drafts(*a))
    budget = SpecBudget(K, cost_table(decode_ms=5.0, token_ms=0.01, drafter_ms=0.5), graphs=False,
                        max_graph_rows=0)
    seqs = [budget_seq(i) for i in range(num)]
    for s in seqs:
        s.num_computed_tokens = s.num_tokens - 1
    return budget, seqs, full


def test_the_budget_rechooses_every_rechoose_steps_and_learns_all_it_recorded(monkeypatch):
    """Full choices: every RECHOOSE_STEPS steps, at once when the batch's shape changes, every
    REUSE_STEPS while nothing is verified; each full choice first learns every step recorded since
    the last (each sample's results from several steps at once); in between, the last rule. (MEASURED
    0: no start-up exploration, whose steps choose every step; tested below. No doubling at first:
    the choices here keep choosing the same rule.)"""
    budget, seqs, full = _counted_budget(monkeypatch, 8)
    monkeypatch.setattr(spec_budget, "MAX_DOUBLINGS", 0)
    n = 4 * RECHOOSE_STEPS
    caps = _run_steps(budget, seqs, n, accept=lambda j: j < 2)  # 2 of every block accepted
    assert len(full) == 4 and all(c == caps[0] for c in caps[:RECHOOSE_STEPS]) and all(caps)
    assert budget.totals["verified_rows"] == 8 * 3 * RECHOOSE_STEPS  # the last choice's steps not yet
    row = budget.acceptance.rows[seqs[0]]
    assert budget.acceptance.tried[row, 0] > RECHOOSE_STEPS  # more than one step's results each
    assert budget.acceptance.of(seqs[:1])[0, 2] < 0.5  # the third draft: rejected, learned
    _run_steps(budget, seqs[:3], 1, accept=lambda j: True)  # 8 -> 3 rows: another bucket
    assert full == [8, 8, 8, 8, 3]
    monkeypatch.setattr(budget, "cost", cost_table(decode_ms=1.0, token_ms=100.0, drafter_ms=100.0))
    monkeypatch.setattr(spec_budget, "MAX_DOUBLINGS", MAX_DOUBLINGS)
    chosen_at, probes = [], budget.totals["probes"]  # the steps that chose in full, from here on
    for step in range(400):
        before = len(full)
        assert not any(_run_steps(budget, seqs, 1, accept=lambda j: True))  # never worth drafting now
        if len(full) > before:
            chosen_at.append(step)
    # no drafts: kept for REUSE_STEPS steps, then twice as long for each full choice that chose it again
    # (up to MAX_DOUBLINGS); a probe (none here: too dear for the credit) would start the doubling over
    gaps = [b - a for a, b in zip(chosen_at, chosen_at[1:])]
    assert chosen_at[0] == 0 and gaps == [REUSE_STEPS << min(i, MAX_DOUBLINGS) for i in range(len(gaps))]
    assert gaps[-1] == REUSE_STEPS << MAX_DOUBLINGS and budget.totals["probes"] == probes


def test_a_batch_draining_under_full_blocks_keeps_them_and_one_that_grows_chooses_anew(monkeypatch):
    """A batch whose rows fall to smaller buckets while its rule is full blocks keeps the rule (no
    full choice at each bucket of a draining tail) until the rule's age runs out; a batch that grows
    back chooses in full at once."""
    budget, seqs, full = _counted_budget(monkeypatch, 32)
    _run_steps(budget, seqs, 2, accept=lambda j: True)  # every draft accepted: full blocks
    assert full == [32] and budget._last[0].k == K
    for rows in (16, 8, 4, 2, 1):  # draining: every step another bucket
        caps = _run_steps(budget, seqs[:rows], 1, accept=lambda j: True)[0]
        assert list(caps.values()) == [K] * rows
    assert full == [32]
    _run_steps(budget, seqs[:1], RECHOOSE_STEPS, accept=lambda j: True)  # the rule's age runs out
    assert full == [32, 1]
    _run_steps(budget, seqs[:8], 1, accept=lambda j: True)  # grows: a full choice at once
    assert full == [32, 1, 8]


def test_declined_counts_plain_steps_where_samples_could_have_drafted():
    """The summary's `declined`: steps that verified no drafts although some sample's limit allowed
    them; a step whose samples have no drafts left to verify (one output token to go) is not one."""
    budget = SpecBudget(K, cost_table(decode_ms=1.0, token_ms=100.0, drafter_ms=100.0), graphs=False,
                        max_graph_rows=0)
    seqs = [budget_seq(i) for i in range(4)]
    for s in seqs:
        s.num_computed_tokens = s.num_tokens - 1
    assert not any(any(c.values()) for c in _run_steps(budget, seqs, 5, accept=lambda j: True))
    for s in seqs:  # one token left: nothing to verify
        s.params = SamplingParams(max_tokens=s.num_output_tokens + 1)
    _run_steps(budget, seqs, 3, accept=lambda j: True)
    summary = budget.summary()
    assert summary["steps"] == 8 and summary["declined"] == 5


def test_a_reused_threshold_rule_gives_what_recomputing_it_gives(monkeypatch):
    """Between full choices a ragged rule (the slots whose gain reaches its threshold) is applied
    from per-sample counts kept since the full choice: a sample that joins later, and one whose
    limit shrank (near its max_tokens), get what the rule recomputed from the estimates gives."""
    monkeypatch.setattr(spec_budget, "MEASURED", 0.0)
    budget = SpecBudget(K, cost_table(decode_ms=5.0, token_ms=0.4, drafter_ms=0.5), graphs=False, max_graph_rows=0)
    seqs = [budget_seq(i) for i in range(10)]
    for s in seqs:
        s.num_computed_tokens = s.num_tokens - 1
    for i, s in enumerate(seqs[:9]):  # some samples' drafts pay far, others' hardly
        budget.acceptance.observe([s] * 6, np.full(6, K), np.full(6, i % K))
    first = budget.caps(seqs[:9], 4096)
    last = budget._last[0]
    assert last.k == -1 and len(set(first.values())) > 1  # a ragged rule, not a uniform block
    seqs[2].params = SamplingParams(max_tokens=seqs[2].num_output_tokens + 2)  # limit 1 now
    reused = budget.caps(seqs, 4096)  # (a tenth sample joins: the same rows bucket, so the rule serves)
    assert budget._age == 2
    limits = np.asarray([min(K, s.remaining_tokens - 1) for s in seqs])
    want = (slot_gains(budget.acceptance.of(seqs), limits) >= last.threshold).sum(axis=1)
    assert [reused[s] for s in seqs] == want.tolist() and reused[seqs[2]] <= 1


def test_probes_of_steps_that_verify_drafts_anyway_keep_the_doubling(monkeypatch):
    """Two drafts of each block accepted: the budget verifies a few drafts a sample, and probes (full
    blocks, cheap against the chosen drafts) come every few steps. Drafts are verified in every step
    anyway, so a probe does not restart the doubling: full choices still come further and further
    apart. (They restarted it: a full choice every RECHOOSE_STEPS steps, ~0.3 ms of host time each at
    batch 32.)"""
    monkeypatch.setattr(spec_budget, "PROBE_SHARE", 0.05)
    budget, seqs, full = _counted_budget(monkeypatch, 8)
    chosen_at = []
    for step in range(200):
        before = len(full)
        _run_steps(budget, seqs, 1, accept=lambda j: j < 2)
        chosen_at += [step] * (len(full) - before)
    assert budget.totals["probes"] >= 10
    assert max(b - a for a, b in zip(chosen_at, chosen_at[1:])) >= RECHOOSE_STEPS << MAX_DOUBLINGS, chosen_at


def test_a_probe_is_learned_from_soon_whatever_the_doubling(monkeypatch):
    """Full choices that keep choosing no drafts come further and further apart, but a probe starts
    that over: the full choice that learns the probe's results comes within REUSE_STEPS of it."""
    monkeypatch.setattr(spec_budget, "MEASURED", 0.0)
    monkeypatch.setattr(spec_budget, "PROBE_SHARE", 0.05)  # a probe every ~100 steps here
    full = []
    monkeypatch.setattr(spec_budget, "choose_drafts", lambda *a: full.append(1) or choose_drafts(*a))
    budget = SpecBudget(K, cost_table(decode_ms=10.0, token_ms=0.5, drafter_ms=2.0), graphs=False, max_graph_rows=0)
    seqs = [budget_seq(i) for i in range(8)]
    for s in seqs:
        s.num_computed_tokens = s.num_tokens - 1
    chosen_at, probed_at = [], []
    for step in range(600):
        before, probes = len(full), budget.totals["probes"]
        _run_steps(budget, seqs, 1, accept=lambda j: False)  # drafts never pay
        chosen_at += [step] * (len(full) - before)
        probed_at += [step] * (budget.totals["probes"] - probes)
    assert len(probed_at) >= 3 and max(b - a for a, b in zip(chosen_at, chosen_at[1:])) > REUSE_STEPS  # doubled
    for p in probed_at[:-1]:
        assert any(p < c <= p + REUSE_STEPS for c in chosen_at), (p, chosen_at)


# -- start-up -------------------------------------------------------------------------------------------


def _decoding(n: int) -> list[Sequence]:
    seqs = [budget_seq(i) for i in range(n)]
    for s in seqs:
        s.num_computed_tokens = s.num_tokens - 1
    return seqs


def test_start_up_at_a_large_batch_verifies_few_drafts():
    """Batch 256, a drafter whose drafts are all rejected, verify steps that the optimistic prior
    would buy (4 drafts for every sample): the first steps verify drafts of a few samples only, each
    step within EXPLORE_SHARE of a plain one by the cost model, and after them none. (Before: the
    prior's choice served RECHOOSE_STEPS steps, 8 x 1024 drafts.)"""
    cost = cost_table(decode_ms=20.0, token_ms=0.02, drafter_ms=1.0, graph=True)
    budget = SpecBudget(K, cost, graphs=True, max_graph_rows=256)
    seqs = _decoding(256)
    prior = choose_drafts(np.full((256, K), spec_budget.PRIOR), np.full(256, K), cost, 256, 256, 10_000, True)[0]
    assert prior.drafts.min() >= 3  # the prior's choice
    plain = cost.seconds(256, 256, True, 0)
    caps = _run_steps(budget, seqs, 2 * RECHOOSE_STEPS, accept=lambda j: False)
    drafts = [sum(c.values()) for c in caps]
    assert 0 < drafts[0] and sum(drafts) < 256 * K / 4, drafts
    for c in caps:
        if sum(c.values()):
            rows = sum(1 for k in c.values() if k)
            assert cost.ragged_seconds(256, 256, np.full(sum(c.values()), rows))[-1] <= (1 + EXPLORE_SHARE) * plain
    assert budget.acceptance.measured() and not any(drafts[-RECHOOSE_STEPS:])


@pytest.mark.parametrize("batch", [1, 32])
def test_a_good_drafter_still_reaches_full_blocks_within_a_few_steps(batch):
    """All drafts accepted and full blocks pay (1.9x a decode step for 8x the tokens at batch 32):
    batch 1 verifies its full block from the first step; batch 32 explores with a few samples (what
    EXPLORE_SHARE of a step pays for) until MEASURED drafts are tried, then full blocks for all from
    the fifth step (the fourth while ragged steps were priced unpadded, as eager ones)."""
    cost = cost_table(decode_ms=4.0, token_ms=0.015, drafter_ms=0.5, graph=True)
    budget = SpecBudget(K, cost, graphs=True, max_graph_rows=256)
    caps = _run_steps(budget, _decoding(batch), 6, accept=lambda j: True)
    full = [sorted(c.values()) == [K] * batch for c in caps]
    assert full[0] == (batch == 1) and all(full[4:]), caps
    assert all(0 < sum(c.values()) < batch * K / 4 for c in caps[:4 if batch > 1 else 0])


def test_a_choice_of_an_untimed_kind_of_step_serves_one_step():
    """Drafting steps take 10x what the startup tables say (a graph captured mid-run, sampling on many
    rows): the first choice verifies drafts, its step is timed, and the next step verifies none.
    (Before: the choice served RECHOOSE_STEPS steps.)"""
    tables = cost_table(decode_ms=5.0, token_ms=0.01, drafter_ms=0.5)
    cost = cost_table(decode_ms=5.0, token_ms=0.01, drafter_ms=0.5)
    cost.learn = True
    budget = SpecBudget(K, cost, graphs=False, max_graph_rows=0)
    seqs = _decoding(8)
    budget.acceptance.observe(seqs, np.full(8, K), np.full(8, 1))  # measured: one draft of a block accepted
    chosen = []
    for _ in range(RECHOOSE_STEPS):
        caps = budget.caps(seqs, 4096)
        step = _step(seqs, caps)
        drafts, rows = sum(step.rows.num_draft), sum(1 for k in step.rows.num_draft if k)
        seconds = tables.seconds(8, 8, False, rows, drafts) * (10 if drafts else 1)
        budget.record(step, [min(k, 1) for k in step.rows.num_draft], seconds, False)
        chosen.append(drafts)
    assert chosen[0] > 0 and not any(chosen[1:]), chosen


def test_a_profile_cut_short_still_measures_the_fewest_and_the_most_rows(monkeypatch):
    """On a GPU the profile times 1 and max_rows (256) first: with no time for more than two row
    counts, batch 256 is interpolated, not extrapolated from the slope between small batches; its
    tables are in increasing rows whatever the order. On CPU, where the largest eager step alone
    takes seconds, the counts come in increasing order."""
    assert step_cost.profile_rows(256, 4096, 4, ends_first=True) == [1, 256, 4, 16, 64]
    assert step_cost.profile_rows(256, 4096, 4, ends_first=False) == [1, 4, 16, 64, 256]
    assert step_cost.profile_rows(256, 300, 8, ends_first=True) == [1, 16, 4]  # 64 x 8 > 300 tokens
    timed = []

    def forward(ids, meta):
        timed.append(int(meta.cu_seqlens_q.numel()) - 1)
        return torch.zeros(ids.numel(), 4), None

    def profile(max_seconds):
        return step_cost.profile_step_cost(forward, lambda h: h, None, None, q=4, scratch_block=0, block_size=16,
                                           device=torch.device("cpu"), max_rows=256, max_tokens=4096,
                                           max_seconds=max_seconds)

    assert profile(0.0).eager.decode.xs == [1.0, 4.0]  # CPU: increasing
    real = step_cost.profile_rows
    monkeypatch.setattr(step_cost, "profile_rows", lambda *a, ends_first: real(*a, ends_first=True))  # as on a GPU
    timed.clear()
    assert profile(0.0).eager.decode.xs == [1.0, 256.0] and sorted(set(timed)) == [1, 256]
    assert profile(60.0).eager.decode.xs == [1.0, 4.0, 16.0, 64.0, 256.0]


def test_prompts_waiting_for_the_token_budget_leave_drafts_no_room():
    """A good drafter and cheap drafts (full blocks otherwise): while the prompts the step may admit
    fill its token budget, nothing drafts (a draft would displace a prompt token); with room left
    over, drafts take that room and no more; with no prompt waiting, full blocks."""
    cost = cost_table(decode_ms=4.0, token_ms=0.001, drafter_ms=0.1)
    budget = SpecBudget(K, cost, graphs=False, max_graph_rows=256)
    seqs = _decoding(8)
    budget.acceptance.observe(seqs * 4, np.full(32, K), np.full(32, K))  # measured: everything accepted
    assert budget.caps(seqs, 64, waiting_tokens=200) == {}
    assert sum(budget.caps(seqs, 64, waiting_tokens=40).values()) <= 64 - 8 - 40
    assert sorted(budget.caps(seqs, 64).values()) == [K] * 8

