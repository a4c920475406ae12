"""The engine in a child process: `EngineProcess` has `EngineLoop`'s interface, and `rollout serve`
uses it unless told `--engine-thread`.

Why a process: a step of a small or well-batched model is host-bound Python (its wall time is
its thread's CPU time), and in one process the engine thread shares the GIL with the gRPC event
loop. Admitting a burst of requests and encoding and sending Arrow batches then take the GIL
from the steps: the engine runs slower behind a server than in-process. In its own process the
engine keeps a GIL to itself; the server's process only parses, encodes and sends.

The child runs the same `EngineLoop` (the engine on its main thread, an asyncio loop on a second)
on its side of one duplex pipe. The parent sends commands (`add`, `abort`, `call`, `weights`,
`stop`), each with an id; the child answers each with a result or an error, and sends every
request's deliveries in the order its event loop produced them, batched per loop iteration.
Commands and results are pickled: `call` takes a picklable function of the engine (a
module-level function or a `functools.partial`, not a lambda), and the engine factory must be
picklable too. A child that dies (a crash, a kill) fails every pending command and running
request with `Unavailable` (gRPC UNAVAILABLE) naming its exit code, and so does every later
call: the server answers instead of hanging. The child's side is rollout.server.engine_child.

Each `add` is an admission with a key of its own, and the child sends its deliveries under that
key: a request id whose abort has run in the child can be admitted again at once, while the old
admission's last delivery is still on its way here. The one check that an id is not running twice
is the engine's (`Aborted`). A shared counter that the child's engine loop ticks tells the
liveness watchdog (rollout.server.liveness) whether it makes progress. The child's batches carry
their large arrays (the samples' masks) out of band (rollout.server.pipe).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import pickle
import sys
import threading
from collections.abc import Callable
from typing import Any

from rollout.errors import InvalidArgument, Unavailable
from rollout.server import logs
from rollout.server.convert import GenerateCall
from rollout.server.engine_child import READY, child_main
from rollout.server.logs import log_event
from rollout.server.loop import Delivery, Sink, discard
from rollout.server.outbox import Outbox
from rollout.server.pipe import recv_message

STOP_TIMEOUT_S = 60.0  # how long `stop` waits for the child's answer, then for its exit


class EngineProcess:
    """`EngineLoop`'s interface over a child process (see the module docstring)."""

    def __init__(self, engine_factory: Callable[[], Any], loop: asyncio.AbstractEventLoop,
                 log_level: str | None = None):
        self._factory = engine_factory
        self._loop = loop
        self._log_level = log_level or logging.getLevelName(logging.getLogger(logs.LOGGER_NAME).getEffectiveLevel())
        self._ids = itertools.count(READY + 1)  # command ids and admission keys
        self._pending: dict[int, asyncio.Future] = {}
        self._admitted: dict[int, tuple[str, Sink]] = {}  # admission key -> (request id, sink)
        self._keys: dict[Sink, int] = {}  # sink -> admission key
        self._send_lock = threading.Lock()
        # commands of one event-loop iteration, sent together (`_send` is looked up at each send)
        self._outbox: Outbox[tuple] = Outbox(lambda batch: self._send(batch), loop, on_error=self._unsent)
        self._dead: BaseException | None = None
        self._stopping = False
        self._conn = None
        self._proc = None
        self._progress = None  # the child engine loop's tick counter, in shared memory
        self.on_death: Callable[[], None] | None = None  # called on the event loop if the child dies
        self.on_stats: Callable[[Any], None] | None = None  # the child's StatsSnapshots, on the event loop

    async def start(self) -> None:
        """Starts the child and waits until its engine is built; raises what the factory raised."""
        try:  # fail here, clearly, rather than in the child
            pickle.dumps(self._factory)
        except Exception as exc:
            raise InvalidArgument("engine_process", f"the engine factory cannot be sent to a child process "
                                  f"({exc}); use a module-level function or functools.partial, or run the "
                                  f"engine on a thread (ServeConfig(engine_process=False))") from exc
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        self._conn, child_conn = ctx.Pipe()
        self._progress = ctx.RawValue("q", 0)
        self._proc = ctx.Process(target=child_main, name="rollout-engine", daemon=True,
                                 args=(self._factory, child_conn, self._log_level, sys.getswitchinterval(),
                                       self._progress))
        ready = self._pending[READY] = self._loop.create_future()
        self._proc.start()
        child_conn.close()
        threading.Thread(target=self._read, name="rollout-engine-reader", daemon=True).start()
        await ready

    async def stop(self) -> None:
        """Ends the child after the commands already sent; running requests are aborted."""
        self._stopping = True
        if self._dead is None:
            try:  # the child answers once its engine loop has ended; a wedged one is killed below
                await asyncio.wait_for(self._command("stop"), STOP_TIMEOUT_S)
            except (Unavailable, TimeoutError):
                pass
        await asyncio.to_thread(self._proc.join, STOP_TIMEOUT_S)
        if self._proc.is_alive():
            log_event("engine_process_killed", logging.WARNING, pid=self._proc.pid)
            self._proc.kill()
            await asyncio.to_thread(self._proc.join)
        self._conn.close()

    def call(self, fn: Callable[[Any], Any]) -> asyncio.Future:
        """Runs fn(engine) in the child; fn must be picklable (a module-level function or a partial)."""
        return self._command("call", fn)

    async def add(self, call: GenerateCall, sink: Sink) -> None:
        """Admits a request (raises the engine's InvalidArgument / ResourceExhausted / Aborted)."""
        key = next(self._ids)
        self._admitted[key] = (call.request_id, sink)  # before the child can deliver anything for it
        self._keys[sink] = key
        try:
            await self._command("add", call, key)
        except BaseException as exc:
            self._forget(key)
            if isinstance(exc, asyncio.CancelledError) and self._dead is None:
                # the caller went away while the child admits it: abort it there (after the add)
                discard(self._command("abort", call.request_id, "client went away during admission", key))
            raise

    def abort(self, request_id: str, reason: str, sink: Sink | None = None) -> asyncio.Future:
        """As `EngineLoop.abort`; with `sink`, only the request admitted with that sink."""
        key = None
        if sink is not None:
            key = self._keys.get(sink)
            if key is None:  # that admission has ended
                fut = self._loop.create_future()
                fut.set_result(0)
                return fut
        return self._command("abort", request_id, reason, key)

    async def update_weights(self, state: dict, draft_state: dict | None) -> int:
        """Validates in the child, resolves with the new policy_version once applied there."""
        return await self._command("weights", state, draft_state, send_in_thread=True)

    def num_requests(self) -> int:
        return len(self._admitted)

    def progress(self) -> int:
        """Ticks of the child's engine loop so far (see EngineLoop.progress)."""
        return self._progress.value if self._progress is not None else 0

    def _forget(self, key: int) -> None:
        entry = self._admitted.pop(key, None)  # (gone already if the child died meanwhile)
        if entry is not None:
            self._keys.pop(entry[1], None)

    # -- parent side ---------------------------------------------------------------------------

    def _command(self, op: str, *args, send_in_thread: bool = False) -> asyncio.Future:
        fut = self._loop.create_future()
        if self._dead is not None:
            fut.set_exception(self._dead)
            return fut
        cmd_id = next(self._ids)
        self._pending[cmd_id] = fut
        message = (op, cmd_id, *args)
        if send_in_thread:  # a large message (weights) must not hold the event loop while it is written
            task = self._loop.create_task(asyncio.to_thread(self._send, [message]))
            task.add_done_callback(lambda t: self._settle(cmd_id, None, _send_error(t)) if _send_error(t) else None)
        else:  # one pickle and one write per event-loop iteration (a burst of Generate calls)
            self._outbox.post(message)
        return fut

    def _unsent(self, message: tuple, exc: Exception) -> None:
        """A command that does not pickle (nothing was written) fails; so does one the pipe refuses
        (the child is gone)."""
        self._settle(message[1], None, self._died() if isinstance(exc, OSError) else exc)

    def _send(self, batch: list[tuple]) -> None:
        with self._send_lock:
            self._conn.send(batch)

    def _read(self) -> None:
        """Reader thread: hands every batch of messages to the event loop; EOF means the child died."""
        try:
            while True:
                try:
                    batch = recv_message(self._conn)
                except (EOFError, OSError):
                    break
                self._loop.call_soon_threadsafe(self._on_batch, batch)
            self._loop.call_soon_threadsafe(self._on_exit)
        except RuntimeError:  # the event loop is closed: nobody is left to tell
            pass

    def _on_batch(self, batch: list[tuple]) -> None:
        for kind, key, value, error in batch:
            if kind == "result":
                self._settle(key, value, error)
            elif kind == "stats":
                if self.on_stats is not None:
                    self.on_stats(value)
            else:  # a delivery for admission `key`
                entry = self._admitted.get(key)
                if entry is None:
                    continue
                if value.done:
                    self._forget(key)
                try:
                    entry[1](value)
                except Exception:
                    log_event("sink_failed", logging.ERROR, exc_info=True, request_id=entry[0])

    def _settle(self, cmd_id: int, value: Any, error: BaseException | None) -> None:
        fut = self._pending.pop(cmd_id, None)
        if fut is None or fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)

    def _died(self) -> Unavailable:
        if self._dead is None:
            self._proc.join(5)
            self._dead = Unavailable(f"the engine process exited (exit code {self._proc.exitcode})")
        return self._dead

    def _on_exit(self) -> None:
        error = self._died()
        if not self._stopping:  # (a stop is answered after every command sent before it)
            log_event("engine_process_died", logging.ERROR, exit_code=self._proc.exitcode,
                      commands=len(self._pending), requests=len(self._admitted))
        for cmd_id in list(self._pending):
            self._settle(cmd_id, None, error)
        admitted, self._admitted, self._keys = self._admitted, {}, {}
        for request_id, sink in admitted.values():
            sink(Delivery([], done=True, error=Unavailable(f"request {request_id}: {error}")))
        if self.on_death is not None and not self._stopping:
            self.on_death()


def _send_error(task: asyncio.Task) -> BaseException | None:
    """Why a threaded send failed (None if it did not)."""
    if task.cancelled():
        return asyncio.CancelledError()
    return task.exception()
