"""`AsyncRolloutClient`: the asyncio twin of `RolloutClient` on a grpc.aio channel.

Same methods, same arguments, same results, awaited: `await generate(...)` returns a
`pyarrow.Table`, `stream(...)` is an async iterator of record batches (leaving it early cancels
the call, which aborts the request on the server), failures raise `grpc.RpcError` (grpc.aio's
`AioRpcError`) carrying the status code. Useful when one trainer process drives many requests
or many servers concurrently.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import pyarrow as pa
import torch

from rollout.proto.rollout.v1 import rollout_pb2 as pb
from trainer_client.client import (
    WEIGHT_PORT_CONNECT_S,
    WEIGHT_STREAMS,
    CancellingCall,
    ClientBase,
    Prompt,
    Weights,
    build_request,
    decode_batch,
    drafter_files,
    drafter_state,
    info_to_dict,
    memory_to_dict,
    to_table,
    warn_weight_port,
)
from trainer_client.shared import SharedUpdate


class AsyncBatchStream(CancellingCall):
    """The record batches of one Generate call (async iterator). `close()` (also on leaving an
    `async with` or `with` block, or when dropped unfinished) cancels the call and so aborts the
    request."""

    def __init__(self, call: grpc.aio.UnaryStreamCall):
        self._call = call
        self._responses = call.__aiter__()

    def __aiter__(self) -> AsyncBatchStream:
        return self

    async def __anext__(self) -> pa.RecordBatch:
        return decode_batch(await self._responses.__anext__())

    async def __aenter__(self) -> AsyncBatchStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class AsyncRolloutClient(ClientBase):
    """Asyncio client. `timeout` (seconds) is the default deadline of every call; None = none.
    Create it inside the event loop that will use it."""

    _open_channel = staticmethod(grpc.aio.insecure_channel)

    async def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        n: int = 1,
        sampling: Mapping[str, Any] | None = None,
        mask: str | None = None,
        grammar: Any = None,
        request_id: str | None = None,
        timeout: float | None = None,
        return_text: bool = False,
    ) -> pa.Table:
        """All samples of all prompts as one table, ordered by (prompt_index, sample_index)."""
        async with self.stream(prompts, n, sampling, mask, grammar, request_id, timeout, return_text) as batches:
            return to_table([batch async for batch in batches])

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        n: int = 1,
        sampling: Mapping[str, Any] | None = None,
        mask: str | None = None,
        grammar: Any = None,
        request_id: str | None = None,
        timeout: float | None = None,
        return_text: bool = False,
    ) -> AsyncBatchStream:
        """Sends the request now; `async for` the record batches as samples finish. Closing
        the stream, or dropping it before the end, cancels the request. Arguments as
        `RolloutClient.stream`."""
        request = build_request(prompts, n, sampling, mask, grammar, request_id, return_text)
        return AsyncBatchStream(self._stub.Generate(request, timeout=self._deadline(timeout)))

    async def abort(self, request_id: str, timeout: float | None = None) -> int:
        """Aborts a running request; returns how many unfinished samples it had."""
        reply = await self._stub.Abort(
            pb.AbortRequest(request_id=request_id), timeout=self._deadline(timeout)
        )
        return reply.num_aborted

    async def server_info(self, timeout: float | None = None) -> dict[str, Any]:
        reply = await self._stub.GetServerInfo(pb.ServerInfoRequest(), timeout=self._deadline(timeout))
        return info_to_dict(reply)

    async def drafter_weights(self, path: str | os.PathLike | None = None,
                              timeout: float | None = None) -> dict[str, torch.Tensor]:
        """See `RolloutClient.drafter_weights`."""
        call = self._stub.GetDrafterWeights(pb.DrafterWeightsRequest(), timeout=self._deadline(timeout))
        config, data, _ = drafter_files([chunk async for chunk in call])
        return await asyncio.to_thread(drafter_state, config, data, path)

    async def update_weights(
        self,
        weights: Weights | None,
        draft: bool = False,
        *,
        draft_weights: Weights | None = None,
        update_id: str | None = None,
        timeout: float | None = None,
        streams: int = WEIGHT_STREAMS,
    ) -> int:
        """See `RolloutClient.update_weights`; returns the new policy_version once applied."""
        if self._max_weight_streams is None:
            await self._find_weight_port(timeout)
        uploads = self._weight_uploads(weights, draft, draft_weights, update_id, streams)
        calls = [asyncio.ensure_future(call(messages, timeout=self._deadline(timeout))) for call, messages in uploads]
        try:
            replies = await asyncio.gather(*calls)
        finally:
            for call in calls:
                call.cancel()
        return self._reply(replies[0])

    async def _find_weight_port(self, timeout: float | None) -> None:
        """See `RolloutClient._find_weight_port`."""
        target = self._learn_weight_target(await self.server_info(timeout=timeout))
        if target is None:
            return
        channel = self._weight_channel(target)
        try:
            await asyncio.wait_for(channel.channel_ready(), WEIGHT_PORT_CONNECT_S)
        except TimeoutError:
            await channel.close()
            warn_weight_port(target, self.address)
            return
        self._use_weight_channel(target, channel)

    async def update_weights_shared(
        self,
        weights: Mapping[str, torch.Tensor] | None,
        draft: bool = False,
        *,
        draft_weights: Mapping[str, torch.Tensor] | None = None,
        update_id: str | None = None,
        timeout: float | None = None,
    ) -> int:
        """See `RolloutClient.update_weights_shared`."""
        with SharedUpdate(weights, draft, draft_weights, update_id or "") as shared:
            reply = await self._stub.UpdateWeightsShared(shared.request, timeout=self._deadline(timeout))
            return self._reply(reply)

    async def release_memory(self, weights: bool = False, hold_requests: bool = False,
                             timeout: float | None = None) -> dict[str, Any]:  # fmt: skip
        """See `RolloutClient.release_memory`."""
        request = pb.ReleaseMemoryRequest(weights=weights, hold_requests=hold_requests)
        return memory_to_dict(await self._stub.ReleaseMemory(request, timeout=self._deadline(timeout)))

    async def resume_memory(self, timeout: float | None = None) -> dict[str, Any]:
        reply = await self._stub.ResumeMemory(pb.ResumeMemoryRequest(), timeout=self._deadline(timeout))
        return memory_to_dict(reply)

    async def close(self) -> None:
        for channel in (self._channel, *self._weight_channels):
            await channel.close()

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
