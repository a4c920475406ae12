"""What the engine's side counts for metrics and the stats log, kept where the engine runs.

The engine loop (a thread, or the main thread of the engine's own process) adds to plain Python
counters: per step its duration; per finished sample its finish reason, tokens, verify steps, its
mean tokens per verify step and mask bytes (O(1) per sample: no walk over its tokens). Every
`SHIP_INTERVAL_S` while busy, once when it goes idle and once when it starts, it takes a
`StatsSnapshot` (those cumulative counters plus the engine's gauges: queue, running sequences, KV
blocks, policy version, preemptions; and its draft tokens proposed and accepted by proposer and
policy version) and hands it to the server's side with the messages it sends anyway
(rollout.server.loop's outbox; an engine process pickles it with its deliveries). The server's side
only keeps the latest snapshot (rollout.server.metrics).

Why this way rather than prometheus_client in the engine process (its multiprocess mode writes
every increment to an mmap'd file, and scrapes merge the files): a step then pays a few integer
additions and one bisect (well under a microsecond, against steps of milliseconds), nothing is
written per step, and no shared directory has to be set up and cleaned by `rollout serve`.
Counters are cumulative, so a snapshot that is late or replaced by the next one loses nothing.

`BusyPeriod` counts one busy period of the engine loop for its `engine_idle` log line.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from rollout.outputs import SampleOutput
from rollout.server.logs import elapsed_ms, log_event

SHIP_INTERVAL_S = 0.25
# upper bounds of the step-time histogram (seconds) and of a sample's mean tokens per verify step
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)


@dataclass
class StatsSnapshot:
    """Counters since the engine started (histograms as per-bucket counts, the last bucket +Inf)
    and gauges at `taken` (time.monotonic() of the engine's process)."""

    taken: float = 0.0
    steps: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS) + 1))
    step_seconds: float = 0.0
    samples: dict[str, int] = field(default_factory=dict)  # by finish reason
    generated_tokens: int = 0
    prompt_tokens: int = 0
    verify_steps: int = 0  # steps that committed tokens to a finished sample, summed over samples
    acceptance: list[int] = field(default_factory=lambda: [0] * (len(ACCEPT_BUCKETS) + 1))  # samples
    acceptance_sum: float = 0.0
    mask_bytes: int = 0
    preemptions: int = 0
    tokens_in_flight: int = 0  # output tokens of unfinished samples (so rates move before samples finish)
    waiting: int = 0
    running: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    policy_version: int = 0
    # draft tokens (proposed, accepted) by (proposer, policy version): the engine's DraftCounts
    drafts: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return sum(self.steps)

    @property
    def num_samples(self) -> int:
        return sum(self.samples.values())



_NO_SCHEDULER = SimpleNamespace(num_preemptions=0, waiting=(), running=())
_NO_DRAFTS = SimpleNamespace(by_key={})


class EngineStats:
    """The engine loop's counters (engine thread only)."""

    def __init__(self):
        self.counts = StatsSnapshot()
        self.due = 0.0  # when the next snapshot is due while busy (time.perf_counter())

    def record_step(self, seconds: float) -> None:
        counts = self.counts
        counts.steps[bisect.bisect_left(STEP_BUCKETS, seconds)] += 1
        counts.step_seconds += seconds

    def record_samples(self, samples: list) -> None:
        """Finished `SampleOutput`s (aborted and failed ones too)."""
        counts = self.counts
        for sample in samples:
            counts.samples[sample.finish_reason] = counts.samples.get(sample.finish_reason, 0) + 1
            tokens, steps = len(sample.token_ids), len(sample.accept_lengths)
            counts.generated_tokens += tokens
            counts.prompt_tokens += len(sample.prompt_token_ids)
            if steps:
                counts.verify_steps += steps
                counts.acceptance[bisect.bisect_left(ACCEPT_BUCKETS, tokens / steps)] += 1
                counts.acceptance_sum += tokens / steps
            supports = sample.supports
            if supports is not None:
                counts.mask_bytes += supports.ids.nbytes + supports.lens.nbytes + (
                    0 if supports.logprobs is None else supports.logprobs.nbytes)

    def snapshot(self, engine: Any) -> StatsSnapshot:
        """The counters so far and the engine's gauges now (a copy: the engine goes on counting).
        O(unfinished samples), every SHIP_INTERVAL_S: not per step."""
        counts = self.counts
        free, total = engine.kv_blocks()
        scheduler = getattr(engine, "scheduler", _NO_SCHEDULER)  # (an engine without one: zeros)
        self.due = time.perf_counter() + SHIP_INTERVAL_S
        return StatsSnapshot(
            taken=time.monotonic(), steps=list(counts.steps), step_seconds=counts.step_seconds,
            samples=dict(counts.samples), generated_tokens=counts.generated_tokens,
            prompt_tokens=counts.prompt_tokens, verify_steps=counts.verify_steps,
            acceptance=list(counts.acceptance), acceptance_sum=counts.acceptance_sum,
            mask_bytes=counts.mask_bytes, preemptions=scheduler.num_preemptions,
            tokens_in_flight=sum(len(seq.output_token_ids) for queue in (scheduler.running, scheduler.waiting)
                                 for seq in queue),
            waiting=len(scheduler.waiting), running=len(scheduler.running),
            kv_blocks_free=free, kv_blocks_total=total, policy_version=engine.policy_version,
            drafts=dict(getattr(engine, "draft_counts", _NO_DRAFTS).by_key),
        )  # fmt: skip


@dataclass
class BusyPeriod:
    """Steps from the engine's leaving idle to its return: logged as `engine_idle` (steps, time in
    `engine.step()`, the period's length, the engine thread's CPU time, when the first step began
    and the last request of the period came in, both from its start, and the CUDA graphs and Triton
    kernel variants built meanwhile), which tells a slow step from time spent between steps, host work from waiting (for
    the GPU or the GIL), shows how long a burst of requests took to come in, and which periods paid
    for captures."""

    started: float
    compiled_before: dict[str, int] = field(default_factory=dict)
    cpu_started: float = field(default_factory=time.thread_time)
    steps: int = 0
    step_seconds: float = 0.0
    tokens: int = 0
    first_step: float = 0.0
    last_admitted: float = 0.0

    def add(self, start: float, finished: list[SampleOutput]) -> None:
        self.steps += 1
        self.step_seconds += time.perf_counter() - start
        self.tokens += sum(len(s.token_ids) for s in finished)

    def log(self, compiled: dict[str, int]) -> None:
        cpu_ms = round((time.thread_time() - self.cpu_started) * 1e3, 2)  # the engine thread's CPU time
        since = {name: round(max(t - self.started, 0.0) * 1e3, 2) for name, t in
                 (("first_step_ms", self.first_step), ("last_admitted_ms", self.last_admitted))}
        log_event("engine_idle", steps=self.steps, step_ms=round(self.step_seconds * 1e3, 2),
                  busy_ms=elapsed_ms(self.started), cpu_ms=cpu_ms, finished_tokens=self.tokens,
                  **{f"new_{k}": n - self.compiled_before.get(k, 0) for k, n in compiled.items()}, **since)
