"""ReleaseMemory / ResumeMemory on the server's side: the engine's `release_memory` / `resume_memory`
(rollout.engine.release) called on the engine's thread (in the engine process with `rollout serve`),
its report as a `MemoryState`, and the gRPC health of the Rollout service following it
(NOT_SERVING while released; the server's overall health stays SERVING: rollout.server.liveness)."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

from rollout.engine.release import MemoryReport
from rollout.proto.rollout.v1 import rollout_pb2 as pb
from rollout.server.logs import log_event


def release_memory(weights: bool, hold: bool, engine) -> MemoryReport:
    """(module level: it may run in the engine's process)"""
    return engine.release_memory(weights, hold)


def resume_memory(engine) -> MemoryReport:
    return engine.resume_memory()


class MemoryService:
    """`on_change(released)` is awaited after each change (the server sets the health status)."""

    def __init__(self, engine_loop):
        self.engine_loop = engine_loop
        self.on_change: Callable[[bool], Awaitable[None]] | None = None

    async def release(self, request: pb.ReleaseMemoryRequest) -> pb.MemoryState:
        call = functools.partial(release_memory, request.weights, request.hold_requests)
        return await self._report("memory_released", await self.engine_loop.call(call))

    async def resume(self) -> pb.MemoryState:
        return await self._report("memory_resumed", await self.engine_loop.call(resume_memory))

    async def _report(self, event: str, report: MemoryReport) -> pb.MemoryState:
        log_event(event, bytes=report.bytes, device_free_bytes=report.device_free_bytes,
                  weights_offloaded=report.weights_offloaded, seconds=round(report.seconds, 3))
        if self.on_change is not None:
            await self.on_change(report.released)
        return pb.MemoryState(released=report.released, weights_offloaded=report.weights_offloaded,
                              bytes=report.bytes, device_free_bytes=report.device_free_bytes, seconds=report.seconds)
