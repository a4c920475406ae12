"""What an engine step costs on this device, by shape: the price list of speculation (spec_budget.py).

A step's shape is its rows (sequences), its tokens (everything the target computes: decode anchors,
drafts, prefill chunks), whether it replays a CUDA graph (decode and verify steps do, uniform or
ragged; a graphed step computes the padded tokens of its graph, rollout.engine.graphs.padded_shape,
and the drafter's forward, graphed too, its batch bucket's rows) and how many rows draft (the
drafter's block forward runs when any do). Its cost is the step's wall time, schedule to commit, the end-of-step
synchronisation inside.

The model: measured tables times a learned correction.
* At startup (`profile_step_cost`) the target forward and LM head run over a few row counts, as
  decode steps (one token a row) and as verify steps (a full block a row), eagerly and, with CUDA
  graphs, replayed as the engine's own graphs (kept: the engine replays them later), and the
  drafter's block forward over the same row counts: a few seconds at most on a GPU. A table given
  instead (`StepCost(TargetCost(...), ...)`, tests) costs nothing.
* After every step (`observe`), its wall time against the tables' prediction moves a correction
  factor for its kind (graphed or not, drafting or not) and its rows bucket: what the tables leave
  out (the policy, verification, sampling, host work, longer contexts) learned where the engine
  actually runs, and carried to shapes it has not run yet through the tables' shape. `learn=False`
  freezes it.
* A drafting step is priced as the plain step of the same rows and tokens plus what drafting adds
  (the target's extra tokens, the drafter's forward), each with its own correction; a drafting
  step's correction learns from the time it took beyond the plain step's prediction. So drafting
  never looks cheaper than not drafting. (With one correction for a whole drafting step, learned
  on steps of one size, a step of a few drafts was priced below the plain step whenever the plain
  correction was the larger: on the H200 at 8B batch 256 an untrained drafter was then verified in
  nearly every step, 0.37 of no speculation.) What a drafting correction learned rests on the plain
  prediction of its moment; where that was not yet its bucket's own, the drafting correction gives
  back what the bucket's first plain steps move it (`_rebase`), so a drafting step stays priced at
  what drafting steps took.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

import numpy as np
import torch

from rollout.engine.attention import AttentionMetadata
from rollout.engine.graphs import BATCH_BUCKETS, bucket, padded_shape, token_marks

PROFILE_ROWS = (1, 4, 16, 64, 256)  # target and drafter forward points
PROFILE_CONTEXT = 256
LEARN_RATE = 0.1  # the correction's EMA weight of a new step (its n-th: max(1 / n, LEARN_RATE))
MAX_STEP_RATIO = 3.0  # a step counts as at most this factor off the prediction (a capture is slow once)
SETTLED = round(1 / LEARN_RATE)  # plain steps of a bucket after which its correction counts as its own
_BUCKETS = np.asarray(BATCH_BUCKETS, dtype=np.float64)  # (read-only)
_BUCKETS.setflags(write=False)


class Curve:
    """Seconds at increasing points xs; linear between them, flat before the first, the last
    segment's slope (never negative) after the last. `at` takes a number (plain Python: the budget
    prices a handful of candidates a step), calling it an array."""

    def __init__(self, xs, ys):
        self.xs, self.ys = [float(x) for x in xs], [float(y) for y in ys]
        if len(self.xs) != len(self.ys) or not self.xs or any(b <= a for a, b in zip(self.xs, self.xs[1:])):
            raise ValueError(f"a cost curve needs increasing points with one value each, got {xs}, {ys}")
        last = (self.ys[-1] - self.ys[-2]) / (self.xs[-1] - self.xs[-2]) if len(self.xs) > 1 else 0.0
        self.slope = max(0.0, last)

    def at(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if x >= xs[-1]:
            return ys[-1] + self.slope * (x - xs[-1])
        i = bisect.bisect_right(xs, x)
        if i == 0:
            return ys[0]
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return np.interp(x, self.xs, self.ys) + self.slope * np.maximum(x - self.xs[-1], 0.0)


ZERO = Curve((1.0,), (0.0,))


class TargetCost:
    """The target step's seconds by rows S and tokens T >= S, from decode steps (one token a row:
    `decode`) and verify steps (`q` tokens a row: `verify`) measured at the same row counts: in T,
    linear from the decode step through the verify step and on (a prefill chunk's tokens priced as
    drafts); in S, a Curve."""

    def __init__(self, rows, decode, verify, q: int):
        if q < 2:
            raise ValueError(f"verify steps need q >= 2 tokens a row, got {q}")
        self.decode, self.verify, self.q = Curve(rows, decode), Curve(rows, verify), q

    def line(self, rows: int) -> tuple[float, float]:
        """(seconds of the decode step of `rows` rows, seconds per token past them)."""
        d = self.decode.at(rows)
        return d, max(self.verify.at(rows) - d, 0.0) / (rows * (self.q - 1))

    def at(self, rows: int, tokens: float) -> float:
        d, per_token = self.line(rows)
        return d + per_token * (tokens - rows)

    def describe(self) -> dict:
        ms = lambda c: [round(y * 1e3, 3) for y in c.ys]  # noqa: E731
        return dict(rows=[int(x) for x in self.decode.xs], decode_ms=ms(self.decode), verify_ms=ms(self.verify),
                    q=self.q)


class StepCost:
    """Predicted seconds of a step (`seconds`, `ragged_seconds`), learned from the steps the engine runs
    (`observe`).

    eager: the target step run eagerly; graph: the same replayed as a CUDA graph (None: no graphs on
    this engine); drafter: the drafter's block forward by rows drafting."""

    def __init__(self, eager: TargetCost, graph: TargetCost | None = None, drafter: Curve = ZERO,
                 learn: bool = True):
        self.eager, self.graph, self.drafter = eager, graph, drafter
        self.learn = learn
        self.correction: dict[tuple, float] = {}  # (graphed, drafts) and (graphed, drafts, rows bucket)
        self.observed: dict[tuple, int] = {}  # steps seen, by the same keys
        self._plain_per_draft: dict[tuple, float] = {}  # by plain correction key (kind, bucket): see _rebase
        self._drafted: dict[tuple[bool, int], float] = {}  # (graphed, rows bucket): its last drafting step's seconds
        self._tables: dict[tuple[int, int, bool], float] = {}  # `_target`'s seconds by shape

    def seconds(self, rows: int, tokens: int, graphed: bool = False, draft_rows: int = 0, drafts: int = 0) -> float:
        """rows: the step's sequences; tokens: what the target computes besides drafts (decode anchors,
        prefill chunks), before any graph padding; graphed: it replays a CUDA graph; draft_rows: how
        many rows draft (0: the drafter does not run), verifying `drafts` draft tokens in all."""
        graphed = graphed and self.graph is not None
        plain = self._target(rows, tokens, graphed) * self._scale(rows, graphed, False)
        if not draft_rows:
            return plain
        return plain + self._drafting(rows, tokens, graphed, draft_rows, drafts) * self._scale(rows, graphed, True)

    def ragged_seconds(self, rows: int, tokens: int, draft_rows: np.ndarray, graphed: bool = False) -> np.ndarray:
        """[N] seconds of ragged steps of `rows` rows with tokens + n tokens (n = 1..N drafts), draft_rows [N]
        of them drafting (> 0); graphed: they replay CUDA graphs (their tokens padded as padded_shape pads)."""
        graphed = graphed and self.graph is not None
        counts, batch = tokens + np.arange(1, len(draft_rows) + 1), rows  # [N]
        if graphed:
            batch = bucket(rows, BATCH_BUCKETS) or rows
            marks = token_marks(batch, self.graph.q)  # [M]
            counts = marks[np.minimum(np.searchsorted(marks, counts), len(marks) - 1)]  # [N] padded
        d, per_token = (self.graph if graphed else self.eager).line(batch)
        plain = self._target(rows, tokens, graphed)
        extra = np.maximum(d + per_token * (counts - batch) - plain, 0.0) + self._drafter(draft_rows)  # [N]
        return plain * self._scale(rows, graphed, False) + extra * self._scale(rows, graphed, True)

    def observe(self, rows: int, tokens: int, graphed: bool, draft_rows: int, drafts: int, seconds: float) -> None:
        """A step of this shape (as `seconds` takes it) took `seconds` (wall time), counted as at most
        MAX_STEP_RATIO off the current prediction (one that built a graph or a kernel is slow once). A
        plain step moves the plain correction of its kind (graphed or not) and rows bucket towards
        seconds / the tables' prediction; a drafting step moves the drafting correction towards the
        time it took beyond the plain step's prediction / what the tables say drafting adds (at least
        1 / MAX_STEP_RATIO of that). Each an EMA of the ratio over the steps of its key (a running mean
        for the first 1 / LEARN_RATE): the mean, not the geometric mean, since throughput follows
        the mean step time (steps of one kind that vary by 2x in time, averaged in logs, were priced
        ~6% below their mean; at 3x, ~13%). A step the bound cut moves the correction to the bound
        without counting as a step of the mean: a kind's first steps, 10x its tables on a host-bound
        engine (a CUDA graph's table times the device alone), would otherwise stay in its running
        mean at the bound (3x) and price the kind low for good where few of its steps run (a
        draining batch's first graphed plain steps: 5.6x against 7.2x on bench_spec's long tail
        replayed on CPU with GPU-like step times), and what drafting adds was priced high by the
        same error."""
        graphed = graphed and self.graph is not None
        if not self.learn or seconds <= 0:
            return
        model = target = self._target(rows, tokens, graphed)  # the tables' part this step corrects
        predicted = plain = target * self._scale(rows, graphed, False)  # (as `seconds` predicts the step)
        if draft_rows:
            model = self._drafting(rows, tokens, graphed, draft_rows, drafts)
            predicted = plain + model * self._scale(rows, graphed, True)
        bucket_ = rows_bucket(rows)
        bounded = min(max(seconds, predicted / MAX_STEP_RATIO), self._upper(predicted, graphed, bucket_, draft_rows))
        counted, seconds = bounded == seconds, bounded
        if draft_rows:
            self._drafted[(graphed, bucket_)] = bounded
            seconds = max(seconds - plain, model / MAX_STEP_RATIO)
        if model <= 0:
            return
        kind, ratio = (graphed, draft_rows > 0), seconds / model
        before = {} if draft_rows else {key: self._plain_scale(key) for key in self._plain_per_draft
                                        if key[0] == graphed}
        for key in ((*kind, bucket_), kind):  # the bucket's starts from its kind's
            now = self.correction.get(key, self.correction.get(kind, 1.0))
            n = self.observed.get(key, 0) + 1
            if counted:
                self.observed[key] = n
            self.correction[key] = now + max(1 / n, LEARN_RATE) * (ratio - now)
        if draft_rows:
            for key in ((graphed, False, bucket_), (graphed, False)):  # the plain corrections its price used
                if self.observed.get(key, 0) < SETTLED:  # its plain part still moving
                    self._plain_per_draft[key] = target / model
        else:
            self._rebase(before)

    def _upper(self, predicted: float, graphed: bool, bucket_: int, draft_rows: int) -> float:
        """The most a step counts as: MAX_STEP_RATIO x its prediction, and for a plain step in a
        bucket with no plain step counted yet, at least what the bucket's last drafting step took. A
        plain step costs no more than one that also drafts: where only drafting steps have run (a
        batch whose every step drafted), the plain price is the tables' (a CUDA graph's table times
        the device alone, a tenth of a host-bound step), and the bound alone took two or three
        plain steps, each a declined draft, to reach it. A plain step slow once (a graph captured)
        is still cut: to a drafting step's price at most."""
        upper = predicted * MAX_STEP_RATIO
        if not draft_rows and not self.observed.get((graphed, False, bucket_), 0):
            upper = max(upper, self._drafted.get((graphed, bucket_), 0.0))
        return upper

    def _rebase(self, before: dict[tuple, float]) -> None:
        """After a plain step moved the plain corrections: a drafting correction learned the time its
        steps took beyond the plain prediction of the moment, so where that prediction was not yet its
        own (a bucket's borrowed from its kind, which other buckets taught, or either still averaging
        its first SETTLED steps) it absorbed the prediction's error. Each such drafting correction, a
        bucket's and its kind's, gives back what its plain counterpart (`before`: plain key -> its
        scale before the step) moved, counted at the plain tables' seconds per drafting second of its
        last drafting step, until SETTLED plain steps of its own have been seen. (Without this, a
        batch that only drafted at a bucket whose plain steps cost more than the borrowed correction
        said priced plain steps low there, and once plain steps taught the truth, priced drafting high
        by the same amount until probes, a few in a hundred steps, unlearned it. The kind's drafting
        correction, where buckets not drafted yet start, kept that error, so a batch whose first
        graphed steps all drafted, at a plain price of the CUDA graph's table (a tenth of a host-bound
        step), priced drafting high at each smaller bucket it drained to. Later moves
        of a settled plain correction, the engine's speed changing, are not given back: drafting
        steps then move their own correction.)"""
        for plain, old in before.items():
            moved = self._plain_scale(plain) - old
            key = (plain[0], True, *plain[2:])
            if moved and key in self.correction:
                share = self._plain_per_draft[plain]
                self.correction[key] = max(self.correction[key] - moved * share, 1 / MAX_STEP_RATIO)
            if self.observed.get(plain, 0) >= SETTLED:
                del self._plain_per_draft[plain]

    def _plain_scale(self, key: tuple) -> float:
        """The plain correction a key names ((graphed, False, bucket) or (graphed, False)) now."""
        return self._bucket_scale(key[0], False, key[2]) if len(key) == 3 else self.correction.get(key, 1.0)

    def timed(self, rows: int, graphed: bool, drafting: bool) -> bool:
        """Whether a step of this kind and rows bucket has been observed (a frozen model: always)."""
        graphed = graphed and self.graph is not None
        return not self.learn or (graphed, drafting, rows_bucket(rows)) in self.observed

    def _target(self, rows: int, tokens: int, graphed: bool) -> float:
        """The tables' seconds of the target step, uncorrected (remembered by shape: the tables never
        change, and a step's shapes recur; the budget prices several a step)."""
        key = (rows, tokens, graphed)
        seconds = self._tables.get(key)
        if seconds is None:
            if len(self._tables) >= 4096:
                self._tables.clear()
            seconds = self._tables[key] = self._table_seconds(rows, tokens, graphed)
        return seconds

    def _table_seconds(self, rows: int, tokens: int, graphed: bool) -> float:
        if graphed and tokens <= rows * self.graph.q:  # its graph's padded tokens (padding rows: by their tokens)
            q = tokens // rows if tokens % rows == 0 else self.graph.q
            padded = (padded_shape(rows, tokens, q, BATCH_BUCKETS) or (rows, tokens))[1]
            return self.graph.at(bucket(rows, BATCH_BUCKETS) or rows, padded)
        return self.eager.at(rows, tokens)

    def _drafting(self, rows: int, tokens: int, graphed: bool, draft_rows: int, drafts: int) -> float:
        """The tables' seconds that drafting adds to the plain step (never negative): the target's
        extra tokens, the drafter's forward."""
        extra = max(self._target(rows, tokens + drafts, graphed) - self._target(rows, tokens, graphed), 0.0)
        return extra + self._drafter(draft_rows)

    def _drafter(self, draft_rows):
        """Seconds of the drafter's forward over `draft_rows` rows (an int, or [N] of them: [N] seconds):
        over their batch bucket's with CUDA graphs (the drafter's graphs pad its rows as the target's
        do, whatever the target step). One count in plain Python: every step prices one."""
        if isinstance(draft_rows, (int, np.integer)):
            graphed = self.graph is not None
            return self.drafter.at((bucket(draft_rows, BATCH_BUCKETS) or draft_rows) if graphed else draft_rows)
        rows = np.asarray(draft_rows, dtype=np.float64)
        if self.graph is not None:
            i = np.searchsorted(_BUCKETS, rows)
            rows = np.where(i < len(_BUCKETS), _BUCKETS[np.minimum(i, len(_BUCKETS) - 1)], rows)
        return self.drafter(rows)

    def _scale(self, rows: int, graphed: bool, drafts: bool) -> float:
        return self._bucket_scale(graphed, drafts, rows_bucket(rows))

    def _bucket_scale(self, graphed: bool, drafts: bool, bucket_: int) -> float:
        c = self.correction
        return c.get((graphed, drafts, bucket_), c.get((graphed, drafts), 1.0))

    def describe(self) -> dict:
        """The tables (milliseconds) and the learned corrections, for logs."""
        corrections = {"/".join(map(str, k)): round(v, 3) for k, v in self.correction.items()
                       if len(k) == 2}
        return dict(eager=self.eager.describe(), graph=self.graph.describe() if self.graph is not None else None,
                    drafter_ms=[round(y * 1e3, 3) for y in self.drafter.ys], corrections=corrections)


def rows_bucket(rows: int) -> int:
    """The CUDA-graph batch bucket of `rows`, or the next power of two past the largest."""
    return bucket(rows, BATCH_BUCKETS) or 1 << (rows - 1).bit_length()


# -- startup profile --------------------------------------------------------------------------


def profile_step_cost(forward: Callable, logits: Callable, graphs, draft_forward: Callable | None, q: int,
                      scratch_block: int, block_size: int, device: torch.device, max_rows: int,
                      max_tokens: int, max_seconds: float = 3.0) -> StepCost:
    """Time the target step (`forward(input_ids [T], meta)` then `logits(hidden)`) over PROFILE_ROWS
    rows up to `max_rows`, as decode steps (1 token a row) and verify steps (`q` a row, while within
    `max_tokens`), eagerly and (with `graphs`, the engine's StepGraphs) replayed as graphs; and
    `draft_forward(rows)` (a thunk of the drafter's block forward over that many rows; it or the thunk
    None: no drafter cost). Every token reads and writes the scratch block only. Past `max_seconds` no more
    row counts are added (two at least). On a GPU the fewest and the most rows come first, so that a
    profile cut short interpolates the rows between them rather than extrapolating past its last point
    (on the H200 the 8B's 3 s ended after 16 rows, and batch 256 was priced from the slope between 4
    and 16); on CPU, where the largest eager step alone takes seconds, they come in increasing order."""
    deadline = time.perf_counter() + max_seconds
    points = {"eager": [], "graph": [], "drafter": []}
    for rows in profile_rows(max_rows, max_tokens, q, ends_first=device.type == "cuda"):
        if time.perf_counter() > deadline and len(points["eager"]) >= 2:
            break
        eager, graph = [rows], [rows]
        for tokens_per_row in (1, q):
            meta = scratch_meta(rows, tokens_per_row, scratch_block, block_size, device)
            seconds = _time_target(forward, logits, graphs, meta, device)
            eager.append(seconds[0])
            graph.append(seconds[1])
        points["eager"].append(eager)
        if None not in graph:
            points["graph"].append(graph)
        thunk = draft_forward(rows) if draft_forward is not None else None
        if thunk is not None:
            points["drafter"].append((rows, _time(thunk, device)))
    points = {k: sorted(v) for k, v in points.items()}  # by rows
    tables = {k: TargetCost(*zip(*v), q) if v else None for k, v in points.items() if k != "drafter"}
    drafter = Curve(*zip(*points["drafter"])) if points["drafter"] else ZERO
    return StepCost(tables["eager"], tables["graph"], drafter)


def profile_rows(max_rows: int, max_tokens: int, q: int, ends_first: bool) -> list[int]:
    """The PROFILE_ROWS counts whose verify steps fit (`q` tokens a row within max_tokens, at most
    max_rows), in the order the profile times them: increasing, or (`ends_first`) the fewest, the
    most, then those between."""
    counts = [r for r in PROFILE_ROWS if r <= max_rows and r * q <= max_tokens] or [1]
    return [counts[0], *counts[1:][-1:], *counts[1:-1]] if ends_first else counts


def scratch_meta(rows: int, q: int, scratch_block: int, block_size: int, device: torch.device) -> AttentionMetadata:
    """A step of `rows` sequences of q tokens each, ending at position PROFILE_CONTEXT - 1, whose block
    tables and slots are all the scratch block (which no sequence owns)."""
    width = -(-PROFILE_CONTEXT // block_size)
    kw = dict(dtype=torch.int64, device=device)
    return AttentionMetadata(
        positions=(PROFILE_CONTEXT - q + torch.arange(q, **kw)).repeat(rows),
        slot_mapping=torch.full((rows * q,), scratch_block * block_size, **kw),
        cu_seqlens_q=torch.arange(0, rows * q + 1, q, **kw), context_lens=torch.full((rows,), PROFILE_CONTEXT, **kw),
        block_tables=torch.full((rows, width), scratch_block, **kw), max_query_len=q,
        max_context_len=PROFILE_CONTEXT, block_size=block_size)


def _time_target(forward: Callable, logits: Callable, graphs, meta: AttentionMetadata,
                 device: torch.device) -> tuple[float, float | None]:
    """Seconds of the target step over `meta`: eager, and replayed as a graph (None without one)."""
    ids = torch.zeros(meta.slot_mapping.shape[0], dtype=torch.int64, device=device)  # [T]
    eager = _time(lambda: logits(forward(ids, meta)[0]), device)
    key = graphs.key(meta) if graphs is not None else None
    return eager, None if key is None else _time(lambda: logits(graphs.run(key, ids, meta)[0]), device)


def _time(fn: Callable[[], object], device: torch.device, min_seconds: float = 0.02, max_iters: int = 10) -> float:
    """Seconds per call of fn after one warm-up call: at least 2 calls, more up to min_seconds."""
    _sync(device)
    fn()
    _sync(device)
    start, n = time.perf_counter(), 0
    while n < 2 or (n < max_iters and time.perf_counter() - start < min_seconds):
        fn()
        n += 1
        _sync(device)
    return (time.perf_counter() - start) / n


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
