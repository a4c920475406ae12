"""Prometheus metrics of a rollout server (`rollout serve --metrics-port`), with prometheus_client.

Two sources, one registry per server:
- RPCs, counted where they end in the server's process: `RequestCounter` is a grpc.aio server
  interceptor that labels every `rollout.v1.Rollout` call with its method and status code (OK,
  CANCELLED when the client went away, or the code the handler aborted with).
- The engine's counters and gauges, which live where the engine runs (rollout.server.engine_stats):
  the engine loop ships a `StatsSnapshot` now and then, `Metrics.update` keeps the latest, and
  `EngineCollector` turns it into metric families when Prometheus scrapes.

`serve_metrics` starts the HTTP endpoint (prometheus_client's own server, on a thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Callable, Iterator

import grpc
from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from rollout.server.engine_stats import ACCEPT_BUCKETS, STEP_BUCKETS, StatsSnapshot

RPC_PREFIX = "/rollout.v1.Rollout/"


class Metrics:
    """The server's registry: RPC counts, and the engine's latest snapshot (None until the first)."""

    def __init__(self, running_requests: Callable[[], int]):
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("rollout_requests", "RPCs ended, by method and gRPC status code",
                                ["rpc", "code"], registry=self.registry)
        self.running_requests = running_requests
        self.latest: StatsSnapshot | None = None
        self.registry.register(EngineCollector(self))

    def update(self, snapshot: StatsSnapshot) -> None:
        """The engine loop's `on_stats` (on the event loop; scrapes read `latest` from their thread)."""
        self.latest = snapshot


class EngineCollector(Collector):
    """The engine's figures from the latest snapshot, built at each scrape."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self) -> Iterator:
        yield GaugeMetricFamily("rollout_running_requests", "Generate requests admitted and not yet done",
                                value=self.metrics.running_requests())
        s = self.metrics.latest
        if s is None:
            return
        samples = CounterMetricFamily("rollout_samples", "Finished samples, by finish reason", labels=["finish_reason"])
        for reason, n in sorted(s.samples.items()):
            samples.add_metric([reason], n)
        yield samples
        yield CounterMetricFamily("rollout_generated_tokens", "Output tokens of finished samples",
                                  value=s.generated_tokens)
        yield GaugeMetricFamily("rollout_output_tokens_in_flight", "Output tokens of unfinished samples so far",
                                value=s.tokens_in_flight)
        yield CounterMetricFamily("rollout_prompt_tokens", "Prompt tokens of finished samples (once per sample)",
                                  value=s.prompt_tokens)
        yield GaugeMetricFamily("rollout_queued_samples", "Samples waiting to start (or to resume after a "
                                "preemption)", value=s.waiting)
        yield GaugeMetricFamily("rollout_running_sequences", "Sequences in the running batch", value=s.running)
        kv = GaugeMetricFamily("rollout_kv_blocks", "KV cache blocks, by state", labels=["state"])
        kv.add_metric(["used"], s.kv_blocks_total - s.kv_blocks_free)
        kv.add_metric(["free"], s.kv_blocks_free)
        yield kv
        yield _histogram("rollout_step_seconds", "Duration of one engine step", STEP_BUCKETS, s.steps,
                         s.step_seconds)
        yield CounterMetricFamily("rollout_verify_steps", "Steps that committed tokens to finished samples, "
                                  "summed over samples (tokens / verify steps = mean acceptance)",
                                  value=s.verify_steps)
        yield _histogram("rollout_tokens_per_verify_step", "Finished samples by their mean tokens committed per "
                         "verify step (1 without speculative decoding)", ACCEPT_BUCKETS, s.acceptance,
                         s.acceptance_sum)
        yield _draft_tokens(s)
        yield CounterMetricFamily("rollout_mask_bytes", "Bytes of sampling masks of finished samples",
                                  value=s.mask_bytes)
        yield CounterMetricFamily("rollout_weight_updates", "Weight updates applied", value=s.policy_version)
        yield GaugeMetricFamily("rollout_policy_version", "Version of the weights now serving",
                                value=s.policy_version)
        yield CounterMetricFamily("rollout_preemptions", "Sequences preempted for KV blocks (recomputed later)",
                                  value=s.preemptions)


def _draft_tokens(s: StatsSnapshot) -> CounterMetricFamily:
    """Draft tokens by proposer, policy version and outcome (accepted / proposed = acceptance)."""
    family = CounterMetricFamily("rollout_draft_tokens", "Draft tokens verified, by proposer, policy version and "
                                 "outcome (proposed, accepted)", labels=["proposer", "policy_version", "outcome"])
    for (proposer, version), (proposed, accepted) in sorted(s.drafts.items()):
        family.add_metric([proposer, str(version), "proposed"], proposed)
        family.add_metric([proposer, str(version), "accepted"], accepted)
    return family


def _histogram(name: str, documentation: str, bounds: tuple, counts: list[int], total: float):
    """Per-bucket counts (the last one +Inf) -> a histogram family with cumulative buckets."""
    cumulative, running = [], 0
    for bound, n in zip((*(str(float(b)) for b in bounds), "+Inf"), counts):
        running += n
        cumulative.append((bound, running))
    return HistogramMetricFamily(name, documentation, buckets=cumulative, sum_value=total)


class RequestCounter(grpc.aio.ServerInterceptor):
    """Counts every Rollout RPC by method and status code as it ends."""

    def __init__(self, metrics: Metrics):
        self.counter = metrics.requests

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(RPC_PREFIX):
            return handler
        rpc = details.method[len(RPC_PREFIX) :]
        kind = ("stream" if handler.request_streaming else "unary") + "_" + (
            "stream" if handler.response_streaming else "unary")
        behaviour = getattr(handler, kind)
        counted = _counted_stream if inspect.isasyncgenfunction(behaviour) else _counted_unary
        return handler._replace(**{kind: counted(behaviour, self.counter.labels, rpc)})


def _counted_unary(behaviour, labels, rpc: str):
    async def handle(request, context):
        with _outcome(labels, rpc, context):
            return await behaviour(request, context)

    return handle


def _counted_stream(behaviour, labels, rpc: str):
    async def handle(request, context):
        with _outcome(labels, rpc, context):
            async for response in behaviour(request, context):
                yield response

    return handle


@contextlib.contextmanager
def _outcome(labels, rpc: str, context: grpc.aio.ServicerContext) -> Iterator[None]:
    """Counts one call of `rpc` by the status it ended with (CANCELLED when the client went away,
    UNKNOWN when the handler raised something else)."""
    code = "UNKNOWN"
    try:
        yield
        code = _code(context)
    except asyncio.CancelledError:
        code = "CANCELLED"
        raise
    except grpc.aio.AbortError:
        code = _code(context)
        raise
    finally:
        labels(rpc, code).inc()


def _code(context: grpc.aio.ServicerContext) -> str:
    code = context.code()
    return "OK" if code is None else code.name


def serve_metrics(metrics: Metrics, host: str, port: int) -> tuple[Callable[[], None], str]:
    """Starts the /metrics endpoint; returns (stop, "http://HOST:PORT/metrics")."""
    httpd, thread = start_http_server(port, addr=host, registry=metrics.registry)
    shown = f"[{host}]" if ":" in host else host

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)

    return stop, f"http://{shown}:{httpd.server_port}/metrics"
