"""The `rollout.v1.Rollout` servicer: grpc.aio handlers on top of the engine loop.

Generate admits the request on the engine thread, then streams finished samples as Arrow
record batches, flushing when `FlushPolicy.rows` samples are pending or the oldest pending
sample has waited `FlushPolicy.seconds`. If the client goes away (cancel, deadline) the handler
is cancelled and the request is aborted on the engine, which frees its KV blocks. Errors reach
the client through `rollout.server.status.to_status`, the one mapping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from rollout.engine.outputs import SampleOutput
from rollout.errors import InvalidArgument
from rollout.proto.rollout.v1 import rollout_pb2 as pb
from rollout.proto.rollout.v1 import rollout_pb2_grpc
from rollout.schema import schema_with_metadata
from rollout.server.convert import GenerateCall, StreamEncoder, parse_generate, server_info_message
from rollout.server.engine_process import EngineProcess
from rollout.server.logs import log_event
from rollout.server.loop import Delivery, EngineLoop
from rollout.server.memory_service import MemoryService
from rollout.server.status import to_status
from rollout.server.weight_service import WeightService


@dataclass(frozen=True)
class FlushPolicy:
    """When a Generate stream sends the samples it holds: at `rows` samples or after `seconds`."""

    rows: int = 32
    seconds: float = 0.02

    def __post_init__(self):
        if self.rows < 1:
            raise InvalidArgument("flush_rows", f"must be >= 1, got {self.rows}")
        if not self.seconds >= 0:
            raise InvalidArgument("flush_seconds", f"must be >= 0, got {self.seconds}")


@dataclass(frozen=True)
class Identity:
    """Names that go into every batch's schema metadata."""

    model: str
    drafter: str
    spec_method: str


@contextlib.asynccontextmanager
async def status_on_error(context: grpc.aio.ServicerContext, rpc: str, request_id: str = ""):
    """Ends the RPC with the status `to_status` picks for any error raised inside."""
    try:
        yield
    except (asyncio.CancelledError, grpc.aio.AbortError):
        raise
    except Exception as exc:
        code, message = to_status(exc)
        level = logging.ERROR if code == grpc.StatusCode.INTERNAL else logging.INFO
        log_event(
            "rpc_error",
            level,
            exc_info=level == logging.ERROR,
            rpc=rpc,
            request_id=request_id,
            code=code.name,
            message=message,
        )
        await context.abort(code, message)


def engine_info(engine) -> tuple[dict, tuple[int, int]]:
    """What GetServerInfo reports (module-level: it may run in the engine's process)."""
    return engine.info(), engine.kv_blocks()


class RolloutService(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, engine_loop: EngineLoop | EngineProcess, identity: Identity, flush: FlushPolicy = FlushPolicy()):
        self.engine_loop = engine_loop
        self.identity = identity
        self.flush = flush
        self.weights = WeightService(engine_loop)
        self.memory = MemoryService(engine_loop)
        self._encoders: dict[tuple[str, int | None], StreamEncoder] = {}

    def schema(self, call: GenerateCall):
        return self.encoder(call).schema

    def encoder(self, call: GenerateCall) -> StreamEncoder:
        """The call's encoder (its schema's metadata: the mask mode and bound), made once per kind of
        call: a burst of requests does not rebuild and reserialise the same schema each time."""
        key = (call.mask or "none", call.params.support_bound if call.mask else None)
        encoder = self._encoders.get(key)
        if encoder is None:
            if len(self._encoders) >= 256:  # (bounds up to --max-mask-tokens: keep it small)
                self._encoders.clear()
            ident = self.identity
            schema = schema_with_metadata(ident.model, ident.drafter, ident.spec_method, key[0], key[1])
            encoder = self._encoders[key] = StreamEncoder(schema)
        return encoder

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        async with status_on_error(context, "Generate", request.request_id):
            call = parse_generate(request)
        inbox: asyncio.Queue[Delivery] = asyncio.Queue()
        sink = inbox.put_nowait
        try:
            async with status_on_error(context, "Generate", call.request_id):
                await self.engine_loop.add(call, sink)
        except asyncio.CancelledError:
            self.engine_loop.abort(call.request_id, "client went away during admission", sink)
            raise
        log_event(  # debug: at info, a burst of requests would spend ~40 us each formatting and writing it
            "request_admitted",
            logging.DEBUG,
            request_id=call.request_id,
            prompts=len(call.prompts),
            n=call.n,
            mask=call.mask,
            max_tokens=call.params.max_tokens,
            peer=context.peer(),
        )
        encoder, delivered = self.encoder(call), False
        try:
            async with status_on_error(context, "Generate", call.request_id):
                async for samples in self._flushes(inbox):
                    yield encoder.encode(samples)
            delivered = True
        finally:
            if not delivered:
                self.engine_loop.abort(call.request_id, "client went away or request failed", sink)

    async def _flushes(self, inbox: asyncio.Queue[Delivery]) -> AsyncIterator[list[SampleOutput]]:
        """Groups delivered samples into messages of at most `rows` samples; a partial group is
        sent once its oldest sample has waited `seconds`, or when the request is done."""
        pending: list[SampleOutput] = []
        deadline = 0.0
        while True:
            if not pending:
                delivery = await inbox.get()  # (no wait_for: it costs a task per wait)
            else:
                try:
                    delivery = await asyncio.wait_for(inbox.get(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    yield pending
                    pending = []
                    continue
            if delivery.error is not None:
                raise delivery.error
            if not pending:
                deadline = time.monotonic() + self.flush.seconds
            pending.extend(delivery.samples)
            while len(pending) >= self.flush.rows:
                yield pending[: self.flush.rows]
                pending = pending[self.flush.rows :]
            if delivery.done:
                if pending:
                    yield pending
                return

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        async with status_on_error(context, "Abort", request.request_id):
            aborted = await self.engine_loop.abort(request.request_id, "abort rpc")
            return pb.AbortResponse(num_aborted=aborted)

    async def GetServerInfo(self, request: pb.ServerInfoRequest, context) -> pb.ServerInfo:
        async with status_on_error(context, "GetServerInfo"):
            info, kv_blocks = await self.engine_loop.call(engine_info)
            return server_info_message(info, kv_blocks, self.identity.drafter)

    async def UpdateWeights(self, request_iterator, context) -> pb.UpdateWeightsResponse:
        """Its chunks arrive as rollout.weight_wire.WirePiece (see rollout.server.weight_service)."""
        async with status_on_error(context, "UpdateWeights"):
            return await self.weights.update(request_iterator)

    async def UpdateWeightsShared(self, request: pb.SharedWeights, context) -> pb.UpdateWeightsResponse:
        async with status_on_error(context, "UpdateWeightsShared"):
            return await self.weights.update_shared(request)

    async def JoinWeightGroup(self, request: pb.JoinWeightGroupRequest, context) -> pb.JoinWeightGroupResponse:
        async with status_on_error(context, "JoinWeightGroup"):
            await self.weights.join_group(request)
            return pb.JoinWeightGroupResponse()

    async def LeaveWeightGroup(self, request: pb.LeaveWeightGroupRequest, context) -> pb.LeaveWeightGroupResponse:
        async with status_on_error(context, "LeaveWeightGroup"):
            await self.weights.leave_group(request)
            return pb.LeaveWeightGroupResponse()

    async def UpdateWeightsBroadcast(self, request: pb.BroadcastWeights, context) -> pb.UpdateWeightsResponse:
        async with status_on_error(context, "UpdateWeightsBroadcast"):
            return await self.weights.update_broadcast(request)

    async def ReleaseMemory(self, request: pb.ReleaseMemoryRequest, context) -> pb.MemoryState:
        async with status_on_error(context, "ReleaseMemory"):
            return await self.memory.release(request)

    async def ResumeMemory(self, request: pb.ResumeMemoryRequest, context) -> pb.MemoryState:
        async with status_on_error(context, "ResumeMemory"):
            return await self.memory.resume()
