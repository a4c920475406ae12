"""The engine loop: the one thread that owns the engine, and the bridge to asyncio.

The engine is single-threaded. Every call on it (add, abort, info, weight updates, step) runs
on this thread (a thread of its own, or, in an engine process, that process's main thread: see
rollout.server.engine_process); the asyncio side submits commands through a queue and gets
results back as asyncio futures. Finished samples are routed to the request's sink, a callable that is also
invoked on the event loop, once per request per step, so the event loop never blocks on the
engine and the engine never waits for a client.

What the engine thread hands back (command results, deliveries) collects in an outbox
(rollout.server.outbox) that goes to the event loop in one `loop.call_soon_threadsafe` per batch
of commands and per step: each wake-up of the loop is a socket write that lets go of the GIL,
and getting it back while the event loop runs costs the engine thread up to the interpreter's
switch interval.

With a draft budget (adaptive speculation), a `spec_budget` line says every SPEC_LOG_SECONDS of
busy time and at the end of each busy period what it chose since the last line (drafts verified per
decode row, probes, acceptance by position and by running request, the step-cost model).

Weight updates follow the engine's drain policy: `update_weights` stages and checks a weight job
on a worker thread while the engine keeps stepping (rollout.server.weight_jobs), then submits it;
the engine applies it at a step boundary once running samples have finished, and the caller's
future resolves with the new `policy_version` after that. `withdraw_weights` drops it until then.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout.errors import FailedPrecondition, Unavailable
from rollout.outputs import SampleOutput
from rollout.server.convert import GenerateCall
from rollout.server.engine_stats import BusyPeriod, EngineStats, StatsSnapshot
from rollout.server.logs import elapsed_ms, log_event
from rollout.server.outbox import Outbox
from rollout.server.weight_jobs import EngineSide, WeightsApplied

SPEC_LOG_SECONDS = 30.0


@dataclass
class Delivery:
    """What a request's sink receives: finished samples, and `done` with the last of them, or
    `error` (the request failed; nothing more follows)."""

    samples: list[SampleOutput]
    done: bool = False
    error: BaseException | None = None


Sink = Callable[[Delivery], None]


@dataclass
class _Route:
    sink: Sink
    remaining: int
    started: float


class EngineLoop:
    """Owns the engine built by `engine_factory` on its own thread (see module docstring)."""

    def __init__(self, engine_factory: Callable[[], Any], loop: asyncio.AbstractEventLoop, thread: bool = True,
                 progress: ctypes.c_int64 | None = None, side: EngineSide | None = None):
        """`thread=False`: no thread of its own; whoever owns the engine calls `run()` (an engine
        process runs it on its main thread, see rollout.server.engine_process). `progress`: the
        counter to tick (an engine process passes one in shared memory). `side`: the weight jobs'
        state of this process (an engine process passes the arena it got from the server)."""
        self._factory = engine_factory
        self._progress = progress if progress is not None else ctypes.c_int64(0)
        self._loop = loop
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # what the engine thread hands back, run on the event loop in order
        self._outbox: Outbox[Callable[[], None]] = Outbox(lambda calls: loop.call_soon_threadsafe(_run_all, calls))
        self._routes: dict[str, _Route] = {}
        self._weight_waiters: list[tuple[str, asyncio.Future, WeightsApplied]] = []
        self.side = side or EngineSide()
        self._stopping = False
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._finished: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self.run, name="rollout-engine", daemon=True) if thread else None
        self._busy_period: BusyPeriod | None = None
        self._spec_log_at = 0.0  # perf_counter time of the next spec_budget line
        self.engine: Any = None
        self.stats = EngineStats()
        # called on the event loop with a StatsSnapshot now and then (rollout.server.engine_stats)
        self.on_stats: Callable[[StatsSnapshot], None] | None = None

    async def start(self) -> None:
        """Builds the engine on the loop thread; raises whatever the factory raised."""
        if self._thread is not None:
            self._thread.start()
        await asyncio.wrap_future(self._ready)

    async def stop(self) -> None:
        """Ends the loop after the commands already queued; running requests are aborted."""
        self._commands.put(None)
        await asyncio.wrap_future(self._finished)

    def call(self, fn: Callable[[Any], Any]) -> asyncio.Future:
        """Runs fn(engine) on the engine thread; the result (or exception) comes back as a future.
        Call it on the event loop. Cancelling the future does not cancel the command."""
        fut = self._loop.create_future()
        if self._finished.done():  # the engine thread has ended: nothing would run it
            fut.set_exception(Unavailable("the engine loop has stopped"))
        else:
            self._commands.put((fn, fut))
        return fut

    async def add(self, call: GenerateCall, sink: Sink) -> None:
        """Admits a request (raises the engine's InvalidArgument / ResourceExhausted)."""
        await self.call(lambda engine: self._add(engine, call, sink))

    def abort(self, request_id: str, reason: str, sink: Sink | None = None) -> asyncio.Future:
        """Aborts a request (enqueued at once; await for the number of aborted samples). Its
        unfinished samples go to its sink with finish_reason "abort". With `sink`, only the
        request admitted with that sink is aborted (a handler cleaning up after itself)."""
        return self.call(lambda engine: self._abort(engine, request_id, reason, sink))

    @property
    def weight_arena(self):
        return self.side.arena

    async def update_weights(self, job) -> WeightsApplied:
        """Stages `job` (`job.stage(engine, side)`) on a worker thread while the engine keeps stepping,
        then submits it; resolves once it is applied (see the module docstring)."""
        start = time.perf_counter()
        stage = await asyncio.to_thread(job.stage, self.engine, self.side)
        summary = WeightsApplied(0, stage.count(False), stage.count(True), time.perf_counter() - start)
        applied = self._loop.create_future()
        try:
            # submitted as a command (refused like any other once the loop has stopped), then awaited
            # until it applies (failed at the stop if it has not by then)
            await self.call(lambda engine: self._update(engine, stage, job, summary, applied))
            return await applied
        finally:
            stage.close()  # applied, refused or withdrawn: nothing reads the stage any more

    def withdraw_weights(self, token: str) -> asyncio.Future:
        """Drops the update staged with `token` unless it has applied (its caller went away)."""
        return self.call(lambda engine: self._withdraw(engine, token))

    async def aside(self, fn: Callable[[Any, EngineSide], Any]) -> Any:
        """fn(engine, side) on a worker thread (weight groups: it may block on other processes)."""
        return await asyncio.to_thread(fn, self.engine, self.side)

    def num_requests(self) -> int:
        return len(self._routes)

    def progress(self) -> int:
        """How many times the engine thread has gone round its loop (commands run, a step taken):
        it stands still while the thread waits idle, or is stuck (rollout.server.liveness)."""
        return self._progress.value

    # -- engine thread -------------------------------------------------------------------------

    def run(self) -> None:
        """The engine loop, until `stop` (or a factory that fails): on the loop's own thread, or
        on the caller's when built with `thread=False`."""
        try:
            self._run()
        finally:
            self._finished.set_result(None)
            self._refuse_late_commands()  # queued while it was ending (after this, `call` refuses them)
            self._send_outbox()

    def _run(self) -> None:
        try:
            self.engine = self._factory()
        except BaseException as exc:
            self._ready.set_exception(exc)
            return
        self._ready.set_result(None)
        self._ship_stats()
        self._send_outbox()
        while not self._stopping:
            busy = self._busy()
            if not busy and self._busy_period is not None:  # idle again: one log line for the period
                self._busy_period.log(self.engine.compiled())
                self._busy_period = None
                self._log_spec_budget()
                self._ship_stats()
                self._send_outbox()
            more = not busy and self._idle_work()
            self._run_commands(block=not busy and not more)
            if self._busy_period is None and self._busy():  # left idle (a request came in): a period begins
                self._busy_period = BusyPeriod(time.perf_counter(), self.engine.compiled())
            self._send_outbox()
            if self._busy() and not self._stopping:
                self._step()
                if time.perf_counter() >= self.stats.due:
                    self._ship_stats()
                self._send_outbox()
            self._progress.value += 1
        for request_id in list(self._routes):
            self._abort(self.engine, request_id, "server stopped")
        for _, fut, _ in self._weight_waiters:
            self._resolve(fut, error=FailedPrecondition("weights: the server stopped before the update applied"))
        self._refuse_late_commands()
        self._send_outbox()

    def _refuse_late_commands(self) -> None:
        """Commands queued after `stop` fail rather than wait forever."""
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[1] is not None:
                self._resolve(item[1], error=Unavailable("the engine loop has stopped"))

    def _idle_work(self) -> bool:
        """The engine's background work while idle (a drafter refresh's training slice): whether it wants more."""
        idle_work = getattr(self.engine, "idle_work", None)  # (an engine without any: none)
        return idle_work is not None and idle_work()

    def _busy(self) -> bool:
        return self.engine.has_unfinished() or self.engine.weight_update_pending()

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(block=block)
        except queue.Empty:
            return
        while item is not None:
            fn, fut = item
            self._execute(fn, fut)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
        self._stopping = True

    def _execute(self, fn: Callable[[Any], Any], fut: asyncio.Future | None) -> None:
        try:
            result = fn(self.engine)
        except BaseException as exc:
            if fut is not None:
                self._resolve(fut, error=exc)
            return
        if fut is not None:
            self._resolve(fut, result)

    def _resolve(self, fut: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
        """Settles `fut` on the event loop with the next outbox (unless it was cancelled there)."""

        def settle() -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        self._outbox.post(settle)

    def _send_outbox(self) -> None:
        self._outbox.flush()

    def _ship_stats(self) -> None:
        """Hands a snapshot of the counters to `on_stats` with the next outbox (if anyone listens)."""
        on_stats = self.on_stats
        if on_stats is None:
            return
        try:
            snapshot = self.stats.snapshot(self.engine)
        except Exception:  # metrics must not stop the engine
            log_event("engine_stats_failed", logging.ERROR, exc_info=True)
            self.on_stats = None
            return
        self._outbox.post(lambda: on_stats(snapshot))

    def _step(self) -> None:
        start = time.perf_counter()
        if self._busy_period.steps == 0:
            self._busy_period.first_step = start
        try:
            finished = self.engine.step()
            self._busy_period.add(start, finished)
        except Exception as exc:
            log_event("engine_step_failed", logging.ERROR, exc_info=True)
            self._fail_all(exc)
            return
        self.stats.record_step(time.perf_counter() - start)
        if finished:
            self.stats.record_samples(finished)
        self._dispatch(finished)
        self._settle_weight_updates()
        if time.perf_counter() >= self._spec_log_at:
            self._log_spec_budget()

    def _log_spec_budget(self) -> None:
        """The draft budget's choices since its last line, if the engine has one and it chose any."""
        self._spec_log_at = time.perf_counter() + SPEC_LOG_SECONDS
        summary = getattr(self.engine, "spec_budget_summary", None)
        fields = summary() if summary is not None else None
        if fields and fields["steps"]:
            log_event("spec_budget", **fields)

    def _dispatch(self, finished: list[SampleOutput]) -> None:
        by_request: dict[str, list[SampleOutput]] = {}
        for sample in finished:
            by_request.setdefault(sample.request_id, []).append(sample)
        for request_id, samples in by_request.items():
            route = self._routes.get(request_id)
            if route is None:
                continue
            failed = _failure(samples)
            if failed is not None:
                self._fail(request_id, failed)
                continue
            route.remaining -= len(samples)
            done = route.remaining <= 0
            if done:
                del self._routes[request_id]
                log_event("request_finished", request_id=request_id, ms=elapsed_ms(route.started))
            self._post(route.sink, Delivery(samples, done=done))

    def _post(self, sink: Sink, delivery: Delivery) -> None:
        self._outbox.post(lambda: sink(delivery))

    def _add(self, engine: Any, call: GenerateCall, sink: Sink) -> None:
        # the engine refuses an id it still runs (Aborted), so a route is never replaced; an id whose
        # abort was queued before this add is free again here (commands run in order)
        engine.add_request(call.request_id, call.prompts, call.params, n=call.n, mask=call.mask,
                           grammar=call.grammar, return_text=call.return_text)
        self._routes[call.request_id] = _Route(sink, call.num_samples, time.perf_counter())
        if self._busy_period is not None:
            self._busy_period.last_admitted = time.perf_counter()

    def _abort(self, engine: Any, request_id: str, reason: str, sink: Sink | None = None) -> int:
        route = self._routes.get(request_id)
        if route is None or (sink is not None and route.sink is not sink):
            return 0
        del self._routes[request_id]
        aborted = engine.abort(request_id)
        self.stats.record_samples(aborted)
        log_event("request_aborted", request_id=request_id, reason=reason, samples=len(aborted))
        failed = _failure(aborted)  # (a sample whose masks overflowed fails even when aborted)
        self._post(route.sink, Delivery([] if failed else aborted, done=True, error=failed))
        return len(aborted)

    def _fail(self, request_id: str, error: BaseException) -> None:
        route = self._routes.pop(request_id)
        try:
            self.stats.record_samples(self.engine.abort(request_id))
        except Exception:
            log_event("abort_failed", logging.ERROR, exc_info=True, request_id=request_id)
        log_event("request_failed", logging.WARNING, request_id=request_id, error=str(error))
        self._post(route.sink, Delivery([], done=True, error=error))

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._routes):
            self._fail(request_id, error)

    def _update(self, engine: Any, stage, job, summary: WeightsApplied, fut: asyncio.Future) -> None:
        try:
            version = engine.weights.submit(stage, job.token, job.update_id)
        except BaseException as exc:
            self._resolve(fut, error=exc)
            return
        if version is not None:  # this update_id was applied before: nothing changes
            self._resolve(fut, WeightsApplied(version, repeated=True))
            return
        self._weight_waiters.append((job.token, fut, summary))
        self._settle_weight_updates()

    def _withdraw(self, engine: Any, token: str) -> bool:
        if not engine.weights.withdraw(token):
            return False
        error = FailedPrecondition("weights: withdrawn, its caller went away before it applied")
        for _, fut, _ in [w for w in self._weight_waiters if w[0] == token]:
            self._resolve(fut, error=error)
        self._weight_waiters = [w for w in self._weight_waiters if w[0] != token]
        log_event("weights_withdrawn", logging.WARNING, policy_version=engine.policy_version)
        return True

    def _settle_weight_updates(self) -> None:
        if self._weight_waiters and not self.engine.weight_update_pending():
            version, pause = self.engine.policy_version, self.engine.weights.pause_seconds
            for _, fut, summary in self._weight_waiters:
                self._resolve(fut, dataclasses.replace(summary, policy_version=version, pause_seconds=pause))
            self._weight_waiters.clear()


def _failure(samples: list[SampleOutput]) -> FailedPrecondition | None:
    """The error of a request one of whose samples failed (it fails as a whole), else None."""
    failed = next((s for s in samples if s.error is not None), None)
    if failed is None:
        return None
    return FailedPrecondition(f"sample {failed.prompt_index}/{failed.sample_index}: {failed.error}")


def discard(fut: asyncio.Future) -> None:
    """Lets `fut` settle unobserved (a clean-up abort nobody waits for): its error, e.g. the
    engine process having exited meanwhile, is not reported as never retrieved."""
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())


def _run_all(calls: list[Callable[[], None]]) -> None:
    """One outbox on the event loop; a sink or future that raises does not stop the others."""
    for call in calls:
        try:
            call()
        except Exception:
            log_event("outbox_call_failed", logging.ERROR, exc_info=True)
