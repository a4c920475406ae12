"""The weight RPCs on the server's side: the gRPC handlers of `RolloutService` delegate here.

UpdateWeights reads its stream as `WirePiece`s (the registered deserializer `decode_chunk`, see
rollout.server.wire), writes them into the weight arena while checking each tensor
(rollout.server.weights), then hands the engine a small job that stages, checks, drains and
swaps (rollout.server.weight_jobs). One upload holds the arena at a time; its pages are given
back when the engine is done with them (or kept, `give_back=False`). A caller that goes away
before its update applied has it withdrawn; a repeat of an applied update id returns at its
first chunk without taking its bytes. An update may arrive over several calls at once
(WeightChunk.streams, docs/wire.md): they share one upload and one answer (`_update_part`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import time
import uuid
from collections.abc import AsyncIterator

from rollout.engine.weight_specs import WeightSpecs
from rollout.errors import FailedPrecondition, InvalidArgument
from rollout.proto.rollout.v1 import rollout_pb2 as pb
from rollout.server.broadcast_weights import BroadcastJob, BroadcastMeta, JoinGroup, LeaveGroup
from rollout.server.convert import MAX_WEIGHT_STREAMS
from rollout.server.logs import log_event
from rollout.server.shared_weights import shared_job
from rollout.server.weight_jobs import WeightsApplied
from rollout.server.weights import WeightUpload
from rollout.weight_wire import WirePiece


def weight_specs(engine) -> WeightSpecs:
    """(module level: it may run in the engine's process)"""
    return engine.weights.specs()


def applied_version(update_id: str, engine) -> int | None:
    return engine.weights.applied_version(update_id)


def response(applied: WeightsApplied) -> pb.UpdateWeightsResponse:
    return pb.UpdateWeightsResponse(
        policy_version=applied.policy_version, num_tensors=applied.num_tensors,
        num_draft_tensors=applied.num_draft_tensors, stage_seconds=applied.stage_seconds,
        pause_seconds=applied.pause_seconds, repeated=applied.repeated,
    )  # fmt: skip


class WeightService:
    """The weight RPCs of one server (see the module docstring)."""

    def __init__(self, engine_loop, give_back: bool = True):
        self.engine_loop = engine_loop
        self.give_back = give_back
        self._specs: WeightSpecs | None = None
        self._arena_busy = False
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-weights-write")
        self._parts: dict[str, _Parts] = {}  # updates arriving over several calls, by update_id

    async def specs(self) -> WeightSpecs:
        if self._specs is None:
            self._specs = await self.engine_loop.call(weight_specs)
        return self._specs

    async def update(self, pieces: AsyncIterator[WirePiece]) -> pb.UpdateWeightsResponse:
        """UpdateWeights: the stream into the arena, then the engine's job; one of several calls
        of an update (WeightChunk.streams > 1) joins the others (`_update_part`)."""
        pieces = aiter(pieces)
        first = await anext(pieces, None)
        pieces = _prepended(first, pieces)
        if first is not None and first.streams > 1:
            return response(await self._update_part(first, pieces))
        self._take_arena()
        arena = self.engine_loop.weight_arena
        handed_over = False
        try:
            upload = await self._open_upload()
            repeated = await self._receive(pieces, upload)
            if repeated is not None:
                return response(repeated)
            job = self._finish(upload)  # (refuses a short tensor: the arena is released below)
            handed_over = True  # the arena is released once the engine is done with it
            return response(await self._run(job, lambda _: self._release(arena)))
        finally:
            if not handed_over:
                self._release(arena)

    def _take_arena(self) -> None:
        if self._arena_busy:
            raise FailedPrecondition("weights: another weight upload is in progress; retry when it has applied")
        self._arena_busy = True

    async def _open_upload(self) -> WeightUpload:
        specs = await self.specs()
        arena = self.engine_loop.weight_arena
        arena.reserve(specs.budget())
        return WeightUpload(specs, arena, uuid.uuid4().hex)

    def _finish(self, upload: WeightUpload):
        """The engine's job of a complete upload (InvalidArgument if a tensor or file is short)."""
        job = upload.finish(keep_locked=not self.give_back)
        seconds = time.perf_counter() - upload.started
        log_event("weights_received", tensors=len(job.tensors), bytes=upload.bytes, seconds=round(seconds, 3),
                  gb_per_s=round(upload.bytes / max(seconds, 1e-9) / 1e9, 3))
        return job

    async def _update_part(self, first: WirePiece, pieces: AsyncIterator[WirePiece]) -> WeightsApplied:
        """One of the `first.streams` calls of an update: the first to arrive takes the arena and opens
        the upload, each writes its pieces into it, the last to finish hands the job to the engine,
        and every call answers with the update's result. A call that fails (or is cancelled) fails
        the update: nothing applies, and the arena is released once no call writes into it."""
        parts = self._join(first)
        try:
            opened = await asyncio.shield(parts.opened)
            if isinstance(opened, WeightsApplied):  # a repeat of an applied update id
                return opened
            await self._receive(pieces, opened)
            parts.received += 1
            if parts.received == parts.streams and not parts.answer.done():
                parts.run = asyncio.ensure_future(self._run_parts(parts, opened))
                parts.run.add_done_callback(_retrieved)
            return await asyncio.shield(parts.answer)
        except BaseException as exc:
            parts.fail(exc)
            raise
        finally:
            parts.active -= 1
            if parts.active == 0 and parts.run is None:
                self._parts.pop(parts.update_id, None)
                self._release_after(parts.opened)

    def _release_after(self, opened: asyncio.Future) -> None:
        """Releases the arena of an update that failed, once its opening (which reserves the arena)
        can no longer run: released after it, never before (its pages would stay resident)."""
        arena = self.engine_loop.weight_arena
        if opened.done():
            self._release(arena)
        else:
            opened.cancel()
            opened.add_done_callback(lambda _: self._release(arena))

    def _join(self, first: WirePiece) -> _Parts:
        """The update `first` belongs to (opened by its first call), joined by this call."""
        if not first.update_id:
            raise InvalidArgument("update_id", f"an update sent over {first.streams} streams needs an update_id")
        if first.streams > MAX_WEIGHT_STREAMS:
            raise InvalidArgument("streams", f"an update may come over at most {MAX_WEIGHT_STREAMS} calls, got "
                                             f"{first.streams}")
        parts = self._parts.get(first.update_id)
        if parts is None:
            self._take_arena()
            parts = self._parts[first.update_id] = _Parts(first.update_id, first.streams)
            parts.opened = asyncio.ensure_future(self._open_part(first.update_id))
            parts.opened.add_done_callback(_retrieved)
        elif first.streams != parts.streams:
            raise InvalidArgument("streams", f"update {first.update_id!r}: this call says {first.streams} streams, "
                                             f"an earlier one {parts.streams}")
        if parts.joined == parts.streams:
            raise InvalidArgument("streams", f"update {first.update_id!r}: more calls than its {parts.streams} streams")
        parts.joined += 1
        parts.active += 1
        return parts

    async def _open_part(self, update_id: str) -> WeightUpload | WeightsApplied:
        repeated = await self._repeat(update_id)
        if repeated is not None:
            return repeated
        upload = await self._open_upload()
        upload.update_id = update_id
        return upload

    async def _run_parts(self, parts: _Parts, upload: WeightUpload) -> None:
        """The engine's job of an update whose calls all sent everything; its answer goes to every call."""
        arena = self.engine_loop.weight_arena
        try:
            try:
                job = self._finish(upload)
            except BaseException:
                self._release(arena)  # (every call has sent all: nothing writes into it any more)
                raise
            applied = await self._run(job, lambda _: self._release(arena))
            if not parts.answer.done():
                parts.answer.set_result(applied)
        except BaseException as exc:
            parts.fail(exc)
            raise
        finally:
            self._parts.pop(parts.update_id, None)

    async def update_shared(self, request: pb.SharedWeights) -> pb.UpdateWeightsResponse:
        """UpdateWeightsShared: checked here, mapped and staged by the engine (rollout.server.shared_weights)."""
        job = shared_job(request, await self.specs(), uuid.uuid4().hex)
        return response(await self._repeat(job.update_id) or await self._run(job))

    async def join_group(self, request: pb.JoinWeightGroupRequest) -> None:
        """JoinWeightGroup: returns once every member has joined (rollout.server.broadcast_weights)."""
        await self.engine_loop.aside(JoinGroup(request.group, request.init_method, request.world_size, request.rank,
                                               request.backend or "gloo", request.timeout_s or 300.0))

    async def leave_group(self, request: pb.LeaveWeightGroupRequest) -> None:
        await self.engine_loop.aside(LeaveGroup(request.group))

    async def update_broadcast(self, request: pb.BroadcastWeights) -> pb.UpdateWeightsResponse:
        """UpdateWeightsBroadcast. No early answer for a repeated id: the member must take part in
        the group's vote and broadcasts like the others (the engine then applies nothing)."""
        metas = [BroadcastMeta(m.draft, m.name, m.dtype, tuple(m.shape)) for m in request.tensors]
        job = BroadcastJob(uuid.uuid4().hex, request.update_id, request.group, metas, request.bucket_bytes)
        return response(await self._run(job))

    async def _repeat(self, update_id: str) -> WeightsApplied | None:
        """The answer to a repeat of an applied update id, or None."""
        version = await self.engine_loop.call(functools.partial(applied_version, update_id)) if update_id else None
        return None if version is None else WeightsApplied(version, repeated=True)

    async def _run(self, job, done=None) -> WeightsApplied:
        """The engine's answer to `job` (`done(call)` runs once the engine is done with it); if this
        handler is cancelled first (the caller went away), the update is withdrawn unless it has
        applied."""
        engine_call = asyncio.ensure_future(self.engine_loop.update_weights(job))
        for callback in (done, _retrieved):
            if callback is not None:
                engine_call.add_done_callback(callback)
        try:
            applied = await asyncio.shield(engine_call)
        except asyncio.CancelledError:
            self.engine_loop.withdraw_weights(job.token)
            raise
        log_event("weights_applied", policy_version=applied.policy_version, repeated=applied.repeated,
                  stage_s=round(applied.stage_seconds, 3), pause_s=round(applied.pause_seconds, 4))
        return applied

    async def _receive(self, pieces: AsyncIterator[WirePiece], upload: WeightUpload) -> WeightsApplied | None:
        """Writes the stream into the arena (on the writer thread, while the next pieces are read);
        a repeat of an applied update id: its answer, at the first chunk that names it."""
        writes = _Pipeline(self._writer)
        try:
            async for piece in pieces:
                if piece.update_id and not upload.update_id:
                    repeated = await self._repeat(piece.update_id)
                    if repeated is not None:
                        return repeated
                    upload.update_id = piece.update_id
                await writes.put(upload.add, piece)
            await writes.drain()
        finally:
            await writes.settle()  # nothing writes into the arena once this returns
        return None

    def _release(self, arena) -> None:
        arena.release(give_back=self.give_back)
        self._arena_busy = False


class _Parts:
    """An update arriving over several UpdateWeights calls (WeightChunk.streams)."""

    def __init__(self, update_id: str, streams: int):
        self.update_id, self.streams = update_id, streams
        self.joined = self.active = self.received = 0  # calls that joined / are still running / sent all
        self.opened: asyncio.Future  # the upload to write into, or a repeat's answer
        self.answer: asyncio.Future = asyncio.get_running_loop().create_future()  # WeightsApplied, for all
        self.answer.add_done_callback(_retrieved)
        self.run: asyncio.Future | None = None  # the engine's job, once every call has sent all

    def fail(self, exc: BaseException) -> None:
        """Fails the update for every call (a cancelled call withdraws a job already handed over)."""
        if self.run is not None and not self.run.done():
            self.run.cancel()
        if self.answer.done():
            return
        if isinstance(exc, asyncio.CancelledError):
            self.answer.cancel()
        else:
            self.answer.set_exception(exc)


async def _prepended(first: WirePiece | None, rest: AsyncIterator[WirePiece]) -> AsyncIterator[WirePiece]:
    if first is None:
        return
    yield first
    async for piece in rest:
        yield piece


def _retrieved(engine_call: asyncio.Future) -> None:
    """Marks the engine's error as seen: a withdrawn update's error has no one awaiting it."""
    if not engine_call.cancelled():
        engine_call.exception()


class _Pipeline:
    """Calls run in order on one worker thread while the event loop reads the next messages; at
    most WINDOW are outstanding (each holds a received message). The first failure is raised by
    the `put` or `drain` that finds it; `settle` makes sure nothing runs any more."""

    WINDOW = 4

    def __init__(self, executor: concurrent.futures.Executor):
        self._executor = executor
        self._outstanding: collections.deque[concurrent.futures.Future] = collections.deque()

    async def put(self, fn, *args) -> None:
        self._outstanding.append(self._executor.submit(fn, *args))
        while self._outstanding and (self._outstanding[0].done() or len(self._outstanding) > self.WINDOW):
            await self._wait_oldest()

    async def drain(self) -> None:
        while self._outstanding:
            await self._wait_oldest()

    async def _wait_oldest(self) -> None:
        await asyncio.shield(asyncio.wrap_future(self._outstanding[0]))  # (stays listed if this is cancelled)
        self._outstanding.popleft()

    async def settle(self) -> None:
        """Cancels the calls not started and waits for the running one; never raises."""
        running = [f for f in self._outstanding if not f.cancel()]
        self._outstanding.clear()
        if running:
            await asyncio.to_thread(concurrent.futures.wait, running)
