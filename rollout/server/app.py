"""Assembles and runs a rollout server: the engine loop (a thread here, or a child process), the
Rollout service, gRPC health and server reflection on one grpc.aio server.

`serve` is `rollout serve`: it prints `rollout serving on HOST:PORT` once the port is bound and
the engine is built, then runs until SIGTERM or SIGINT, when it reports NOT_SERVING, refuses new
RPCs, lets in-flight requests finish (up to `drain_seconds`) and returns 0. `BackgroundServer`
runs the same server on a private event loop in a thread, for benchmarks, notebooks and tests.
"""

from __future__ import annotations

import asyncio
import functools
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rollout.errors import InvalidArgument
from rollout.proto.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rollout.server.engine_process import EngineProcess
from rollout.server.logs import log_event
from rollout.server.loop import EngineLoop
from rollout.server.service import FlushPolicy, Identity, RolloutService
from rollout.server.weight_service import weight_method_handlers

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name
MAX_MESSAGE_BYTES = 1 << 30


@dataclass(frozen=True)
class ServeConfig:
    """Front-end settings of `rollout serve` (the engine has its own EngineConfig)."""

    host: str = "127.0.0.1"
    port: int = 0
    drain_seconds: float = 300.0
    flush: FlushPolicy = field(default_factory=FlushPolicy)
    # the engine in a child process (EngineProcess; the factory must then be picklable) rather than
    # a thread of this one (EngineLoop): `rollout serve` does, see rollout.server.engine_process
    engine_process: bool = False
    # keep the weight arena's pages between updates (faster uploads; it stays bounded by the model's
    # size) instead of giving them back after each (rollout.server.arena)
    keep_weight_buffers: bool = False

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise InvalidArgument("port", f"must be in [0, 65535] (0 = pick a free one), got {self.port}")
        if not self.drain_seconds >= 0:
            raise InvalidArgument("drain_seconds", f"must be >= 0, got {self.drain_seconds}")

    def address(self, port: int) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{port}"


@dataclass
class RunningServer:
    """A started server. `address` is HOST:PORT with the bound port."""

    server: grpc.aio.Server
    engine_loop: EngineLoop | EngineProcess
    health: health.aio.HealthServicer
    address: str

    async def stop(self, grace: float | None) -> None:
        """NOT_SERVING, refuse new RPCs, wait up to `grace` s for running ones, stop the engine."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        await self.engine_loop.stop()


async def start_server(engine_factory: Callable[[], Any], config: ServeConfig) -> RunningServer:
    """Builds the engine (on its own thread or in its own process), binds the port and starts serving."""
    loop_type = EngineProcess if config.engine_process else EngineLoop
    engine_loop = loop_type(engine_factory, asyncio.get_running_loop())
    await engine_loop.start()
    identity = await engine_loop.call(engine_identity)
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.max_send_message_length", -1)]
    server = grpc.aio.server(options=options)
    service = RolloutService(engine_loop, identity, config.flush)
    service.weights.give_back = not config.keep_weight_buffers
    rollout_pb2_grpc.add_RolloutServicer_to_server(service, server)
    server.add_registered_method_handlers(SERVICE_NAME, weight_method_handlers(service))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service.memory.on_change = functools.partial(_memory_health, health_servicer)
    if isinstance(engine_loop, EngineProcess):  # an engine process that dies: NOT_SERVING from then on
        engine_loop.on_death = lambda: asyncio.ensure_future(_not_serving(health_servicer))
    reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(config.address(config.port))
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    address = config.address(port)
    log_event("server_started", address=address, model=identity.model, spec=identity.spec_method)
    return RunningServer(server, engine_loop, health_servicer, address)


async def serve(engine_factory: Callable[[], Any], config: ServeConfig) -> int:
    """`rollout serve`: runs until SIGTERM/SIGINT, drains, returns the exit status (0)."""
    running = await start_server(engine_factory, config)
    print(f"rollout serving on {running.address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log_event("draining", requests=running.engine_loop.num_requests(), grace_s=config.drain_seconds)
    await running.stop(config.drain_seconds)
    log_event("server_stopped")
    return 0


async def _memory_health(health_servicer: health.aio.HealthServicer, released: bool) -> None:
    """The Rollout service is NOT_SERVING while its device memory is released (the server is up)."""
    status = health_pb2.HealthCheckResponse.NOT_SERVING if released else health_pb2.HealthCheckResponse.SERVING
    await health_servicer.set(SERVICE_NAME, status)


async def _not_serving(health_servicer: health.aio.HealthServicer) -> None:
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


def engine_identity(engine) -> Identity:
    """The names every streamed batch carries (a module-level function: it may run in the engine's
    process)."""
    return Identity(engine.model_name, engine.drafter_name, str(engine.info()["spec_method"]))


class BackgroundServer:
    """A server on a private event loop in a daemon thread; a context manager.

    with BackgroundServer(lambda: LLMEngine(EngineConfig())) as server:
        client = RolloutClient(server.address)
    """

    def __init__(self, engine_factory: Callable[[], Any], config: ServeConfig = ServeConfig()):
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
