"""Speculation that never costs (issue 19): each step, which drafts of which samples the target verifies.

What each step may choose (no drafts, uniform blocks, ragged blocks) and how a choice is priced is
draft_choice.py's; this module decides when to choose, learns what the choices rest on and probes.
A sample given no drafts is a plain decode row of the same step. Verifying a prefix of a draft block
is what Contract 2 verifies losslessly already, so the budget changes the speed, never the law of the
committed tokens (DESIGN.md).

Acceptance (`AcceptanceEstimates`): per sample and draft position, decayed counts of the drafts tried
and accepted there (an EMA over the sample's verify steps) shrunk towards the server-wide estimate of
that position (decayed counts over all samples, from an optimistic prior so that the first steps
measure), updated from the steps' num_accepted in their one host copy.

Cadence. On a host-bound engine the budget's own host time is on the critical path of every drafted
step (those run synchronously: rollout.engine.overlap), so it chooses in full rarely and reuses
cheaply. The engine records each step (`SpecBudget.record`: a few list appends); the estimates and
the cost model learn from the recorded steps when the budget next chooses in full, which it does
every RECHOOSE_STEPS steps (REUSE_STEPS while no draft has been verified since), twice as long after
each full choice that chose the rule it already had (up to 2^MAX_DOUBLINGS times: a steady batch
re-decides every 64 steps), soon after a probe of a step that chose no drafts (whose results should
steer), and at once when the batch's shape changes: CUDA graphs or not, the rows' buckets, whether
the step's token room binds the drafts. One change does not count: a batch draining to fewer rows
under full blocks keeps them until the rule's age runs out (fewer rows leave the target further
below its compute bound, so drafts cost no more against the plain step; a draining tail would
otherwise choose anew at every bucket it passes). In between, the last choice's rule (k drafts each,
or the slots whose expected gain clears its threshold) is applied to the step's samples. On this
machine's CPU a full choice costs the host ~0.1 ms at batch 1 and ~0.3 ms at batch 32 (learning
included), a reused uniform rule ~3 and ~20 us (the scheduler reads each sample's state once for
itself and the budget, and applies the limits); at batch 32 with full blocks `caps` averages ~30 us
a step, full choices included (it was ~63 us before its per-sample loop became comprehensions and
`learn` flattened the steps with itertools).

Room: drafts get the step's token budget that the running samples' prefill and the prompts it may
admit leave (`caps`' waiting_tokens). A draft in a budget-bound step displaces a prompt token,
commits less than one token and delays that prompt, so while prompts wait for the budget (an RL
rollout's first steps, all samples arriving at once) nothing drafts.

Exploration: with no drafts verified nothing is learned, and the policy (so the drafter's
acceptance) drifts. A step that verifies less than full blocks earns PROBE_SHARE of its predicted
time as credit; once the credit pays for the extra time of full blocks, that step verifies full
blocks (a probe), so probes cost at most PROBE_SHARE of the time. The prediction pays at once; when
the probe's step is recorded, the time it took beyond its prediction is charged too (the engine
stamps each step with its choice, `choices` at its launch: a step may be chosen before the drafted
step ahead of it is recorded, rollout.engine.overlap), so a cost model that prices probes low (a
shape it has not seen drafting, a graph captured on the way) does not make them more frequent. A
step that declined every draft of more than PROBE_ROWS samples probes PROBE_ROWS of
them only (full blocks, the next ones in turn at each probe), priced as that ragged step: a wide
batch learns the same acceptance from a fraction of the extra time, so its probes come as often as a
narrow batch's instead of one dear probe now and then (an 8B-shaped target at batch 256 spent 3% of
a one-second run on one full probe, measured on the H200; partial probes there then took ~36 ms
each, three a run, above their prediction: the charge above came after that measurement).

Start-up: until the server-wide estimate rests on MEASURED drafts tried, a choice is mostly the
optimistic prior's, and at a large batch the full blocks it may pick cost several decode steps each
(more than the startup profile says: it times the forward only). So such a choice is cut to the
samples (in order) whose drafts add at most EXPLORE_SHARE of a plain decode step (the first sample's
drafts at least; all of a lone sample's, so batch 1 verifies full blocks at once), and serves one step
only: each step's results steer the next, and a good drafter reaches full blocks within a few steps.
So does a choice of a kind of step (CUDA graph or not, drafting or not, rows bucket) whose wall time
the cost model has not observed yet: a misjudged step is then paid once, not RECHOOSE_STEPS times.
"""

from __future__ import annotations

from itertools import chain, compress

import numpy as np

from rollout.engine.draft_choice import choose_drafts, explore, same_rule, slot_gains
from rollout.engine.drafter import DraftCounts
from rollout.engine.sequence import Sequence
from rollout.engine.step_cost import StepCost, rows_bucket

PRIOR = 0.8  # conditional acceptance assumed before anything is measured
SERVER_PRIOR_WEIGHT = 4.0  # the prior's worth in drafts tried, server-wide
SERVER_DECAY = 0.97  # server-wide counts, per step that verified drafts
PRIOR_WEIGHT = 2.0  # the server-wide estimate's worth in a sample's own drafts tried
SAMPLE_DECAY = 0.8  # a sample's counts of one position, per draft tried there
PROBE_ROWS = 8  # a probe of a step that declined every draft verifies full blocks for this many samples
PROBE_SHARE = 0.005  # issue 19 allows speculation 3% of the time where it does not pay; a loaded drafter's
# context update took ~2% of the 8B shape's batch-8 steps without drafts on the H200 (6.11 against 5.99 ms;
# BENCHMARKS.md), and 1% of probing left the adaptive arm at 0.964-0.970 of no drafter
MEASURED = 8.0  # drafts tried server-wide at the first position (decayed) before the prior stops steering
RECHOOSE_STEPS = 8  # steps a full choice's rule serves (SpecBudget._choose)
REUSE_STEPS = 16  # the same while no draft is verified
MAX_DOUBLINGS = 3  # of those, while full choices keep choosing the same rule


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

    def measured(self) -> bool:
        """Whether the server-wide estimate rests on MEASURED drafts tried (else mostly the prior)."""
        return bool(self.server_tried[0] >= MEASURED)

    def of(self, seqs: list[Sequence]) -> np.ndarray:
        """[S, K] the estimates of these samples (a new sample: the server-wide one)."""
        idx = self._rows(seqs)
        return (self.accepted[idx] + PRIOR_WEIGHT * self.server_wide()) / (self.tried[idx] + PRIOR_WEIGHT)

    def observe(self, seqs: list[Sequence], num_draft: np.ndarray, num_accepted: np.ndarray, steps: int = 1) -> None:
        """Verify results of `steps` steps: entry i (a sample; one may come more than once) verified
        num_draft[i] > 0 drafts and accepted num_accepted[i]. Within one call, a sample's results count
        alike, as if its counts decayed once per draft tried over the lot. A finished sample's count
        server-wide only (its row may already serve another sample)."""
        k = self.num_spec
        judged = np.minimum(num_accepted + 1, num_draft)  # [E] positions judged: 0 .. judged - 1
        unique = list(dict.fromkeys(seqs))  # [U] the samples, in order of first entry
        index = {s: u for u, s in enumerate(unique)}
        entry = np.fromiter(map(index.__getitem__, seqs), np.int64, len(seqs))  # [E] -> [U]
        # per sample u and position j: entries that judged (accepted) position j = those whose count > j
        tried = _counts_above(entry, judged, len(unique), k)  # [U, K]
        accepted = _counts_above(entry, num_accepted, len(unique), k)  # [U, K]
        self.server_tried = self.server_tried * SERVER_DECAY ** steps + tried.sum(axis=0)
        self.server_accepted = self.server_accepted * SERVER_DECAY ** steps + accepted.sum(axis=0)
        live = [u for u, s in enumerate(unique) if not s.is_finished]
        rows = self._rows([unique[u] for u in live])  # [L] (distinct samples: distinct rows)
        decay = SAMPLE_DECAY ** tried[live]
        self.tried[rows] = self.tried[rows] * decay + tried[live]
        self.accepted[rows] = self.accepted[rows] * decay + accepted[live]

    def _rows(self, seqs: list[Sequence]) -> np.ndarray:
        rows = [self.rows.get(s, -1) for s in seqs]
        if -1 in rows:
            for i, s in enumerate(seqs):  # (a sample may come more than once)
                if rows[i] < 0:
                    rows[i] = self.rows[s] if s in self.rows else self._allocate(s)
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


def _counts_above(group: np.ndarray, count: np.ndarray, groups: int, k: int) -> np.ndarray:
    """[groups, k]: entry (group[e], j) counts the entries e of that group with count[e] > j (count in
    0..k): a histogram of the counts per group, summed from the top."""
    hist = np.bincount(group * (k + 1) + count, minlength=groups * (k + 1)).reshape(groups, k + 1)
    return np.cumsum(hist[:, :0:-1], axis=1)[:, ::-1].astype(np.float64)



def step_shape(step) -> tuple[int, int, int, int]:
    """A recorded step's (a StepBatch) shape as the cost model takes it: its rows, its tokens besides
    drafts, its rows that draft and its drafts."""
    num_draft = step.rows.num_draft
    drafts = sum(num_draft)
    return (len(step.tokens.items), step.tokens.meta.slot_mapping.shape[0] - drafts,
            len(num_draft) - num_draft.count(0), drafts)


class SpecBudget:
    """The scheduler's draft budget of each step (`caps`) and the engine's record of each step's
    verify results and wall time (`record`), which the acceptance estimates and the cost model learn
    from. `summary` is for the server's periodic log line."""

    def __init__(self, num_spec: int, cost: StepCost, graphs: bool, max_graph_rows: int,
                 counts: DraftCounts | None = None):
        self.num_spec = num_spec
        self.cost = cost
        self.graphs = graphs  # decode / verify steps replay CUDA graphs
        self.max_graph_rows = max_graph_rows
        self.counts = counts if counts is not None else DraftCounts()  # the engine's drafts proposed, accepted
        self._summarised = self.counts.total()  # ... at the last summary
        self.acceptance = AcceptanceEstimates(num_spec)
        self.credit = 0.0  # seconds of probing earned (see the module docstring)
        self.totals = dict.fromkeys(("steps", "decode_rows", "probes", "declined", "declined_eager", "verified_rows",
                                     "draft_steps", "draft_seconds", "eager_draft_steps", "eager_draft_seconds"), 0)
        self._timings: list[tuple] = []  # recorded steps' shapes and wall times, not learned from yet
        self._verified: list[tuple] = []  # recorded steps' (entries, num_draft, num_accepted), the same
        self._key, self._last, self._age = None, None, 0  # the last full choice, steps it served
        self._counts: dict[Sequence, int] = {}  # its threshold rule's drafts per sample (_rule_counts)
        self._streak = 0  # full choices in a row that chose the rule they had (_serves)
        self._tentative = False  # the last full choice rested on the prior or an untimed kind of step
        self._probe_turn = 0  # where the next partial probe's samples start among those that may draft
        self._probe_due: tuple[float, int] | None = None  # a probe chosen, not yet recorded: (predicted
        # seconds, its choice)
        self.choices = 0  # caps() calls so far: the choice a step's plan came from (`record`)

    def caps(self, running: list[Sequence], token_budget: int, waiting_tokens: int = 0,
             states: list[tuple[int, int]] | None = None) -> dict[Sequence, int]:
        """The most drafts each caught-up running sample verifies this step (the scheduler takes each
        one's min with its own limit: output left, token budget). token_budget: the step's token
        budget; waiting_tokens: the prompt tokens of the waiting samples it may admit (their prefill
        makes the step eager, and drafts get the room left after them: see the module docstring);
        states: the running samples' behind_and_remaining(), when the caller has them."""
        num_spec = self.num_spec
        self.choices += 1
        if states is None:
            states = [seq.behind_and_remaining() for seq in running]
        prefill = sum(behind for behind, _ in states if behind > 1)  # (comprehensions: this runs every
        if prefill:  # step, and a loop of appends and min / max calls took ~30 us at batch 32 on CPU)
            decode = [seq for seq, (behind, _) in zip(running, states) if behind <= 1]
            remaining = [left for behind, left in states if behind <= 1]
        else:
            decode, remaining = list(running), [left for _, left in states]
        limits = [num_spec if left > num_spec else (left - 1 if left > 0 else 0) for left in remaining]  # [S]
        if not decode:
            return {}
        base = min(token_budget, len(decode) + prefill + waiting_tokens)
        room = token_budget - base
        graphs = self.graphs and not prefill and not waiting_tokens and len(decode) <= self.max_graph_rows
        drafts, seconds, full_seconds = self._choose(decode, limits, len(running), base, room, graphs)
        full = sum(limits)
        if type(drafts) is int:  # k drafts for each sample, as far as its limit goes
            chosen = full if drafts >= num_spec else sum(min(k, drafts) for k in limits)
        else:
            chosen = sum(drafts)
        if chosen < full:
            drafts, chosen = self._probe(drafts, chosen, limits, seconds, full_seconds, room,
                                         (len(running), base, graphs))
        self.totals["steps"] += 1
        self.totals["decode_rows"] += len(decode)
        declined = chosen == 0 and full > 0  # a plain step where drafts could have gone
        self.totals["declined"] += declined
        self.totals["declined_eager"] += declined and not graphs  # of them, eager steps (bench_spec shows both)
        if type(drafts) is int:
            return dict.fromkeys(decode, drafts) if drafts else {}
        return dict(zip(decode, drafts))

    def _choose(self, decode: list[Sequence], limits: list[int], rows: int, base: int, room: int,
                graphs: bool) -> tuple[int | list[int], float, float]:
        """choose_drafts in full, or the last full choice's rule applied to this step's samples (see
        the module docstring): the drafts (an int k: k for every sample, within its limit; or [S] per
        sample), the step's predicted seconds and those of full blocks. A reused uniform rule costs
        no per-sample work here (the scheduler applies the limits)."""
        key = (graphs, rows_bucket(len(decode)), rows_bucket(rows), room < sum(limits))  # (room binds: prompts wait)
        if key != self._key and self._shrunk_under_full_blocks(key):
            self._key = key
        if key == self._key and self._age < self._serves():
            self._age += 1
            last, full_seconds = self._last
            if last.k >= 0:
                return last.k, last.seconds, full_seconds
            counts = self._rule_counts(decode, last.threshold)
            return list(map(min, limits, counts)), last.seconds, full_seconds
        self.learn()
        self._counts = {}
        acc = self.acceptance.of(decode)
        budget, full = choose_drafts(acc, np.asarray(limits, dtype=np.int64), self.cost, rows, base, room, graphs)
        exploring = budget.k != 0 and not self.acceptance.measured()
        if exploring:
            budget = explore(budget, acc, self.cost, rows, base, graphs)
        self._tentative = exploring or not self.cost.timed(rows, graphs, budget.k != 0)
        same = key == self._key and self._last is not None and same_rule(self._last[0], budget)
        self._streak = self._streak + 1 if same else 0
        self._key, self._last, self._age = key, (budget, full.seconds), 1
        drafts = budget.k if budget.k >= 0 else budget.drafts.tolist()
        return drafts, budget.seconds, full.seconds

    def _shrunk_under_full_blocks(self, key: tuple) -> bool:
        """Whether the last full choice verifies full blocks and the step differs from its key only in
        fewer rows (a draining batch: the rule serves on, see the module docstring)."""
        last = self._key
        return (last is not None and self._last[0].k == self.num_spec and not self._tentative
                and key[0] == last[0] and key[3] == last[3] and key[1] <= last[1] and key[2] <= last[2])

    def _rule_counts(self, decode: list[Sequence], threshold: float) -> list[int]:
        """[S] the drafts the last full choice's threshold rule gives each sample without its limit:
        its slots whose gain reaches the threshold, a prefix (gains fall with the position), so the
        limit applies after. Kept per sample until the next full choice (the estimates change only
        there): a reused step looks them up (at batch 32 recomputing them took ~150 us a step)."""
        counts = self._counts
        new = [s for s in decode if s not in counts]
        if new:
            gains = slot_gains(self.acceptance.of(new), np.full(len(new), self.num_spec))
            counts.update(zip(new, (gains >= threshold).sum(axis=1).tolist()))
        return [counts[s] for s in decode]

    def _serves(self) -> int:
        """Steps a full choice serves: one when tentative (see the module docstring), RECHOOSE_STEPS,
        REUSE_STEPS while no verify result has come in; doubled for each full choice in a row that
        chose the rule it had (`_streak`, up to MAX_DOUBLINGS)."""
        if self._tentative:
            return 1
        return (RECHOOSE_STEPS if self._verified else REUSE_STEPS) << min(self._streak, MAX_DOUBLINGS)

    def _probe(self, drafts: int | list[int], chosen: int, limits: list[int], seconds: float,
               full_seconds: float, room: int, shape: tuple[int, int, bool]) -> tuple[int | list[int], int]:
        """The step's drafts and their count: the chosen ones (`drafts`, `chosen` of them, `seconds`),
        or a probe's once the probing credit pays for its extra time: full blocks (`full_seconds`), or
        where the step declined every draft of more than PROBE_ROWS samples, full blocks for PROBE_ROWS
        of them in turn (module docstring). shape: the step's rows, tokens besides drafts, graphs."""
        self.credit += PROBE_SHARE * seconds
        partial = chosen == 0 and len(limits) > PROBE_ROWS
        if partial:  # priced as if every probed sample verified a whole block (the list is built once it pays)
            rows = min(PROBE_ROWS, len(limits) - limits.count(0))  # (chosen < full: one at least)
            total, probe_seconds = rows * self.num_spec, self.cost.seconds(*shape, rows, rows * self.num_spec)
        else:
            total, probe_seconds = sum(limits), full_seconds
        extra = max(probe_seconds - seconds, 0.0)
        if total > room or self.credit < extra:
            return drafts, chosen
        probe = self._partial_probe(limits) if partial else self.num_spec
        total = sum(probe) if partial else total
        self.credit -= extra
        self._probe_due = (probe_seconds, self.choices)
        self._probe_turn += PROBE_ROWS
        self.totals["probes"] += 1
        if not chosen:  # its results are all the step learns: at the next full choice, soon (where drafts
            self._streak = 0  # are verified anyway, the cadence stays: a probe there is cheap and frequent)
        return probe, total

    def _partial_probe(self, limits: list[int]) -> list[int]:
        """[S] full blocks for the next PROBE_ROWS samples that may draft, in turn from the last probe's."""
        able = [i for i, k in enumerate(limits) if k]
        turn = self._probe_turn % len(able)
        probe = [0] * len(limits)
        for i in (able[turn:] + able[:turn])[:PROBE_ROWS]:
            probe[i] = limits[i]
        return probe

    def record(self, step, num_accepted: list[int] | None, seconds: float, graphed: bool,
               choice: int | None = None) -> None:
        """After a step: `step` (a StepBatch), its entries' accepted drafts ([E], the step's host
        copy; None when no entry sampled), its wall time, whether its target forward replayed a
        CUDA graph, and the choice its plan came from (`choices` when it launched; None: the next
        drafting step recorded is a probe's). Kept until the next full choice learns from it."""
        rows = step.rows
        num_rows, tokens, drafting, drafts = step_shape(step)
        self._timings.append((num_rows, tokens, graphed, drafting, drafts, seconds))
        due = self._probe_due
        if due is not None and (drafting if choice is None else choice >= due[1]):
            if drafting and choice in (None, due[1]):  # a probe's time beyond its prediction is charged too
                self.credit -= max(seconds - due[0], 0.0)
            self._probe_due = None  # (a probe whose step drafted nothing after all is not charged)
        if drafting:  # (bench_spec: the time steps with drafts took, and those whose target ran eagerly)
            self.totals["draft_steps"] += 1
            self.totals["draft_seconds"] += seconds
            self.totals["eager_draft_steps"] += not graphed
            self.totals["eager_draft_seconds"] += 0.0 if graphed else seconds
        if num_accepted is not None and drafting:
            self._verified.append((rows.entries, rows.num_draft, num_accepted))

    def learn(self) -> None:
        """The recorded steps into the cost model and the acceptance estimates."""
        for timing in self._timings:
            self.cost.observe(*timing)
        self._timings = []
        if not self._verified:
            return
        entries, drafts, accepted = (chain.from_iterable(part) for part in zip(*self._verified))  # all steps
        seqs = list(compress(entries, chain.from_iterable(nd for _, nd, _ in self._verified)))  # drafted
        num_draft = np.fromiter(drafts, np.int64)  # [E']
        num_accepted = np.fromiter(accepted, np.int64)  # [E']
        verified = num_draft > 0
        self.acceptance.observe(seqs, num_draft[verified], num_accepted[verified], len(self._verified))
        self._verified = []
        self.totals["verified_rows"] += len(seqs)

    def forget_acceptance(self) -> None:
        """Back to the prior, as at a server's start (its cost model kept): bench_spec's fresh starts."""
        self.learn()
        self.acceptance = AcceptanceEstimates(self.num_spec)
        self.credit, self._key, self._probe_due = 0.0, None, None

    def summary(self) -> dict:
        """Since the last summary: steps, decode rows, drafts verified per decode row, probes, steps that
        declined every draft their samples could verify, accepted drafts per verifying row; now: the
        server-wide acceptance by position, the expected committed tokens of a full block for (up to
        16) running requests, the cost model."""
        self.learn()
        t, self.totals = self.totals, dict.fromkeys(self.totals, 0)
        now = self.counts.total()
        drafts, accepted = (a - b for a, b in zip(now, self._summarised))
        self._summarised = now
        requests: dict[str, list[float]] = {}
        live = [s for s in self.acceptance.rows if not s.is_finished]
        if live:
            expected = 1 + np.cumprod(self.acceptance.of(live), axis=1).sum(axis=1)  # [S]
            for seq, e in zip(live, expected.tolist()):
                if len(requests) < 16 or seq.request_id in requests:
                    requests.setdefault(seq.request_id, []).append(e)
        return dict(steps=t["steps"], decode_rows=t["decode_rows"], probes=t["probes"], declined=t["declined"],
                    drafts_per_row=round(drafts / max(t["decode_rows"], 1), 3),
                    accepted_per_verify=round(accepted / max(t["verified_rows"], 1), 3),
                    acceptance=[round(a, 3) for a in self.acceptance.server_wide().tolist()],
                    request_accept_length={r: round(sum(v) / len(v), 3) for r, v in requests.items()},
                    cost=self.cost.describe())
