"""Which drafts of which samples one step verifies, given their acceptance and the step's prices: the
choice the draft budget (spec_budget.py) makes when it chooses in full.

Terms. A decode sample verifying k drafts commits 1 + sum_{i<=k} prod_{j<=i} a_j tokens in
expectation, a_j being the conditional acceptance of its draft j (accepted, given drafts < j were);
`slot_gains` are those products, the expected tokens each draft slot (sample, position) adds. The
step's time comes from the cost model (step_cost.py). `choose_drafts` maximises the step's expected
committed tokens per second over
* no drafts at all: a plain decode step, the drafter's forward skipped;
* uniform blocks, k drafts for every sample (k = 1, 3, 7, ... and K);
* ragged blocks: draft slots admitted best expected gain first, the step re-priced at every count,
  keeping the count with the best rate (vLLM's adaptive verification).
Either replays a CUDA graph when the step has no prefill (a ragged one padded to a graph's tokens,
rollout.engine.graphs; the cost model prices the padding). `explore` cuts a choice that rests on the
prior, not on measured acceptance, to the drafts that add at most EXPLORE_SHARE of a plain decode
step (spec_budget.py's Start-up). Pure functions of numpy arrays and a StepCost: tested on synthetic
tables (tests/test_spec_budget.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rollout.engine.step_cost import StepCost

EXPLORE_SHARE = 0.2  # before acceptance is measured: the most a step's drafts may add to a plain decode step's time


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
    drafts; room: the most draft tokens it may add; graphs: the step replays a CUDA graph.
    Returns the budget with the best expected committed tokens per second (ties: fewer drafts), and
    full blocks (every sample its limit; what a probe verifies)."""
    gain = slot_gains(acc, limits)  # [S, K]
    committed = len(limits) + np.concatenate([[0.0], np.cumsum(gain.sum(axis=0))])  # [K+1] uniform k
    drafting = int(np.count_nonzero(limits))
    fitting = []
    for k in uniform_sizes(acc.shape[1]):
        drafts = np.minimum(limits, k)
        total = int(drafts.sum())
        seconds = cost.seconds(rows, base_tokens, graphs, drafting if k else 0, total)
        full = Budget(drafts, float(committed[k]), seconds, k)
        if total <= room:
            fitting.append(full)
    best = max(fitting, key=lambda b: b.rate)  # k = 0 always fits; the first of equals
    if len(limits) > 1:  # (one sample: ragged blocks are uniform ones)
        ragged = _ragged(gain, cost, rows, base_tokens, room, graphs)
        if ragged.rate > best.rate * (1 + 1e-9):
            best = ragged
    return best, full


def explore(budget: Budget, acc: np.ndarray, cost: StepCost, rows: int, base_tokens: int,
            graphs: bool) -> Budget:
    """`budget` (from choose_drafts) cut to its first drafting samples whose drafts add at most
    EXPLORE_SHARE of a plain decode step's seconds (the first one's drafts at least), priced as a
    ragged step; unchanged when all of them fit. acc: [S, K] as choose_drafts'."""
    order = np.flatnonzero(budget.drafts)  # [n] the samples that draft, in order
    if len(order) <= 1:
        return budget
    bound = (1 + EXPLORE_SHARE) * cost.seconds(rows, base_tokens, graphs, 0)
    if budget.seconds <= bound:
        return budget
    counts = budget.drafts[order]  # [n]
    per_token = np.repeat(np.arange(1, len(order) + 1), counts)  # [D] samples drafting once a token is in
    seconds = cost.ragged_seconds(rows, base_tokens, per_token, graphs)[np.cumsum(counts) - 1]  # [n] first n'
    n = max(1, int(np.searchsorted(seconds, bound, side="right")))
    if n == len(order):
        return budget
    drafts = np.zeros_like(budget.drafts)  # [S]
    drafts[order[:n]] = counts[:n]
    tokens = len(drafts) + float(slot_gains(acc, drafts).sum())
    return Budget(drafts, tokens, float(seconds[n - 1]), -1, float("inf"))


def same_rule(a: Budget, b: Budget) -> bool:
    """Whether two full choices chose the same rule: the same k, and for a threshold rule thresholds
    within 10% of each other."""
    if a.k != b.k:
        return False
    return a.k != -1 or abs(a.threshold - b.threshold) <= 0.1 * max(a.threshold, b.threshold)


def uniform_sizes(k_max: int) -> list[int]:
    """The uniform block sizes tried: 0, then 1, 3, 7, ... below k_max, and k_max."""
    return [0, *(k for k in (2 ** i - 1 for i in range(1, 7)) if k < k_max), k_max]


def slot_gains(acc: np.ndarray, limits: np.ndarray) -> np.ndarray:
    """[S, K] the expected tokens draft j + 1 adds: P(drafts 1..j+1 accepted), 0 past a sample's limit."""
    return np.cumprod(acc, axis=1) * (np.arange(acc.shape[1]) < limits[:, None])


def _ragged(gain: np.ndarray, cost: StepCost, rows: int, base_tokens: int, room: int, graphs: bool) -> Budget:
    """The best count n of draft slots taken best gain first (a sample's slots in position order),
    priced as a ragged step (graphs: replaying a CUDA graph)."""
    num = gain.shape[0]
    flat = gain.T.ravel()  # position-major: a stable sort keeps each sample's positions in order
    order = np.argsort(-flat, kind="stable")[: min(room, int(np.count_nonzero(flat)))]
    if not len(order):
        return Budget(np.zeros(num, dtype=np.int64), float(num), float("inf"), 0)
    committed = num + np.cumsum(flat[order])  # [n]
    seconds = cost.ragged_seconds(rows, base_tokens, np.cumsum(order < num), graphs)  # a sample's first slot drafts
    n = int(np.argmax(committed / seconds))
    drafts = np.bincount(order[: n + 1] % num, minlength=num)
    return Budget(drafts, float(committed[n]), float(seconds[n]), -1, float(flat[order[n]]))
