"""Speculation that never costs (issue 19): each step, which drafts of which samples the target verifies.

Terms. A decode sample verifying k drafts commits 1 + sum_{i<=k} prod_{j<=i} a_j tokens in
expectation, a_j being the conditional acceptance of its draft j (accepted, given drafts < j were).
The step's time comes from the cost model (step_cost.py). The budget maximises the step's expected
committed tokens per second over
* no drafts at all: a plain decode step, the drafter's forward skipped;
* uniform blocks, k drafts for every sample (k = 1..K): one CUDA graph when the step has no prefill;
* ragged blocks: draft slots (sample, position) admitted best expected gain first, the step re-priced
  at every count (as an eager step: a ragged step replays no graph), keeping the count with the best
  rate (vLLM's adaptive verification).
A sample given no drafts is a plain decode row of the same step. Verifying a prefix of a draft block
is what Contract 2 verifies losslessly already, so the budget changes the speed, never the law of the
committed tokens (DESIGN.md).

Acceptance (`AcceptanceEstimates`): per sample and draft position, decayed counts of the drafts tried
and accepted there (an EMA over the sample's verify steps) shrunk towards the server-wide estimate of
that position (decayed counts over all samples, from an optimistic prior so that the first steps
measure), updated from each step's num_accepted in its one host copy.

Exploration: with no drafts verified nothing is learned, and the policy (so the drafter's acceptance)
drifts. A step that verifies less than full blocks earns PROBE_SHARE of its predicted time as credit;
once the credit pays for the extra time of full blocks, that step verifies full blocks (a probe), so
probes cost at most PROBE_SHARE of the time.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rollout.engine.sequence import Sequence
from rollout.engine.step_cost import StepCost

PRIOR = 0.8  # conditional acceptance assumed before anything is measured
SERVER_PRIOR_WEIGHT = 4.0  # the prior's worth in drafts tried, server-wide
SERVER_DECAY = 0.97  # server-wide counts, per step that verified drafts
PRIOR_WEIGHT = 2.0  # the server-wide estimate's worth in a sample's own drafts tried
SAMPLE_DECAY = 0.8  # a sample's counts of one position, per draft tried there
PROBE_SHARE = 0.01
RECHOOSE_STEPS = 4  # steps a full choice's rule is re-applied (SpecBudget._choose)
REUSE_STEPS = 16  # the same while no verify result comes in


class AcceptanceEstimates:
    """Per sample and draft position j (0-based: draft j + 1 of a block), the conditional acceptance
    a_j; rows of two [N, K] arrays, one per sample seen (reused once the sample finishes)."""

    def __init__(self, num_spec: int, capacity: int = 64):
        self.num_spec = num_spec
        self.rows: dict[Sequence, int] = {}
        self.tried = np.zeros((capacity, num_spec))  # [N, K] decayed drafts tried at each position
        self.accepted = np.zeros((capacity, num_spec))  # [N, K] decayed drafts accepted there
        self.free = list(range(capacity))
        self.server_tried = np.zeros(num_spec)  # [K]
        self.server_accepted = np.zeros(num_spec)  # [K]

    def server_wide(self) -> np.ndarray:
        """[K] the server-wide conditional acceptance of each position."""
        return (self.server_accepted + SERVER_PRIOR_WEIGHT * PRIOR) / (self.server_tried + SERVER_PRIOR_WEIGHT)

    def of(self, seqs: list[Sequence]) -> np.ndarray:
        """[S, K] the estimates of these samples (a new sample: the server-wide one)."""
        idx = self._rows(seqs)
        return (self.accepted[idx] + PRIOR_WEIGHT * self.server_wide()) / (self.tried[idx] + PRIOR_WEIGHT)

    def observe(self, seqs: list[Sequence], num_draft: np.ndarray, num_accepted: np.ndarray) -> None:
        """Verify results: sample i verified num_draft[i] > 0 drafts and accepted num_accepted[i]."""
        j = np.arange(self.num_spec)
        tried = j < np.minimum(num_accepted + 1, num_draft)[:, None]  # [E, K] draft j was judged
        accepted = j < num_accepted[:, None]  # [E, K]
        idx = self._rows(seqs)
        decay = np.where(tried, SAMPLE_DECAY, 1.0)
        self.tried[idx] = self.tried[idx] * decay + tried
        self.accepted[idx] = self.accepted[idx] * decay + accepted
        self.server_tried = self.server_tried * SERVER_DECAY + tried.sum(axis=0)
        self.server_accepted = self.server_accepted * SERVER_DECAY + accepted.sum(axis=0)

    def _rows(self, seqs: list[Sequence]) -> np.ndarray:
        rows = [self.rows.get(s, -1) for s in seqs]
        if -1 in rows:
            rows = [r if r >= 0 else self._allocate(s) for s, r in zip(seqs, rows)]
        return np.asarray(rows, dtype=np.int64)

    def _allocate(self, seq: Sequence) -> int:
        if not self.free:  # reclaim the rows of finished samples, else grow
            done = [s for s in self.rows if s.is_finished]
            self.free = [self.rows.pop(s) for s in done]
        if not self.free:
            n = len(self.tried)
            self.tried, self.accepted = (np.concatenate([a, np.zeros_like(a)]) for a in (self.tried, self.accepted))
            self.free = list(range(n, 2 * n))
        row = self.free.pop()
        self.tried[row] = self.accepted[row] = 0.0
        self.rows[seq] = row
        return row


@dataclasses.dataclass
class Budget:
    """One step's choice: drafts [S] per decode sample, its expected committed tokens and seconds, and
    its rule: k drafts for every sample (k >= 0), or (k = -1) the slots whose gain is >= threshold."""

    drafts: np.ndarray
    tokens: float
    seconds: float
    k: int = -1
    threshold: float = 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def choose_drafts(acc: np.ndarray, limits: np.ndarray, cost: StepCost, rows: int, base_tokens: int,
                  room: int, graphs: bool) -> tuple[Budget, Budget]:
    """acc: [S, K] conditional acceptance of the step's S decode samples; limits: [S] the most drafts
    each may verify; rows: the step's sequences (decode + prefill); base_tokens: its tokens without
    drafts; room: the most draft tokens it may add; graphs: a uniform step replays a CUDA graph.
    Returns the budget with the best expected committed tokens per second (ties: fewer drafts), and
    full blocks (every sample its limit; what a probe verifies)."""
    k_max = acc.shape[1]
    gain = slot_gains(acc, limits)  # [S, K]
    ks = np.arange(k_max + 1)  # uniform blocks of k drafts (fewer where a limit is lower), k = 0..K
    drafts = np.minimum(limits[None, :], ks[:, None])  # [K+1, S]
    graphed = graphs & (ks <= limits.min())  # one graph when every sample drafts k
    seconds = cost.seconds(rows, base_tokens + drafts.sum(axis=1), graphed,
                           np.where(ks > 0, np.count_nonzero(limits), 0))  # [K+1]
    committed = len(limits) + np.concatenate([[0.0], np.cumsum(gain.sum(axis=0))])  # [K+1]
    rate = np.where(drafts.sum(axis=1) <= room, committed / seconds, -1.0)  # k = 0 always fits
    k = int(np.argmax(rate))
    best = Budget(drafts[k], float(committed[k]), float(seconds[k]), k)
    if len(limits) > 1:  # (one sample: ragged blocks are uniform ones, eager)
        ragged = _ragged(gain, cost, rows, base_tokens, room)
        if ragged.rate > best.rate * (1 + 1e-9):
            best = ragged
    return best, Budget(drafts[-1], float(committed[-1]), float(seconds[-1]), k_max)


def slot_gains(acc: np.ndarray, limits: np.ndarray) -> np.ndarray:
    """[S, K] the expected tokens draft j + 1 adds: P(drafts 1..j+1 accepted), 0 past a sample's limit."""
    return np.cumprod(acc, axis=1) * (np.arange(acc.shape[1]) < limits[:, None])


def _ragged(gain: np.ndarray, cost: StepCost, rows: int, base_tokens: int, room: int) -> Budget:
    """The best count n of draft slots taken best gain first (a sample's slots in position order),
    priced as an eager step."""
    num = gain.shape[0]
    flat = gain.T.ravel()  # position-major: a stable sort keeps each sample's positions in order
    order = np.argsort(-flat, kind="stable")[: min(room, int(np.count_nonzero(flat)))]
    if not len(order):
        return Budget(np.zeros(num, dtype=np.int64), float(num), float("inf"), 0)
    committed = num + np.cumsum(flat[order])  # [n]
    draft_rows = np.cumsum(order < num)  # position 0 slots: a sample starts drafting
    seconds = cost.seconds(rows, base_tokens + np.arange(1, len(order) + 1), False, draft_rows)
    n = int(np.argmax(committed / seconds))
    drafts = np.bincount(order[: n + 1] % num, minlength=num)
    return Budget(drafts, float(committed[n]), float(seconds[n]), -1, float(flat[order[n]]))


class SpecBudget:
    """The scheduler's draft budget of each step (`caps`) and the engine's record of each step's
    verify results and wall time (`record`), which the acceptance estimates and the cost model learn
    from. `summary` is for the server's periodic log line."""

    def __init__(self, num_spec: int, cost: StepCost, graphs: bool, max_graph_rows: int):
        self.num_spec = num_spec
        self.cost = cost
        self.graphs = graphs  # uniform decode / verify steps replay CUDA graphs
        self.max_graph_rows = max_graph_rows
        self.acceptance = AcceptanceEstimates(num_spec)
        self.credit = 0.0  # seconds of probing earned (see the module docstring)
        self.totals = dict.fromkeys(("steps", "decode_rows", "drafts", "probes", "verified_rows", "accepted"), 0)
        self.observed = 0  # verify results recorded so far
        self._key, self._last, self._age, self._observed_at = None, None, 0, 0  # the last full choice

    def caps(self, running: list[Sequence], admits: bool, token_budget: int) -> dict[Sequence, int]:
        """The most drafts each caught-up running sample verifies this step. `admits`: waiting samples
        may be admitted (their prefill makes the step eager); token_budget: the step's token budget."""
        decode, limits, prefill = [], [], 0
        for seq in running:
            behind = seq.num_tokens - seq.num_computed_tokens
            if behind > 1:
                prefill += behind
            else:
                decode.append(seq)
                limits.append(seq.remaining_tokens - 1)
        if not decode:
            return {}
        limits = np.minimum(np.asarray(limits, dtype=np.int64), self.num_spec).clip(min=0)  # [S]
        base = min(token_budget, len(decode) + prefill)
        graphs = self.graphs and not prefill and not admits and len(decode) <= self.max_graph_rows
        budget, full = self._choose(decode, limits, len(running), base, token_budget - base, graphs)
        drafts = self._probe(budget, full, token_budget - base)
        self.totals["steps"] += 1
        self.totals["decode_rows"] += len(decode)
        self.totals["drafts"] += int(drafts.sum())
        return dict(zip(decode, drafts.tolist())) if drafts.any() else {}

    def _choose(self, decode: list[Sequence], limits: np.ndarray, rows: int, base: int, room: int,
                graphs: bool) -> tuple[Budget, Budget]:
        """choose_drafts in full when the step's shape changes, else every RECHOOSE_STEPS steps (every
        REUSE_STEPS while no verify result comes in); in between, the last choice's rule (k drafts
        each, or the slots whose gain clears its threshold) applied to this step's samples: estimates
        move slowly, and a full choice costs the host ~100 us."""
        key = (len(decode), rows, base, room, graphs, int(limits.min()))
        fresh = self.observed == self._observed_at
        if key == self._key and self._age < (REUSE_STEPS if fresh else RECHOOSE_STEPS):
            self._age += 1
            last, full = self._last
            if last.k >= 0:
                drafts = np.minimum(limits, last.k)
            else:
                drafts = (slot_gains(self.acceptance.of(decode), limits) >= last.threshold).sum(axis=1)
            return dataclasses.replace(last, drafts=drafts), dataclasses.replace(full, drafts=limits)
        budget, full = choose_drafts(self.acceptance.of(decode), limits, self.cost, rows, base, room, graphs)
        self._key, self._last, self._age, self._observed_at = key, (budget, full), 0, self.observed
        return budget, full

    def _probe(self, budget: Budget, full: Budget, room: int) -> np.ndarray:
        """Full blocks instead of `budget` once the probing credit pays for them, else `budget`'s drafts."""
        n_full = int(full.drafts.sum())
        if int(budget.drafts.sum()) >= n_full or n_full > room:
            return budget.drafts
        self.credit += PROBE_SHARE * budget.seconds
        extra = max(full.seconds - budget.seconds, 0.0)
        if self.credit < extra:
            return budget.drafts
        self.credit -= extra
        self.totals["probes"] += 1
        return full.drafts

    def record(self, step, num_accepted, seconds: float, graphed: bool) -> None:
        """After a step: `step` (a StepBatch), its entries' accepted drafts (a [E] tensor of the step's
        host copy; None when no entry sampled), its wall time and whether its target forward replayed
        a CUDA graph."""
        num_draft = np.asarray(step.num_draft, dtype=np.int64)  # [E]
        verified = np.flatnonzero(num_draft)
        if num_accepted is not None and len(verified):
            accepted = num_accepted.numpy()[verified]
            self.acceptance.observe([step.entries[e] for e in verified], num_draft[verified], accepted)
            self.observed += 1
            self.totals["verified_rows"] += len(verified)
            self.totals["accepted"] += int(accepted.sum())
        draft_rows = len({step.entry_item[e] for e in verified})
        self.cost.observe(len(step.items), step.meta.slot_mapping.shape[0], graphed, draft_rows, seconds)

    def summary(self) -> dict:
        """Since the last summary: steps, decode rows, drafts verified per decode row, probes, accepted
        drafts per verifying row; now: the server-wide acceptance by position, the expected committed
        tokens of a full block for (up to 16) running requests, the cost model."""
        t, self.totals = self.totals, dict.fromkeys(self.totals, 0)
        requests: dict[str, list[float]] = {}
        live = [s for s in self.acceptance.rows if not s.is_finished]
        if live:
            expected = 1 + np.cumprod(self.acceptance.of(live), axis=1).sum(axis=1)  # [S]
            for seq, e in zip(live, expected.tolist()):
                if len(requests) < 16 or seq.request_id in requests:
                    requests.setdefault(seq.request_id, []).append(e)
        return dict(steps=t["steps"], decode_rows=t["decode_rows"], probes=t["probes"],
                    drafts_per_row=round(t["drafts"] / max(t["decode_rows"], 1), 3),
                    accepted_per_verify=round(t["accepted"] / max(t["verified_rows"], 1), 3),
                    acceptance=[round(a, 3) for a in self.acceptance.server_wide().tolist()],
                    request_accept_length={r: round(sum(v) / len(v), 3) for r, v in requests.items()},
                    cost=self.cost.describe())
