"""The `rollout.v1.Rollout` servicer: grpc.aio handlers on top of the engine loop.

Generate parses and admits the request here (rollout.server.admission: size checks, then text and chat prompts
tokenised off the event loop), adds it on the engine, then streams finished samples as Arrow
record batches, flushing when `FlushPolicy.rows` samples are pending or the oldest pending
sample has waited `FlushPolicy.seconds`. If the client goes away (cancel, deadline) the handler
is cancelled and the request is aborted on the engine, which frees its KV blocks. Requests arrive
as bytes (rollout.server.wire). Errors reach the client through `rollout.server.status.to_status`,
the one mapping.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from rollout.errors import FailedPrecondition
from rollout.outputs import SampleOutput
from rollout.proto.rollout.v1 import rollout_pb2 as pb
from rollout.proto.rollout.v1 import rollout_pb2_grpc
from rollout.schema import schema_with_metadata
from rollout.server.admission import Admission
from rollout.server.config import FlushPolicy
from rollout.server.convert import GenerateCall, StreamEncoder, server_info_message
from rollout.server.engine_process import EngineProcess
from rollout.server.logs import log_event
from rollout.server.loop import Delivery, EngineLoop, discard
from rollout.server.memory_service import MemoryService
from rollout.server.status import to_status
from rollout.server.weight_service import WeightService
from rollout.server.wire import parse_request

DRAFTER_CHUNK_BYTES = 4 << 20  # GetDrafterWeights' safetensors bytes per message


@dataclass(frozen=True)
class Identity:
    """Names that go into every batch's schema metadata; `instance_id` is made when the server
    starts (GetServerInfo reports it too)."""

    model: str
    drafter: str
    spec_method: str
    vocab_size: int
    instance_id: str


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


def drafter_checkpoint(engine) -> tuple[str, bytes, int]:
    """GetDrafterWeights' files and the policy version, taken between steps on the engine's thread
    (module-level: it may run in the engine's process)."""
    files = engine.drafter.checkpoint() if engine.drafter is not None else None
    if files is None:
        raise FailedPrecondition("drafter: the server runs no drafter model (--spec dflash or dspark, alone or "
                                 "+history)")
    return (*files, engine.policy_version)


class RolloutService(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, engine_loop: EngineLoop | EngineProcess, identity: Identity, admission: Admission,
                 flush: FlushPolicy = FlushPolicy()):
        self.engine_loop = engine_loop
        self.identity = identity
        self.admission = admission
        self.flush = flush
        self.weights = WeightService(engine_loop)
        self.weight_port = 0  # the weight port's number once it listens (rollout.server.weight_port)
        self.memory = MemoryService(engine_loop)
        self._encoders: dict[tuple[str, int | None], StreamEncoder] = {}

    def encoder(self, call: GenerateCall) -> StreamEncoder:
        """The call's encoder (its schema's metadata: the mask mode and bound), made once per kind of
        call: a burst of requests does not rebuild and reserialise the same schema each time."""
        key = (call.mask or "none", call.params.support_bound if call.mask else None)
        encoder = self._encoders.get(key)
        if encoder is None:
            if len(self._encoders) >= 256:  # (bounds up to --max-mask-tokens: keep it small)
                self._encoders.clear()
            ident = self.identity
            schema_for = functools.partial(schema_with_metadata, ident.model, ident.drafter, ident.spec_method,
                                           key[0], key[1], ident.vocab_size, instance_id=ident.instance_id)
            encoder = self._encoders[key] = StreamEncoder(schema_for)
        return encoder

    async def Generate(self, data: bytes, context) -> AsyncIterator[pb.GenerateResponse]:
        async with status_on_error(context, "Generate"):
            request = parse_request(pb.GenerateRequest, data)
        async with status_on_error(context, "Generate", request.request_id):
            call = self.admission.parse(request)
        inbox: asyncio.Queue[Delivery] = asyncio.Queue()
        sink = inbox.put_nowait
        try:
            async with status_on_error(context, "Generate", call.request_id):
                await self.admission.tokenize(call)
                await self.engine_loop.add(call, sink)
        except asyncio.CancelledError:
            discard(self.engine_loop.abort(call.request_id, "client went away during admission", sink))
            raise
        log_event(  # debug: at info, a burst of requests would format and write a line each on the event loop
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
                discard(self.engine_loop.abort(call.request_id, "client went away or request failed", sink))

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

    async def Abort(self, data: bytes, context) -> pb.AbortResponse:
        async with status_on_error(context, "Abort"):
            request = parse_request(pb.AbortRequest, data)
            aborted = await self.engine_loop.abort(request.request_id, "abort rpc")
            return pb.AbortResponse(num_aborted=aborted)

    async def GetServerInfo(self, data: bytes, context) -> pb.ServerInfo:
        async with status_on_error(context, "GetServerInfo"):
            parse_request(pb.ServerInfoRequest, data)
            info, kv_blocks = await self.engine_loop.call(engine_info)
            return server_info_message(info, kv_blocks, self.identity.drafter, self.identity.instance_id,
                                       self.weight_port)

    async def GetDrafterWeights(self, data: bytes, context) -> AsyncIterator[pb.DrafterWeightsChunk]:
        async with status_on_error(context, "GetDrafterWeights"):
            parse_request(pb.DrafterWeightsRequest, data)
            config, blob, version = await self.engine_loop.call(drafter_checkpoint)
        view = memoryview(blob)
        yield pb.DrafterWeightsChunk(config_json=config, policy_version=version, total_bytes=len(blob),
                                     safetensors=bytes(view[:DRAFTER_CHUNK_BYTES]))
        for start in range(DRAFTER_CHUNK_BYTES, len(blob), DRAFTER_CHUNK_BYTES):
            yield pb.DrafterWeightsChunk(safetensors=bytes(view[start : start + DRAFTER_CHUNK_BYTES]))

    async def UpdateWeights(self, request_iterator, context) -> pb.UpdateWeightsResponse:
        """Its chunks arrive as rollout.weight_wire.WirePiece (see rollout.server.weight_service)."""
        async with status_on_error(context, "UpdateWeights"):
            return await self.weights.update(request_iterator)

    async def UpdateWeightsShared(self, data: bytes, context) -> pb.UpdateWeightsResponse:
        async with status_on_error(context, "UpdateWeightsShared"):
            return await self.weights.update_shared(parse_request(pb.SharedWeights, data))

    async def JoinWeightGroup(self, data: bytes, context) -> pb.JoinWeightGroupResponse:
        async with status_on_error(context, "JoinWeightGroup"):
            await self.weights.join_group(parse_request(pb.JoinWeightGroupRequest, data))
            return pb.JoinWeightGroupResponse()

    async def LeaveWeightGroup(self, data: bytes, context) -> pb.LeaveWeightGroupResponse:
        async with status_on_error(context, "LeaveWeightGroup"):
            await self.weights.leave_group(parse_request(pb.LeaveWeightGroupRequest, data))
            return pb.LeaveWeightGroupResponse()

    async def UpdateWeightsBroadcast(self, data: bytes, context) -> pb.UpdateWeightsResponse:
        async with status_on_error(context, "UpdateWeightsBroadcast"):
            return await self.weights.update_broadcast(parse_request(pb.BroadcastWeights, data))

    async def ReleaseMemory(self, data: bytes, context) -> pb.MemoryState:
        async with status_on_error(context, "ReleaseMemory"):
            return await self.memory.release(parse_request(pb.ReleaseMemoryRequest, data))

    async def ResumeMemory(self, data: bytes, context) -> pb.MemoryState:
        async with status_on_error(context, "ResumeMemory"):
            parse_request(pb.ResumeMemoryRequest, data)
            return await self.memory.resume()
