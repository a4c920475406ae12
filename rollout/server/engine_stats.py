"""What the engine's side counts for metrics and the stats log, kept where the engine runs.

The engine loop (a thread, or the main thread of the engine's own process) adds to plain Python
counters: per step its duration; per finished sample its finish reason, tokens, verify steps, its
mean tokens per verify step and mask bytes (O(1) per sample: no walk over its tokens). Every
`SHIP_INTERVAL_S` while busy, once when it goes idle and once when it starts, it takes a
`StatsSnapshot` (those cumulative counters plus the engine's gauges: queue, running sequences, KV
blocks, policy version, preemptions) and hands it to the server's side with the messages it sends
anyway (rollout.server.loop's outbox; an engine process pickles it with its deliveries). The
server's side only keeps the latest snapshot (rollout.server.metrics).

Why this way rather than prometheus_client in the engine process (its multiprocess mode writes
every increment to an mmap'd file, and scrapes merge the files): a step then pays a few integer
additions and one bisect (well under a microsecond, against steps of milliseconds), nothing is
written per step, and no shared directory has to be set up and cleaned by `rollout serve`.
Counters are cumulative, so a snapshot that is late or replaced by the next one loses nothing.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

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

    @property
    def num_steps(self) -> int:
        return sum(self.steps)

    @property
    def num_samples(self) -> int:
        return sum(self.samples.values())



_NO_SCHEDULER = SimpleNamespace(num_preemptions=0, waiting=(), running=())


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
        )  # fmt: skip
