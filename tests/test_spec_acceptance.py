"""The draft budget's acceptance estimates (rollout/engine/spec_budget.py, AcceptanceEstimates) on
synthetic verify streams: they converge on the truth, follow a drift, start a new sample at the
server-wide estimate, reuse the rows of finished samples, and count a batch of steps' results as a
loop over each result would."""

from __future__ import annotations

import numpy as np
from spec_helpers import budget_seq

from rollout.engine.sequence import SeqStatus
from rollout.engine.spec_budget import SAMPLE_DECAY, SERVER_DECAY, AcceptanceEstimates

K = 7


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
    seqs = [budget_seq(i) for i in range(64)]
    _verify_stream(est, seqs, truth, 200, rng)
    error = np.abs(est.server_wide() - truth)
    assert error[:5].max() < 0.05 and error.max() < 0.1  # deep positions are tried less often
    per_sample = est.of(seqs)  # each an EMA over few drafts: noisy, centred on the truth
    assert np.abs(per_sample.mean(axis=0)[:4] - truth[:4]).max() < 0.05


def test_a_sample_whose_acceptance_drops_is_followed_and_a_new_one_starts_server_wide():
    rng = np.random.default_rng(1)
    est = AcceptanceEstimates(K)
    good, drifting = [budget_seq(i) for i in range(32)], budget_seq(99)
    _verify_stream(est, good + [drifting], np.full(K, 0.9), 50, rng)
    assert est.of([drifting])[0, 0] > 0.8
    for _ in range(10):
        est.observe([drifting], np.array([K]), np.array([0]))
        est.observe(good, np.full(32, K), np.full(32, K))
    assert est.of([drifting])[0, 0] < 0.4  # followed within 10 verify steps (shrunk towards 0.9 server-wide)
    newcomer = est.of([budget_seq(100)])[0]
    np.testing.assert_allclose(newcomer, est.server_wide())


def test_rows_of_finished_samples_are_reused():
    est = AcceptanceEstimates(K, capacity=4)
    first = [budget_seq(i) for i in range(4)]
    est.of(first)
    for s in first[:2]:
        s.status = SeqStatus.FINISHED
    est.of([budget_seq(10), budget_seq(11)])
    assert len(est.tried) == 4 and len(est.rows) == 4
    est.of([budget_seq(12)])  # full again: grows
    assert len(est.tried) == 8


def test_a_batch_of_steps_counts_a_sample_that_comes_twice_once_per_result():
    """Several steps' results in one observe (the budget learns in batches): a sample verified in two
    of them keeps one row, both results count (decayed once per draft tried over the two), the
    server-wide counts decay once per step; a finished sample counts server-wide only."""
    est = AcceptanceEstimates(K, capacity=4)
    a, b, done = budget_seq(1), budget_seq(2), budget_seq(3)
    est.observe([a], np.array([K]), np.array([K]))  # a: all K tried and accepted
    before, server_before = est.tried[est.rows[a]].copy(), est.server_tried.copy()
    done.status = SeqStatus.FINISHED
    est.observe([a, b, a, done], np.array([K, K, 3, K]), np.array([1, K, 0, 2]), steps=2)
    assert len(est.rows) == 2 and done not in est.rows
    tried_a = np.array([2, 1, 0, 0, 0, 0, 0])  # positions judged: 0..1 (1 accepted), then 0 (rejected)
    np.testing.assert_allclose(est.tried[est.rows[a]], before * SAMPLE_DECAY ** tried_a + tried_a)
    np.testing.assert_allclose(est.accepted[est.rows[a]], before * SAMPLE_DECAY ** tried_a + [1, 0, 0, 0, 0, 0, 0])
    server_tried = tried_a + np.ones(K) + [1, 1, 1, 0, 0, 0, 0]  # a twice, b all K, done 0..2
    np.testing.assert_allclose(est.server_tried, server_before * SERVER_DECAY ** 2 + server_tried)


def test_observe_equals_counting_each_result_on_its_own():
    """The vectorised counts (histograms per sample) against a loop over the results: random batches
    of several steps, samples repeated, some finished, blocks cut short, rejections at every position."""
    rng = np.random.default_rng(3)
    seqs = [budget_seq(i) for i in range(12)]
    fast = AcceptanceEstimates(K, capacity=4)
    rows, tried_rows, accepted_rows = {}, {}, {}  # the reference's own per-sample counts
    server_tried, server_accepted = np.zeros(K), np.zeros(K)
    for call in range(30):
        steps = int(rng.integers(1, 5))
        entries = [seqs[i] for i in rng.integers(0, len(seqs), size=int(rng.integers(1, 40)))]
        num_draft = rng.integers(1, K + 1, size=len(entries))
        num_accepted = np.minimum(rng.integers(0, K + 1, size=len(entries)), num_draft)
        if call == 20:
            seqs[0].status = SeqStatus.FINISHED
        fast.observe(entries, num_draft, num_accepted, steps)
        n_tried, n_accepted = {}, {}
        server_tried *= SERVER_DECAY ** steps
        server_accepted *= SERVER_DECAY ** steps
        for seq, d, a in zip(entries, num_draft.tolist(), num_accepted.tolist()):
            t = np.arange(K) < min(a + 1, d)
            acc = np.arange(K) < a
            server_tried += t
            server_accepted += acc
            if not seq.is_finished:
                n_tried[seq] = n_tried.get(seq, 0) + t
                n_accepted[seq] = n_accepted.get(seq, 0) + acc
        for seq in n_tried:
            decay = SAMPLE_DECAY ** n_tried[seq]
            tried_rows[seq] = tried_rows.get(seq, np.zeros(K)) * decay + n_tried[seq]
            accepted_rows[seq] = accepted_rows.get(seq, np.zeros(K)) * decay + n_accepted[seq]
            rows[seq] = True
    np.testing.assert_allclose(fast.server_tried, server_tried)
    np.testing.assert_allclose(fast.server_accepted, server_accepted)
    for seq in rows:
        if not seq.is_finished:
            np.testing.assert_allclose(fast.tried[fast.rows[seq]], tried_rows[seq])
            np.testing.assert_allclose(fast.accepted[fast.rows[seq]], accepted_rows[seq])
