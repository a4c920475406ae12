"""`FleetStream`: the blocking iterator a fleet request hands its caller.

The request's coroutine runs on the fleet's event loop and puts each prompt's record batch here as
soon as the prompt is complete; iterating takes them in arrival order, then raises the request's
error if it failed. `close()` (also on leaving a `with` block or when the stream is dropped
unfinished) cancels the coroutine, which cancels its gRPC calls, so the servers abort the work.
"""

from __future__ import annotations

import concurrent.futures
import queue
from collections.abc import Callable

import pyarrow as pa

_END = object()


class FleetStream:
    def __init__(self):
        self._items: queue.Queue = queue.Queue()
        self._future: concurrent.futures.Future | None = None
        self._on_close: Callable[[], None] = lambda: None

    def put(self, batch: pa.RecordBatch) -> None:
        self._items.put(batch)

    def attach(self, future: concurrent.futures.Future, on_close: Callable[[], None]) -> None:
        """Binds the request's future: its end (result, error or cancellation) ends the stream."""
        self._future, self._on_close = future, on_close
        future.add_done_callback(self._ended)

    def _ended(self, future: concurrent.futures.Future) -> None:
        error = None if future.cancelled() else future.exception()
        self._items.put(_END if error is None else error)
        self._on_close()

    def __iter__(self) -> FleetStream:
        return self

    def __next__(self) -> pa.RecordBatch:
        item = self._items.get()
        if item is _END:
            self._items.put(_END)  # later calls stop too
            raise StopIteration
        if isinstance(item, BaseException):
            self._items.put(_END)
            raise item
        return item

    def close(self) -> None:
        if self._future is not None:
            self._future.cancel()

    def __enter__(self) -> FleetStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
