"""What gRPC health says about the server, and the watchdog that notices a stalled engine.

`Health` is SERVING from the start; NOT_SERVING for good once the engine process has died or the
server drains; NOT_SERVING while the engine is stalled; and, for the Rollout service alone, while
the engine's device memory is released for a trainer (ReleaseMemory). `Watchdog` decides the last one: when
requests are in flight but the engine loop has not gone round (no step, no command) for longer
than `bound_s` seconds (a frozen or wedged engine, e.g. a stopped engine process), the server is
stalled; as soon as the loop moves again it serves again. A fleet (trainer_client.fleet) routes
only to SERVING servers. The first steps of a fresh engine may compile kernels or capture CUDA
graphs: the bound must exceed the longest such step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from grpc_health.v1 import health, health_pb2

from rollout.server.logs import log_event
from rollout.server.wire import SERVICE_NAME


class Health:
    """The health servicer's status for the whole server ("") and the Rollout service: both
    NOT_SERVING once the engine died and while it is stalled; the Rollout service alone NOT_SERVING
    while the engine's device memory is released (ReleaseMemory: the server is up, its engine is
    not generating)."""

    def __init__(self, servicer: health.aio.HealthServicer):
        self.servicer = servicer
        self.dead = False
        self.stalled = False
        self.released = False

    async def serving(self, serving: bool) -> None:
        self.stalled = not serving
        await self._publish()

    async def memory_released(self, released: bool) -> None:
        self.released = released
        await self._publish()

    async def engine_died(self) -> None:
        self.dead = True
        await self._publish()

    async def _publish(self) -> None:
        up = not (self.dead or self.stalled)
        await self.servicer.set("", _status(up))
        await self.servicer.set(SERVICE_NAME, _status(up and not self.released))

    async def shutting_down(self) -> None:
        """NOT_SERVING, and every later change ignored (grpc's graceful shutdown)."""
        await self.servicer.enter_graceful_shutdown()


def _status(serving: bool) -> int:
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING


class EngineActivity(Protocol):
    def progress(self) -> int: ...  # ticks of the engine loop so far
    def num_requests(self) -> int: ...  # requests in flight


class Watchdog:
    """Turns health NOT_SERVING when requests wait on an engine loop that has stopped moving for
    more than `bound_s`, and SERVING again once it moves (see the module docstring)."""

    def __init__(self, engine: EngineActivity, health_state: Health, bound_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.engine, self.health, self.bound_s, self.clock = engine, health_state, bound_s, clock
        self.last_progress = engine.progress()
        self.since = clock()
        self.stalled = False

    def check(self) -> bool | None:
        """One look: False when the engine has just been found stalled, True when a stalled engine
        has just moved again, None when nothing changed."""
        now, progress = self.clock(), self.engine.progress()
        # (requests held while the memory is released wait for ResumeMemory, not for a stalled engine)
        if progress != self.last_progress or not self.engine.num_requests() or self.health.released:
            self.last_progress, self.since = progress, now
            if self.stalled:
                self.stalled = False
                log_event("engine_progressing", requests=self.engine.num_requests())
                return True
            return None
        if not self.stalled and now - self.since > self.bound_s:
            self.stalled = True
            log_event("engine_stalled", logging.WARNING, seconds=round(now - self.since, 3),
                      requests=self.engine.num_requests())
            return False
        return None

    async def run(self) -> None:
        """Looks every quarter of the bound (at most every second) until cancelled."""
        period = min(self.bound_s / 4, 1.0)
        while True:
            await asyncio.sleep(period)
            change = self.check()
            if change is not None:
                await self.health.serving(change)
