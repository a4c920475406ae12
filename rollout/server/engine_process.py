"""The engine in a child process: `EngineProcess` has `EngineLoop`'s interface, and `rollout serve`
uses it unless told `--engine-thread`.

Why a process: a step of a small or well-batched model is host-bound Python (its wall time is
its thread's CPU time), and in one process the engine thread shares the GIL with the gRPC event
loop. Admitting a burst of requests and encoding and sending Arrow batches then take the GIL
from the steps: the engine runs slower behind a server than in-process. In its own process the
engine keeps a GIL to itself; the server's process only parses, encodes and sends.

The child runs the same `EngineLoop` (the engine on its main thread, an asyncio loop on a second)
on its side of one duplex pipe. The parent sends commands (`add`, `abort`, `call`, `weights`,
`withdraw`, `aside`, `stop`), each with an id; the child answers each with a result or an error, and sends every
request's deliveries in the order its event loop produced them, batched per loop iteration.
Commands and results are pickled: `call` takes a picklable function of the engine (a
module-level function or a `functools.partial`, not a lambda), and the engine factory must be
picklable too. Weight bytes do not go through the pipe: the parent writes them into the weight
arena (rollout.server.arena), whose memory file the child gets at spawn, and sends a small job
(rollout.server.weight_jobs). A child that dies (a crash, a kill) fails every pending command and running
request with `Unavailable` (gRPC UNAVAILABLE) naming its exit code, and so does every later
call: the server answers instead of hanging.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import pickle
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from rollout.errors import InvalidArgument, Unavailable
from rollout.server import logs
from rollout.server.arena import HostArena
from rollout.server.convert import GenerateCall
from rollout.server.logs import log_event
from rollout.server.loop import Delivery, EngineLoop, Sink
from rollout.server.weight_jobs import EngineSide, WeightsApplied

_READY = 0  # the id of the child's first answer: its engine is built (or failed to build)
STOP_TIMEOUT_S = 60.0  # how long `stop` waits for the child's answer, then for its exit


class EngineProcess:
    """`EngineLoop`'s interface over a child process (see the module docstring)."""

    def __init__(self, engine_factory: Callable[[], Any], loop: asyncio.AbstractEventLoop,
                 log_level: str | None = None):
        self._factory = engine_factory
        self._loop = loop
        self._log_level = log_level or logging.getLevelName(logging.getLogger(logs.LOGGER_NAME).getEffectiveLevel())
        self._ids = itertools.count(_READY + 1)
        self._pending: dict[int, asyncio.Future] = {}
        self._sinks: dict[str, Sink] = {}
        self._send_lock = threading.Lock()
        self._batch: list[tuple] = []  # commands of this event-loop iteration, sent together
        self._dead: BaseException | None = None
        self._stopping = False
        self._conn = None
        self._proc = None
        self.weight_arena = HostArena()  # shared with the child (see the module docstring)
        self.on_death: Callable[[], None] | None = None  # called on the event loop if the child dies

    async def start(self) -> None:
        """Starts the child and waits until its engine is built; raises what the factory raised."""
        pickle.dumps(self._factory)  # fail here, clearly, rather than in the child
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, name="rollout-engine", daemon=True,
                                 args=(self._factory, child_conn, self._log_level, sys.getswitchinterval(),
                                       self.weight_arena))
        ready = self._pending[_READY] = self._loop.create_future()
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
        """Admits a request (raises the engine's InvalidArgument / ResourceExhausted)."""
        if call.request_id in self._sinks:  # (the child would refuse it too, but its sink is taken here)
            raise InvalidArgument("request_id", f"{call.request_id!r} is already running")
        self._sinks[call.request_id] = sink  # before the child can deliver anything for it
        try:
            await self._command("add", call)
        except BaseException as exc:
            if self._sinks.get(call.request_id) is sink:
                del self._sinks[call.request_id]
            if isinstance(exc, asyncio.CancelledError) and self._dead is None:
                # the caller went away while the child admits it: abort it there (after the add)
                self._command("abort", call.request_id, "client went away during admission")
            raise

    def abort(self, request_id: str, reason: str, sink: Sink | None = None) -> asyncio.Future:
        """As `EngineLoop.abort`; with `sink`, only the request admitted with that sink."""
        if sink is not None and self._sinks.get(request_id) is not sink:
            fut = self._loop.create_future()
            fut.set_result(0)
            return fut
        return self._command("abort", request_id, reason)

    async def update_weights(self, job) -> WeightsApplied:
        """Stages `job` in the child, resolves once it is applied there (EngineLoop.update_weights)."""
        return await self._command("weights", job)

    def withdraw_weights(self, token: str) -> asyncio.Future:
        return self._command("withdraw", token)

    async def aside(self, fn: Callable[[Any, EngineSide], Any]) -> Any:
        """fn(engine, side) on a worker thread of the child; fn must be picklable."""
        return await self._command("aside", fn)

    def num_requests(self) -> int:
        return len(self._sinks)

    # -- parent side ---------------------------------------------------------------------------

    def _command(self, op: str, *args) -> asyncio.Future:
        fut = self._loop.create_future()
        if self._dead is not None:
            fut.set_exception(self._dead)
            return fut
        cmd_id = next(self._ids)
        self._pending[cmd_id] = fut
        if not self._batch:  # one pickle and one write per event-loop iteration (a burst of Generate calls)
            self._loop.call_soon(self._flush)
        self._batch.append((op, cmd_id, *args))
        return fut

    def _flush(self) -> None:
        batch, self._batch = self._batch, []
        try:
            self._send(batch)
        except Exception:  # a command that does not pickle (nothing was written), or the pipe is gone
            for message in batch:
                try:
                    self._send([message])
                except Exception as exc:
                    self._settle(message[1], None, self._died() if isinstance(exc, OSError) else exc)

    def _send(self, batch: list[tuple]) -> None:
        with self._send_lock:
            self._conn.send(batch)

    def _read(self) -> None:
        """Reader thread: hands every batch of messages to the event loop; EOF means the child died."""
        try:
            while True:
                try:
                    batch = self._conn.recv()
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
            else:  # a delivery for request `key`
                sink = self._sinks.get(key)
                if sink is None:
                    continue
                if value.done:
                    del self._sinks[key]
                try:
                    sink(value)
                except Exception:
                    log_event("sink_failed", logging.ERROR, exc_info=True, request_id=key)

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
        if self._pending or self._sinks:
            log_event("engine_process_died", logging.ERROR, exit_code=self._proc.exitcode,
                      commands=len(self._pending), requests=len(self._sinks))
        for cmd_id in list(self._pending):
            self._settle(cmd_id, None, error)
        sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            sink(Delivery([], done=True, error=Unavailable(f"request {request_id}: {error}")))
        if self.on_death is not None and not self._stopping:
            self.on_death()


# -- child side --------------------------------------------------------------------------------


def _child_main(factory: Callable[[], Any], conn, log_level: str, switch_interval: float,
                arena: HostArena) -> None:
    """The child's entry point: the engine loop runs on this, the main thread, and the asyncio side
    (commands in, results and deliveries out) on a second one. The main thread matters: glibc
    gives other threads their own malloc arenas, which return memory to the system and take it
    back (tens of page faults per step of a small model, measured on CPU); the main heap does not.
    SIGINT / SIGTERM are the parent's to handle: it drains, then sends `stop`. A parent that goes
    away closes the pipe, which stops the child too."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.setswitchinterval(switch_interval)
    logs.configure(log_level)
    loop = asyncio.new_event_loop()
    engine_loop = EngineLoop(factory, loop, thread=False, side=EngineSide(arena))
    front = threading.Thread(target=loop.run_until_complete, args=(_serve_engine(engine_loop, conn),),
                             name="rollout-engine-front", daemon=True)
    front.start()
    engine_loop.run()  # returns once stopped, or at once if the factory failed
    front.join(60)


class _Outbox:
    """The child's messages to the parent, sent as one pickled batch per event-loop iteration."""

    def __init__(self, conn, loop: asyncio.AbstractEventLoop):
        self._conn, self._loop = conn, loop
        self._batch: list[tuple] = []

    def post(self, kind: str, key: Any, value: Any = None, error: BaseException | None = None) -> None:
        if not self._batch:
            self._loop.call_soon(self.flush)
        if isinstance(value, Delivery) and value.error is not None:
            value.error = _picklable(value.error)
        self._batch.append((kind, key, value, _picklable(error)))

    def flush(self) -> None:
        batch, self._batch = self._batch, []
        if not batch:
            return
        try:
            self._conn.send(batch)
        except OSError:  # the parent is gone; the reader sees EOF and stops the child
            pass
        except Exception:  # something in the batch does not pickle: send the rest, fail that one
            log_event("engine_message_unpicklable", logging.ERROR, exc_info=True)
            for kind, key, value, error in batch:
                self._send_one(kind, key, value, error)

    def _send_one(self, kind: str, key: Any, value: Any, error: BaseException | None) -> None:
        try:
            self._conn.send([(kind, key, value, error)])
        except OSError:
            pass
        except Exception as exc:
            failure = RuntimeError(f"the engine's answer could not be sent: {type(exc).__name__}: {exc}")
            if kind == "result":
                self._conn.send([(kind, key, None, failure)])
            else:
                self._conn.send([(kind, key, Delivery([], done=True, error=failure), None)])


async def _serve_engine(engine_loop: EngineLoop, conn) -> None:
    loop = asyncio.get_running_loop()
    out = _Outbox(conn, loop)
    try:
        await engine_loop.start()
    except BaseException as exc:
        out.post("result", _READY, error=exc)
        out.flush()
        return
    out.post("result", _READY)
    commands: asyncio.Queue = asyncio.Queue()
    threading.Thread(target=_read_commands, args=(conn, loop, commands), daemon=True).start()
    running: set[asyncio.Task] = set()
    while True:
        message = await commands.get()
        if message is None or message[0] == "stop":  # stop, or the parent went away (EOF)
            await engine_loop.stop()
            await asyncio.sleep(0)  # the deliveries of the aborted requests, then the answer
            if message is not None:
                out.post("result", message[1])
            out.flush()
            return
        task = loop.create_task(_execute(engine_loop, message, out))
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


async def _execute(engine_loop: EngineLoop, message: tuple, out: _Outbox) -> None:
    op, cmd_id, *args = message
    try:
        if op == "add":
            (call,) = args
            rid = call.request_id
            result = await engine_loop.add(call, lambda delivery: out.post("delivery", rid, delivery))
        elif op == "abort":
            result = await engine_loop.abort(*args)
        elif op == "call":
            result = await engine_loop.call(args[0])
        elif op == "weights":
            result = await engine_loop.update_weights(*args)
        elif op == "withdraw":
            result = await engine_loop.withdraw_weights(*args)
        elif op == "aside":
            result = await engine_loop.aside(*args)
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
