"""The weight port (`rollout serve --weight-port`): UpdateWeights on a thread-pool grpc server of its own.

grpc.aio turns a received message into Python bytes on the event loop's thread, and measured on an
H200 host it takes large messages at 1.41 GB/s on one call and 2.22 GB/s on four, against 2.26 and
3.02 GB/s for a thread-pool server of the same grpc (BENCHMARKS.md, issue 15). So weight uploads
get a second port, served by such a server: each call reads its messages on a thread of the pool,
decodes them there (rollout.weight_wire.decode_chunk: views of the received bytes, no copy) and
hands the pieces to the same `WeightService.update` the main port runs, on the event loop, through
a bounded queue (`_Feed`). Everything else is that one code path: validation at a tensor's first
piece, the arena, updates split over several calls (WeightChunk.streams, whichever port each call
came in on), repeats of an update id, the engine's job, the answer.

Ending: an update that ends early (refused, or a repeat answered at its first chunk) stops the
call's reading; a caller that goes away (cancel, deadline) cancels the update's task, which
withdraws the update as on the main port. ServerInfo.weight_port advertises the port (0 when there
is none); trainer_client sends updates there when it can connect, to the main port otherwise.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Iterator
from typing import Any

import grpc

from rollout.proto.rollout.v1 import rollout_pb2 as pb
from rollout.server.convert import MAX_WEIGHT_STREAMS
from rollout.server.logs import log_event
from rollout.server.status import to_status
from rollout.server.weight_service import WeightService
from rollout.server.wire import SERVICE_NAME
from rollout.weight_wire import WirePiece, decode_chunk

FEED_DEPTH = 4  # decoded pieces (16 MiB each from trainer_client) waiting between a call's thread and the loop
SIBLING_WAIT_S = 1.0  # how long a call whose update another call cancelled waits for its own end (_why_cancelled)
_END = object()


class WeightPort:
    """A thread-pool grpc server (`server`: bind and start it) that takes UpdateWeights for
    `weights`, whose coroutines run on `loop`."""

    def __init__(self, weights: WeightService, loop: asyncio.AbstractEventLoop, options: list[tuple[str, Any]],
                 requests=None):  # fmt: skip
        """`requests`: the metrics' counter of RPCs by method and status code (rollout.server.metrics)."""
        self.weights, self.loop, self.requests = weights, loop, requests
        # two threads more than one update's calls: a call beyond them waits for a thread, never a deadlock
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(MAX_WEIGHT_STREAMS + 2,
                                                                        thread_name_prefix="rollout-weight-port"),
                                  options=options)  # fmt: skip
        handler = grpc.stream_unary_rpc_method_handler(self.update, request_deserializer=decode_chunk,
                                                       response_serializer=pb.UpdateWeightsResponse.SerializeToString)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME,
                                                                                   {"UpdateWeights": handler}),))

    def stop(self, grace: float | None) -> None:
        self.server.stop(grace).wait()

    def update(self, pieces: Iterator[WirePiece], context: grpc.ServicerContext) -> pb.UpdateWeightsResponse:
        """One UpdateWeights call, on a thread of the pool, counted by the status it ends with."""
        code = grpc.StatusCode.UNKNOWN
        try:
            reply = self._update(pieces, context)
            code = grpc.StatusCode.OK
            return reply
        except _Ended as ended:
            code = ended.code
            context.abort(ended.code, ended.message)
        finally:
            if self.requests is not None:
                self.requests.labels("UpdateWeights", code.name).inc()

    def _update(self, pieces: Iterator[WirePiece], context: grpc.ServicerContext) -> pb.UpdateWeightsResponse:
        """Its pieces go to WeightService.update; _Ended with the status of a call that fails."""
        feed = _Feed(self.loop)
        answer = asyncio.run_coroutine_threadsafe(self.weights.update(feed), self.loop)
        ended = threading.Event()  # the call ended (the caller gone, or answered)
        context.add_callback(ended.set)
        context.add_callback(answer.cancel)  # (a no-op once the update is done)
        try:
            for piece in pieces:
                if not feed.put(piece, answer):
                    break  # the update ended without the rest (refused, or a repeat answered)
            else:
                feed.put(_END, answer)
        except grpc.RpcError:  # the caller went away while sending: as a cancelled call on the main port
            feed.put(asyncio.CancelledError(), answer)
        try:
            return answer.result()
        except concurrent.futures.CancelledError:
            raise _Ended(*_why_cancelled(context, ended)) from None
        except Exception as exc:  # every error becomes its status, as on the main port
            code, message = to_status(exc)
            level = logging.ERROR if code == grpc.StatusCode.INTERNAL else logging.INFO
            log_event("rpc_error", level, exc_info=level == logging.ERROR, rpc="UpdateWeights", port="weight",
                      code=code.name, message=message)
            raise _Ended(code, message) from None


def _why_cancelled(context: grpc.ServicerContext, ended: threading.Event) -> tuple[grpc.StatusCode, str]:
    """The status of a call whose update was cancelled. Its own end as grpc saw it (its deadline, or
    its caller's cancel: grpc has told the caller already) when that comes within SIBLING_WAIT_S: the
    calls of a split update share a deadline, and the first to pass it cancels the update for all.
    Otherwise another call of the update went away: ABORTED."""
    if not ended.wait(SIBLING_WAIT_S):
        return grpc.StatusCode.ABORTED, "weights: another call of this update went away; nothing applied"
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        return grpc.StatusCode.DEADLINE_EXCEEDED, "weights: the call's deadline passed"
    return grpc.StatusCode.CANCELLED, "weights: the call was cancelled"


class _Ended(Exception):
    """A weight-port call that ends with a status other than OK."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class _Feed:
    """The pieces of one call, put by its grpc thread and read on the event loop as an async
    iterator; at most FEED_DEPTH wait in between. An exception put in is raised to the reader."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._queue: asyncio.Queue | None = None  # made on the loop (asyncio.Queue binds to it)

    def put(self, item: Any, answer: concurrent.futures.Future) -> bool:
        """Queues `item` (waits while the queue is full); False if the update ended first."""
        queued = asyncio.run_coroutine_threadsafe(self._put(item), self._loop)
        concurrent.futures.wait([queued, answer], return_when=concurrent.futures.FIRST_COMPLETED)
        if queued.done():
            return True
        queued.cancel()
        return False

    async def _put(self, item: Any) -> None:
        await self._ready().put(item)

    def _ready(self) -> asyncio.Queue:
        if self._queue is None:
            self._queue = asyncio.Queue(FEED_DEPTH)
        return self._queue

    def __aiter__(self) -> _Feed:
        return self

    async def __anext__(self) -> WirePiece:
        item = await self._ready().get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item
