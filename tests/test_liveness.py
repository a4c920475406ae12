"""The liveness watchdog and the health state on their own, with a scripted engine and clock: no
progress while requests are in flight for longer than the bound turns health NOT_SERVING, progress
turns it SERVING again, an idle engine is never stalled, a dead engine stays NOT_SERVING, and
released memory takes the Rollout service alone out. (A real stopped engine process:
tests/test_server_process.py.)"""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2

from rollout.server.liveness import Health, Watchdog

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class Engine:
    def __init__(self):
        self.ticks, self.requests = 0, 0

    def progress(self) -> int:
        return self.ticks

    def num_requests(self) -> int:
        return self.requests


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Servicer:
    def __init__(self):
        self.status: dict[str, int] = {}

    async def set(self, name: str, status: int) -> None:
        self.status[name] = status


def test_no_progress_with_requests_in_flight_is_a_stall_and_progress_ends_it():
    engine, clock = Engine(), Clock()
    watchdog = Watchdog(engine, Health(Servicer()), bound_s=5.0, clock=clock)
    clock.now += 60
    assert watchdog.check() is None  # idle: nothing waits on the engine
    engine.requests = 3
    clock.now += 4
    assert watchdog.check() is None
    engine.ticks += 1  # it moves (seen at this look)
    clock.now += 4
    assert watchdog.check() is None
    clock.now += 4.5
    assert watchdog.check() is None
    clock.now += 1  # 5.5 s since progress was last seen, requests in flight
    assert watchdog.check() is False
    clock.now += 30
    assert watchdog.check() is None  # still stalled: said once
    engine.ticks += 1
    assert watchdog.check() is True
    assert watchdog.check() is None
    clock.now += 6
    assert watchdog.check() is False
    engine.requests = 0  # nothing waits any more (e.g. the engine process died and failed them)
    assert watchdog.check() is True


def test_health_names_both_services_and_a_dead_engine_stays_not_serving():
    async def main():
        servicer = Servicer()
        health = Health(servicer)
        await health.serving(True)
        assert servicer.status == {"": SERVING, "rollout.v1.Rollout": SERVING}
        await health.serving(False)
        assert set(servicer.status.values()) == {NOT_SERVING}
        await health.engine_died()
        await health.serving(True)
        assert set(servicer.status.values()) == {NOT_SERVING}

    asyncio.run(main())


def test_the_watchdog_sets_health_from_its_loop():
    async def main():
        engine, servicer = Engine(), Servicer()
        engine.requests = 1
        task = asyncio.ensure_future(Watchdog(engine, Health(servicer), bound_s=0.04).run())
        for _ in range(200):
            await asyncio.sleep(0.01)
            if servicer.status.get("") == NOT_SERVING:
                break
        assert servicer.status == {"": NOT_SERVING, "rollout.v1.Rollout": NOT_SERVING}
        engine.ticks += 1
        for _ in range(200):
            await asyncio.sleep(0.01)
            if servicer.status.get("") == SERVING:
                break
        assert servicer.status[""] == SERVING
        task.cancel()

    asyncio.run(main())


def test_released_memory_takes_the_rollout_service_alone_out_and_held_requests_are_no_stall():
    """ReleaseMemory: the Rollout service NOT_SERVING, the server SERVING; requests held for the
    resume do not make the idle engine a stalled one; a stall still shows after the resume."""

    async def main():
        engine, clock, servicer = Engine(), Clock(), Servicer()
        health = Health(servicer)
        watchdog = Watchdog(engine, health, bound_s=5.0, clock=clock)
        await health.memory_released(True)
        assert servicer.status == {"": SERVING, "rollout.v1.Rollout": NOT_SERVING}
        engine.requests = 2  # held until the resume; the engine loop waits idle
        clock.now += 60
        assert watchdog.check() is None
        await health.serving(True)  # (the watchdog's recovery does not put it back in)
        assert servicer.status["rollout.v1.Rollout"] == NOT_SERVING
        await health.memory_released(False)
        assert servicer.status == {"": SERVING, "rollout.v1.Rollout": SERVING}
        clock.now += 6
        assert watchdog.check() is False

    asyncio.run(main())
