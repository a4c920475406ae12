"""Assembles and runs a rollout server: the engine loop (a thread here, or a child process), the
Rollout service, gRPC health (with the liveness watchdog) and server reflection on one grpc.aio
server.

`serve` is `rollout serve`: it binds its port for itself alone (a port another process listens on
is refused, naming it, before the engine is built), prints `rollout serving on HOST:PORT` once the
engine is built (after `rollout metrics on URL` when its metrics endpoint is on, see
rollout.server.metrics), then runs until SIGTERM or SIGINT (handled from the start), when it reports
NOT_SERVING, refuses new RPCs, lets in-flight requests finish (up to `drain_seconds`; then they
are cancelled) and returns 0. A second signal during the drain cancels the in-flight requests at
once and returns 1. `BackgroundServer` runs the same server on a private event loop in a thread,
for benchmarks, notebooks and tests.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rollout.errors import InvalidArgument
from rollout.server.admission import Admission, engine_prompt_setup
from rollout.server.config import ServeConfig
from rollout.server.engine_process import EngineProcess
from rollout.server.liveness import Health, Watchdog
from rollout.server.logs import log_event
from rollout.server.loop import EngineLoop
from rollout.server.metrics import Metrics, RequestCounter, serve_metrics
from rollout.server.service import Identity, RolloutService
from rollout.server.stats_log import log_stats
from rollout.server.weight_port import WeightPort
from rollout.server.wire import SERVICE_NAME, add_rollout_service


@dataclass
class RunningServer:
    """A started server. `address` is HOST:PORT with the bound port; `metrics_address` the URL of
    its Prometheus endpoint ("" without --metrics-port)."""

    server: grpc.aio.Server
    engine_loop: EngineLoop | EngineProcess
    health: Health
    address: str
    metrics: Metrics
    metrics_address: str = ""
    watchdog: asyncio.Task | None = None
    closers: list[Callable[[], Any]] = field(default_factory=list)  # the metrics endpoint, the stats log
    weight_port: WeightPort | None = None

    async def stop(self, grace: float | None) -> None:
        """NOT_SERVING, refuse new RPCs, wait up to `grace` s for running ones, stop the engine."""
        await self.health.shutting_down()
        if self.watchdog is not None:
            self.watchdog.cancel()
        await self._stop_ports(grace)
        await self.engine_loop.stop()
        for close in self.closers:
            close()

    async def stop_now(self) -> None:
        """Cancels the RPCs in flight on both ports (a `stop` under way then stops the engine)."""
        await self._stop_ports(None)

    async def _stop_ports(self, grace: float | None) -> None:
        """Both ports stop at once, their calls given `grace` s (the weight port's calls finish on
        this loop: its stop is waited for off it)."""
        stops = [self.server.stop(grace)]
        if self.weight_port is not None:
            stops.append(asyncio.to_thread(self.weight_port.stop, grace))
        await asyncio.gather(*stops)


async def start_server(engine_factory: Callable[[], Any], config: ServeConfig) -> RunningServer:
    """Binds the port, builds the engine (on its own thread or in its own process) and starts serving."""
    metrics = Metrics(lambda: 0)  # requests counted once the engine loop exists (_start)
    server = grpc.aio.server(options=config.grpc_options(), interceptors=[RequestCounter(metrics)])
    try:
        port = bind(server, config)
        log_event("server_starting", address=config.address(port), engine_process=config.engine_process)
        return await _start(server, port, engine_factory, config, metrics)
    except BaseException:
        await server.stop(None)
        raise


def bind(server: grpc.aio.Server | grpc.Server, config: ServeConfig, field_name: str = "port") -> int:
    """Listens on the configured host and port (`field_name`: "port" or "weight_port"), alone;
    InvalidArgument naming the field when another socket listens there (checked first with a
    socket of our own, so that grpc logs nothing)."""
    port = getattr(config, field_name)
    address = config.address(port)
    if port and _port_taken(config.host, port):
        raise InvalidArgument(field_name, f"{address} is already in use (another server listens there)")
    try:
        return server.add_insecure_port(address)
    except RuntimeError:
        raise InvalidArgument(field_name, f"cannot listen on {address} (in use, or not an address of this "
                                          f"host)") from None


def _port_taken(host: str, port: int) -> bool:
    """Whether binding host:port fails with EADDRINUSE (SO_REUSEADDR set, as grpc sets it)."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return False  # grpc will say what is wrong with the host
    for family, kind, proto, _, sockaddr in addresses:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
    return False


async def _start(server: grpc.aio.Server, port: int, engine_factory: Callable[[], Any],
                 config: ServeConfig, metrics: Metrics) -> RunningServer:
    loop_type = EngineProcess if config.engine_process else EngineLoop
    engine_loop = loop_type(engine_factory, asyncio.get_running_loop())
    metrics.running_requests = engine_loop.num_requests
    engine_loop.on_stats = metrics.update
    await engine_loop.start()
    try:
        return await _start_serving(server, port, engine_loop, config, metrics)
    except BaseException:
        await engine_loop.stop()
        raise


async def _start_serving(server: grpc.aio.Server, port: int, engine_loop: EngineLoop | EngineProcess,
                         config: ServeConfig, metrics: Metrics) -> RunningServer:
    identity = Identity(*await engine_loop.call(engine_names), instance_id=uuid.uuid4().hex)
    admission = Admission(*await engine_loop.call(engine_prompt_setup))
    service = RolloutService(engine_loop, identity, admission, config.flush)
    service.weights.give_back = not config.keep_weight_buffers
    add_rollout_service(service, server)
    health_state = Health(health.aio.HealthServicer())
    health_pb2_grpc.add_HealthServicer_to_server(health_state.servicer, server)
    service.memory.on_change = health_state.memory_released
    if isinstance(engine_loop, EngineProcess):  # an engine process that dies: NOT_SERVING from then on
        engine_loop.on_death = lambda: asyncio.ensure_future(health_state.engine_died())
    reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    await server.start()
    weight_port = None
    if config.weight_port >= 0:  # (started last: nothing to stop if it cannot listen)
        weight_port = WeightPort(service.weights, asyncio.get_running_loop(), config.grpc_options(), metrics.requests)
        service.weight_port = bind(weight_port.server, config, "weight_port")
        weight_port.server.start()
    await health_state.serving(True)
    address = config.address(port)
    running = RunningServer(server, engine_loop, health_state, address, metrics, weight_port=weight_port)
    if config.liveness_seconds > 0:
        running.watchdog = asyncio.ensure_future(Watchdog(engine_loop, health_state, config.liveness_seconds).run())
    try:
        _observe(running, config)
    except OSError as exc:
        await running.stop(0)
        raise InvalidArgument("metrics_port", f"cannot listen on {config.metrics_host}:{config.metrics_port}: "
                                              f"{exc.strerror or exc}") from exc
    log_event("server_started", address=address, model=identity.model, spec=identity.spec_method,
              instance_id=identity.instance_id, metrics=running.metrics_address or None,
              weight_port=service.weight_port or None)
    return running


def _observe(running: RunningServer, config: ServeConfig) -> None:
    """The metrics endpoint (--metrics-port) and the periodic stats line (--stats-interval)."""
    if config.metrics_port is not None:
        stop, running.metrics_address = serve_metrics(running.metrics, config.metrics_host, config.metrics_port)
        running.closers.append(stop)
    if config.stats_interval > 0:
        task = asyncio.ensure_future(log_stats(running.metrics, config.stats_interval))
        running.closers.append(task.cancel)


async def serve(engine_factory: Callable[[], Any], config: ServeConfig) -> int:
    """`rollout serve`: runs until SIGTERM/SIGINT, drains, returns the exit status (0; 1 when a
    second signal cut the drain short)."""
    signals = _Signals(asyncio.get_running_loop())  # before anything: a signal never kills it outright
    running = await start_server(engine_factory, config)
    if running.metrics_address:
        print(f"rollout metrics on {running.metrics_address}", flush=True)
    print(f"rollout serving on {running.address}", flush=True)
    await signals.first.wait()
    log_event("draining", requests=running.engine_loop.num_requests(), grace_s=config.drain_seconds)
    drain = asyncio.ensure_future(running.stop(config.drain_seconds))
    second = asyncio.ensure_future(signals.second.wait())
    await asyncio.wait([drain, second], return_when=asyncio.FIRST_COMPLETED)
    cut_short = not drain.done()
    second.cancel()
    if cut_short:
        log_event("drain_cut_short", logging.WARNING, requests=running.engine_loop.num_requests())
        await running.stop_now()  # cancels the in-flight RPCs; the drain then stops the engine
    await drain
    log_event("server_stopped")
    return 1 if cut_short else 0


class _Signals:
    """SIGTERM / SIGINT on the event loop: the first sets `first` (drain), the next `second` (stop now)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.first, self.second = asyncio.Event(), asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._received)

    def _received(self) -> None:
        (self.second if self.first.is_set() else self.first).set()


def engine_names(engine) -> tuple[str, str, str, int]:
    """Model, drafter, spec method and vocabulary size, which every streamed batch carries (a
    module-level function: it may run in the engine's process)."""
    return engine.model_name, engine.drafter_name, str(engine.info()["spec_method"]), engine.vocab_size


BACKGROUND = ServeConfig(port=0, engine_process=False, stats_interval=0)  # BackgroundServer's default


class BackgroundServer:
    """A server on a private event loop in a daemon thread; a context manager.

    with BackgroundServer(lambda: rollout.build_engine(EngineConfig())) as server:
        client = RolloutClient(server.address)
    """

    def __init__(self, engine_factory: Callable[[], Any], config: ServeConfig = BACKGROUND):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-server", daemon=True)
        self._factory, self._config = engine_factory, config
        self.running: RunningServer | None = None

    @property
    def address(self) -> str:
        return self.running.address

    def run(self, coro_fn: Callable[[RunningServer], Any]) -> Any:
        """Runs coro_fn(running) on the server's loop and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coro_fn(self.running), self._loop).result()

    def engine_call(self, fn: Callable[[Any], Any]) -> Any:
        """Runs fn(engine) on the engine thread, e.g. `lambda e: e.kv_blocks()` (in an engine
        process: a picklable function)."""

        async def call(running: RunningServer):
            return await running.engine_loop.call(fn)

        return self.run(call)

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(start_server(self._factory, self._config), self._loop)
        try:
            self.running = started.result()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, grace: float | None = 5.0) -> None:
        if self.running is not None:
            self.run(lambda running: running.stop(grace))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self.running = None  # grpc.aio shuts down with the last server: only once its loop is idle
        self._loop.close()
