"""The one outbox: messages collected, then sent as one batch; when a batch fails, each message is
sent alone so that one bad message does not take the others with it.

The server's engine side hands things across a boundary in batches, because each crossing costs:
`EngineLoop` hands callables from the engine thread to the event loop (one
`call_soon_threadsafe`, that is one wake-up of the loop, per batch), and the two ends of an
`EngineProcess` pickle and write their messages to the pipe (one pickle and one write per
event-loop iteration). All three use `Outbox`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

Message = TypeVar("Message")


class Outbox(Generic[Message]):
    """`post` collects messages; `flush` hands everything collected to `send(batch)` at once.

    With `loop`, the first message of an event-loop iteration schedules the flush at the end of
    that iteration (call it on the loop); without, the owner flushes when it chooses. With
    `on_error`, a batch that `send` refuses is sent again one message at a time and
    `on_error(message, exc)` is told of each that still fails; without it the error propagates."""

    def __init__(self, send: Callable[[list[Message]], None], loop: asyncio.AbstractEventLoop | None = None,
                 on_error: Callable[[Message, Exception], None] | None = None):
        self._send, self._loop, self._on_error = send, loop, on_error
        self._batch: list[Message] = []

    def post(self, message: Message) -> None:
        if not self._batch and self._loop is not None:
            self._loop.call_soon(self.flush)
        self._batch.append(message)

    def flush(self) -> None:
        batch, self._batch = self._batch, []
        if not batch:
            return
        if self._on_error is None:
            self._send(batch)
            return
        try:
            self._send(batch)
        except Exception:
            for message in batch:
                try:
                    self._send([message])
                except Exception as exc:
                    self._on_error(message, exc)
