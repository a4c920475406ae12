"""The periodic `stats` log line of `rollout serve --stats-interval SECONDS`: the headline figures of
the metrics (rollout.server.metrics) over the last interval, one JSON line, only while there is
something to say (a request running or queued, or counters that moved since the last line)."""

from __future__ import annotations

import asyncio

from rollout.server.engine_stats import StatsSnapshot
from rollout.server.logs import log_event
from rollout.server.metrics import Metrics


async def log_stats(metrics: Metrics, interval: float) -> None:
    """Runs until cancelled: every `interval` seconds, one `stats` line unless the server is idle."""
    last: StatsSnapshot | None = None
    while True:
        await asyncio.sleep(interval)
        now, running = metrics.latest, metrics.running_requests()
        if now is None:
            continue
        if last is not None and (running or now.waiting or _moved(last, now)):
            log_event("stats", **headline(last, now, running))
        last = now


def headline(last: StatsSnapshot, now: StatsSnapshot, running_requests: int) -> dict:
    """Figures between two snapshots: counts and rates per second over the interval, gauges now."""
    seconds = max(now.taken - last.taken, 1e-9)
    # tokens committed in the interval, to finished samples or not (a failed sample's are dropped)
    tokens = max(now.generated_tokens + now.tokens_in_flight - last.generated_tokens - last.tokens_in_flight, 0)
    samples = now.num_samples - last.num_samples
    steps = now.num_steps - last.num_steps
    verify_steps = now.verify_steps - last.verify_steps
    used = now.kv_blocks_total - now.kv_blocks_free
    return dict(
        requests=running_requests, queued=now.waiting, running=now.running,
        kv_used=f"{used}/{now.kv_blocks_total}", samples=samples, tokens=tokens,
        samples_per_s=round(samples / seconds, 2), tokens_per_s=round(tokens / seconds, 1),
        step_ms=round((now.step_seconds - last.step_seconds) / steps * 1e3, 2) if steps else None,
        tokens_per_verify_step=round((now.generated_tokens - last.generated_tokens) / verify_steps, 2)
        if verify_steps else None,
        preemptions=now.preemptions - last.preemptions, policy_version=now.policy_version,
    )  # fmt: skip


def _moved(last: StatsSnapshot, now: StatsSnapshot) -> bool:
    return (now.num_steps, now.num_samples, now.policy_version) != (last.num_steps, last.num_samples,
                                                                     last.policy_version)
