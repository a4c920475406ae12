"""The engine process's side of `rollout.server.engine_process`: the same `EngineLoop` as in one
process (the engine on this process's main thread), with an asyncio loop on a second thread that
reads the parent's commands from the pipe, runs them on the engine loop in the order they came,
and sends back each command's answer and each admission's deliveries, batched per loop iteration.

Deliveries are keyed by the admission (the key the parent gave the `add`), not by request id: once
a request's abort has run here, its id may be admitted again while the parent still holds the old
admission's last delivery. `stop` is answered after every command received before it.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from rollout.server import logs
from rollout.server.logs import log_event
from rollout.server.loop import Delivery, EngineLoop, Sink
from rollout.server.outbox import Outbox
from rollout.server.pipe import send_message

READY = 0  # the id of the child's first answer: its engine is built (or failed to build)


def child_main(factory: Callable[[], Any], conn, log_level: str, switch_interval: float, progress) -> None:
    """The child's entry point: the engine loop runs on this, the main thread, and the asyncio side
    (commands in, results and deliveries out) on a second one. The main thread matters: glibc
    gives other threads their own malloc arenas, which return memory to the system and take it
    back (page faults in every step; BENCHMARKS.md, issue 5); the main heap does not.
    SIGINT / SIGTERM are the parent's to handle: it drains, then sends `stop`. A parent that goes
    away closes the pipe, which stops the child too. `progress` is the shared counter the engine
    loop ticks (the parent's liveness watchdog reads it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.setswitchinterval(switch_interval)
    logs.configure(log_level)
    loop = asyncio.new_event_loop()
    engine_loop = EngineLoop(factory, loop, thread=False, progress=progress)
    front = threading.Thread(target=loop.run_until_complete, args=(_serve_engine(engine_loop, conn),),
                             name="rollout-engine-front", daemon=True)
    front.start()
    engine_loop.run()  # returns once stopped, or at once if the factory failed
    front.join(60)


class _Replies:
    """The child's messages to the parent (results, deliveries, stats): one pickled batch per
    event-loop iteration, through an `Outbox`, its large arrays out of band (rollout.server.pipe)."""

    def __init__(self, conn, loop: asyncio.AbstractEventLoop):
        self._conn = conn
        self._outbox: Outbox[tuple] = Outbox(self._send, loop, on_error=self._unsent)

    def post(self, kind: str, key: Any, value: Any = None, error: BaseException | None = None) -> None:
        if isinstance(value, Delivery) and value.error is not None:
            value.error = _picklable(value.error)
        self._outbox.post((kind, key, value, _picklable(error)))

    def flush(self) -> None:
        self._outbox.flush()

    def _send(self, batch: list[tuple]) -> None:
        send_message(self._conn, batch)

    def _unsent(self, message: tuple, exc: Exception) -> None:
        """A message the pipe refuses: the parent is gone (the reader sees EOF and stops the
        child); one that does not pickle: its command or request fails instead."""
        if isinstance(exc, OSError):
            return
        log_event("engine_message_unpicklable", logging.ERROR, exc_info=True)
        kind, key, _, _ = message
        failure = RuntimeError(f"the engine's answer could not be sent: {type(exc).__name__}: {exc}")
        if kind == "result":
            self._send([(kind, key, None, failure)])
        else:
            self._send([(kind, key, Delivery([], done=True, error=failure), None)])


class _Admissions:
    """The sinks of the admissions still running here, by the parent's admission key."""

    def __init__(self, out: _Replies):
        self._out = out
        self._sinks: dict[int, Sink] = {}

    def sink(self, key: int) -> Sink:
        def deliver(delivery: Delivery) -> None:
            if delivery.done:
                self._sinks.pop(key, None)
            self._out.post("delivery", key, delivery)

        self._sinks[key] = deliver
        return deliver

    def get(self, key: int) -> Sink | None:
        return self._sinks.get(key)

    def refused(self, key: int) -> None:
        self._sinks.pop(key, None)


async def _serve_engine(engine_loop: EngineLoop, conn) -> None:
    loop = asyncio.get_running_loop()
    out = _Replies(conn, loop)
    engine_loop.on_stats = lambda snapshot: out.post("stats", None, snapshot)
    try:
        await engine_loop.start()
    except BaseException as exc:
        out.post("result", READY, error=exc)
        out.flush()
        return
    out.post("result", READY)
    commands: asyncio.Queue = asyncio.Queue()
    threading.Thread(target=_read_commands, args=(conn, loop, commands), daemon=True).start()
    admissions = _Admissions(out)
    running: set[asyncio.Task] = set()
    while True:
        message = await commands.get()
        if message is None or message[0] == "stop":  # stop, or the parent went away (EOF)
            # the commands received before it reach the engine's queue first (each task's first
            # step, scheduled before this one resumes), so they run and are answered before the stop
            await asyncio.sleep(0)
            await engine_loop.stop()
            await asyncio.gather(*running)  # (the engine loop settled every command it ran)
            if message is not None:
                out.post("result", message[1])
            out.flush()
            return
        task = loop.create_task(_execute(engine_loop, message, admissions, out))
        running.add(task)
        task.add_done_callback(running.discard)


def _read_commands(conn, loop: asyncio.AbstractEventLoop, commands: asyncio.Queue) -> None:
    """The parent's batches of commands into `commands`, one message at a time (None: EOF)."""
    while True:
        try:
            batch = conn.recv()
        except (EOFError, OSError):
            batch = [None]
        loop.call_soon_threadsafe(_put_all, commands, batch)
        if any(message is None or message[0] == "stop" for message in batch):
            return


def _put_all(commands: asyncio.Queue, batch: list) -> None:
    for message in batch:
        commands.put_nowait(message)


async def _execute(engine_loop: EngineLoop, message: tuple, admissions: _Admissions, out: _Replies) -> None:
    op, cmd_id, *args = message
    try:
        if op == "add":
            call, key = args
            try:
                result = await engine_loop.add(call, admissions.sink(key))
            except BaseException:
                admissions.refused(key)
                raise
        elif op == "abort":  # with an admission key: only if that admission still runs
            request_id, reason, key = args
            sink = None if key is None else admissions.get(key)
            result = 0 if key is not None and sink is None else await engine_loop.abort(request_id, reason, sink)
        elif op == "call":
            result = await engine_loop.call(args[0])
        elif op == "weights":
            result = await engine_loop.update_weights(*args)
        else:
            raise ValueError(f"unknown engine command {op!r}")
    except Exception as exc:
        out.post("result", cmd_id, error=exc)
        return
    out.post("result", cmd_id, result)


def _picklable(error: BaseException | None) -> BaseException | None:
    """The error itself when it survives pickling, else a RuntimeError with its text."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
