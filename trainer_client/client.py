"""The trainer's gRPC client of a rollout server (docs/wire.md).

`RolloutClient(address)` sends prompts (text, token ids or chat messages) with sampling parameters and gets the
finished samples back as a `pyarrow.Table` (`generate`) or as record batches while they finish
(`stream`; leaving the iterator early cancels the call, and the server aborts the request and
frees its KV blocks). `update_weights` pushes a state dict or safetensors files (the stream is
built in trainer_client.weights); `update_weights_shared` hands a state dict to a server on the
same host as CUDA IPC handles or shared memory (trainer_client.shared). Server-side
failures raise `grpc.RpcError` carrying the status code; arguments that cannot even be put on
the wire (an unknown sampling key) raise `rollout.errors.InvalidArgument` locally. The request
building and decoding helpers here are shared with the asyncio twin in `trainer_client.aio`.
"""

from __future__ import annotations

import logging
import numbers
import os
import pathlib
import queue
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import safetensors.torch
import torch

from rollout.engine.grammar import GrammarSpec
from rollout.errors import InvalidArgument
from rollout.proto.rollout.v1 import rollout_pb2 as pb
from rollout.proto.rollout.v1 import rollout_pb2_grpc
from rollout.schema import POLICY_VERSION_KEY, ROLLOUT_SCHEMA
from trainer_client.shared import SharedUpdate
from trainer_client.weights import Weights, encoded_ahead, weight_streams

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
UPDATE_WEIGHTS = "/rollout.v1.Rollout/UpdateWeights"
# parallel UpdateWeights calls of one update (WeightChunk.streams), each on its own connection: gRPC's
# Python receive path handles one call on one thread (H200 host, a bare server: 1.4 GB/s one call, 2.2
# GB/s four; BENCHMARKS.md)
WEIGHT_STREAMS = 4
WEIGHT_PORT_CONNECT_S = 5.0  # how long the first update waits to connect to the weight port before the main one
SORT_KEYS = [("prompt_index", "ascending"), ("sample_index", "ascending")]

Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]  # text, token ids, or chat messages


def build_request(
    prompts: Prompt | Sequence[Prompt],
    n: int,
    sampling: Mapping[str, Any] | None,
    mask: str | None,
    grammar: Any,
    request_id: str | None,
    return_text: bool = False,
) -> pb.GenerateRequest:
    """Client arguments -> GenerateRequest (see `prompt_list` for the prompt forms; `grammar` is
    anything `GrammarSpec.from_input` reads: a JSON schema as a dict or JSON string, a (kind, value)
    pair, {"kind": ..., "value": ...}). Bad arguments raise InvalidArgument naming them."""
    request = pb.GenerateRequest(
        request_id=request_id or "",
        prompts=[_prompt(i, p) for i, p in enumerate(prompt_list(prompts))],
        n=n,
        sampling=sampling_to_proto(dict(sampling or {})),
        mask=mask or "",
        return_text=return_text,
    )
    if grammar is not None:
        spec = GrammarSpec.from_input(grammar)
        request.grammar.CopyFrom(pb.Grammar(kind=spec.kind, value=spec.value))
    return request


def prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """The caller's prompts as a list. One prompt alone may be given as itself: a string, a list
    of token ids, or a chat (a list of {"role", "content"} messages)."""
    if isinstance(prompts, str) or (isinstance(prompts, torch.Tensor) and prompts.dim() == 1):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], Mapping | numbers.Integral):
        return [prompts]
    return prompts


def _prompt(index: int, prompt: Prompt) -> pb.Prompt:
    if isinstance(prompt, str):
        return pb.Prompt(text=prompt)
    prompt = list(prompt)
    if prompt and isinstance(prompt[0], Mapping):
        return pb.Prompt(messages=pb.Messages(messages=[_message(index, j, m) for j, m in enumerate(prompt)]))
    try:
        return pb.Prompt(token_ids=pb.TokenIds(ids=[int(t) for t in prompt]))
    except (TypeError, ValueError):
        raise InvalidArgument(f"prompts[{index}]", "must be text, a list of token ids, or a list of "
                                                   "{'role', 'content'} messages") from None


def _message(index: int, position: int, message: Any) -> pb.ChatMessage:
    if (not isinstance(message, Mapping) or set(message) != {"role", "content"}
            or not all(isinstance(message[k], str) for k in ("role", "content"))):
        raise InvalidArgument(f"prompts[{index}].messages[{position}]",
                              f"must be {{'role': str, 'content': str}}, got {message!r:.80}")
    return pb.ChatMessage(role=message["role"], content=message["content"])


def sampling_to_proto(sampling: dict[str, Any]) -> pb.SamplingParams:
    """`sampling=dict(...)` -> SamplingParams message; None values are left unset, a lone stop
    string is a list of one."""
    known = set(pb.SamplingParams.DESCRIPTOR.fields_by_name)
    unknown = sorted(set(sampling) - known)
    if unknown:
        raise InvalidArgument("sampling", f"unknown field(s) {unknown}; known: {sorted(known)}")
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    try:
        return pb.SamplingParams(**{k: v for k, v in sampling.items() if v is not None})
    except (TypeError, ValueError) as e:
        raise InvalidArgument("sampling", str(e)) from None


def decode_batch(response: pb.GenerateResponse) -> pa.RecordBatch:
    """One streamed message -> its record batch (schema metadata included)."""
    return pa.ipc.open_stream(pa.py_buffer(response.arrow_ipc)).read_next_batch()


def to_table(batches: Sequence[pa.RecordBatch]) -> pa.Table:
    """Streamed batches -> one table ordered by (prompt_index, sample_index). Its schema metadata
    is the batches' (model, mask mode, the server's `instance_id`, ...), with `policy_version` the
    newest of theirs. Rows move as runs of consecutive rows (zero-copy slices, then one
    concatenation): Arrow's `take` on the nested support columns cost ~20x that (0.7 s of a
    256-sample x 512-token x top_k-64 table on CPU)."""
    if not batches:
        return ROLLOUT_SCHEMA.empty_table()
    schema = batches[0].schema
    key = POLICY_VERSION_KEY.encode()
    versions = [int(b.schema.metadata[key]) for b in batches if key in (b.schema.metadata or {})]
    if versions:
        schema = schema.with_metadata({**schema.metadata, key: str(max(versions)).encode()})
    table = pa.Table.from_batches(batches, schema=schema)
    order = pc.sort_indices(table, sort_keys=SORT_KEYS).to_numpy()  # [N]
    starts = np.flatnonzero(np.diff(order, prepend=-2) != 1)  # where a run of consecutive rows begins
    ends = np.append(starts[1:], len(order))
    return pa.concat_tables([table.slice(order[a], b - a) for a, b in zip(starts, ends)]).combine_chunks()


def memory_to_dict(state: pb.MemoryState) -> dict[str, Any]:
    return {f.name: getattr(state, f.name) for f in pb.MemoryState.DESCRIPTOR.fields}


def info_to_dict(info: pb.ServerInfo) -> dict[str, Any]:
    """ServerInfo -> plain dict (ints stay ints), `instance_id` included: the same id means the
    same server process (every table it streams carries it in its schema metadata too)."""
    out = {f.name: getattr(info, f.name) for f in pb.ServerInfo.DESCRIPTOR.fields}
    out["eos_token_ids"] = list(info.eos_token_ids)
    out["limits"] = dict(info.limits)
    out["drafter_stats"] = dict(info.drafter_stats)
    return out


def drafter_files(chunks: Iterable[pb.DrafterWeightsChunk]) -> tuple[str, bytes, int]:
    """GetDrafterWeights' messages -> (config.json text, model.safetensors bytes, policy version)."""
    config, parts, version, total = "", [], 0, None
    for chunk in chunks:
        if total is None:
            config, version, total = chunk.config_json, chunk.policy_version, chunk.total_bytes
        parts.append(chunk.safetensors)
    data = b"".join(parts)
    if total is None or len(data) != total:
        raise ConnectionError(f"GetDrafterWeights: {len(data)} bytes arrived of {total}")
    return config, data, version


def drafter_state(config: str, data: bytes, path: str | os.PathLike | None) -> dict[str, torch.Tensor]:
    """The state dict of a fetched drafter checkpoint; with `path`, also written there as a checkpoint
    directory (config.json, model.safetensors) that rollout's drafter loader reads."""
    if path is not None:
        root = pathlib.Path(path)
        root.mkdir(parents=True, exist_ok=True)
        (root / "config.json").write_text(config)
        (root / "model.safetensors").write_bytes(data)
    return safetensors.torch.load(data)


class CancellingCall:
    """Base of the sync and async streams: closing (explicitly, on leaving a `with` block, or
    when dropped unfinished) cancels the gRPC call."""

    _call: grpc.Call

    def close(self) -> None:
        if not self._call.done():
            self._call.cancel()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class BatchStream(CancellingCall):
    """The record batches of one Generate call, as they arrive. `close()` (also on leaving a
    `with` block or when the stream is dropped unfinished) cancels the call; the server then
    aborts the request and frees its KV blocks."""

    def __init__(self, call: grpc.Call):
        self._call = call

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> pa.RecordBatch:
        return decode_batch(next(self._call))



class ClientBase:
    """What the blocking and asyncio clients share: the channel, the stub, default deadlines."""

    _open_channel: Callable = staticmethod(grpc.insecure_channel)

    def __init__(self, address: str, timeout: float | None = None, options: Iterable[tuple] = (),
                 use_weight_port: bool = True):  # fmt: skip
        self.address = address
        self.timeout = timeout
        self.use_weight_port = use_weight_port  # False: updates over the main port even if the server has another
        self._options = [*CHANNEL_OPTIONS, *options]
        self._channel = self._open_channel(address, options=self._options)
        self._stub = rollout_pb2_grpc.RolloutStub(self._channel)
        # UpdateWeights calls go to `_weight_address`: the server's weight port once the first update
        # found it reachable (ServerInfo.weight_port, rollout.server.weight_port), else the main port;
        # each call on a channel of its own (its own connection), kept for the next updates
        self._weight_address = address
        self._weight_channels: list = []
        self._max_weight_streams: int | None = None  # the server's ServerInfo.max_weight_streams, once asked
        self.last_update: dict[str, Any] = {}  # the last UpdateWeights reply (stage and pause seconds, ...)

    @property
    def _update_weights(self) -> Callable:
        """The UpdateWeights callable of the client's own channel (one stream)."""
        return self._weight_calls(1)[0]

    def _weight_uploads(self, weights, draft: bool, draft_weights, update_id: str | None,
                        streams: int) -> list[tuple[Callable, Iterator[bytes]]]:  # fmt: skip
        """(UpdateWeights callable, encoded messages) of each call of an update: at most `streams`
        calls, and at most what the server takes (its ServerInfo.max_weight_streams, which the caller
        asks before the first update of more than one call); one for a server that predates
        parallel calls, which would apply each call as an update of its own."""
        if streams > 1:
            streams = max(1, min(streams, self._max_weight_streams or 0))
        update_id = update_id or (uuid.uuid4().hex if streams > 1 else "")  # several calls share one id
        groups = weight_streams(weights, draft, draft_weights, update_id, streams)
        return [(call, encoded_ahead(pieces)) for call, pieces in zip(self._weight_calls(len(groups)), groups)]

    def _weight_calls(self, count: int) -> list[Callable]:
        """`count` UpdateWeights callables (taking encoded messages: trainer_client.weights.encoded_ahead),
        each on its own channel and connection to `_weight_address`."""
        while len(self._weight_channels) < count:
            self._weight_channels.append(self._weight_channel(self._weight_address))
        return [c.stream_unary(UPDATE_WEIGHTS, response_deserializer=pb.UpdateWeightsResponse.FromString)
                for c in self._weight_channels[:count]]  # fmt: skip

    def _weight_channel(self, address: str):
        return self._open_channel(address, options=[*self._options, ("grpc.use_local_subchannel_pool", 1)])

    def _learn_weight_target(self, info: dict[str, Any]) -> str | None:
        """Takes the server's max_weight_streams from ServerInfo `info`; the weight port's address to
        try (None: the server has none, or the client's address names no port)."""
        self._max_weight_streams = info["max_weight_streams"]
        host, colon, port = self.address.rpartition(":")
        if not (self.use_weight_port and info.get("weight_port") and colon and port.isdigit()):
            return None
        return f"{host}:{info['weight_port']}"

    def _use_weight_channel(self, address: str, channel) -> None:
        """From now on UpdateWeights goes to `address`, over `channel` (connected) and more like it."""
        self._weight_address = address
        self._weight_channels.append(channel)

    def _deadline(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def _reply(self, reply: pb.UpdateWeightsResponse) -> int:
        self.last_update = {f.name: getattr(reply, f.name) for f in pb.UpdateWeightsResponse.DESCRIPTOR.fields}
        return reply.policy_version


def warn_weight_port(target: str, address: str) -> None:
    logging.getLogger("trainer_client").warning(
        "the server's weight port %s did not connect within %.0f s: weight updates go to %s (the main port)",
        target, WEIGHT_PORT_CONNECT_S, address)


def _first_failure_or_reply(calls: list[grpc.Future]) -> pb.UpdateWeightsResponse:
    """The reply of parallel calls of one update (they all answer the same), or the first failure,
    the others cancelled."""
    finished: queue.SimpleQueue = queue.SimpleQueue()
    for call in calls:
        call.add_done_callback(finished.put)
    reply = None
    try:
        for _ in calls:
            reply = finished.get().result()
    finally:
        for call in calls:
            call.cancel()
    return reply


class RolloutClient(ClientBase):
    """Blocking client. `timeout` (seconds) is the default deadline of every call; None = none.
    Weight updates go to the server's weight port (ServerInfo.weight_port) when it connects within
    WEIGHT_PORT_CONNECT_S at the first update, to the main port otherwise or with
    `use_weight_port=False`."""

    def generate(
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
        """All samples of all prompts as one table, ordered by (prompt_index, sample_index). See
        `stream` for the arguments."""
        with self.stream(prompts, n, sampling, mask, grammar, request_id, timeout, return_text) as batches:
            return to_table(list(batches))

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
    ) -> BatchStream:
        """Sends the request now; iterate for record batches as samples finish. Closing the
        stream, or dropping it before the end, cancels the request.

        `prompts`: text, token ids or chat messages ([{"role", "content"}, ...], rendered by the
        server with the model's chat template), one prompt or a list of them. `sampling`: the
        SamplingParams fields (temperature, top_k, top_p, min_p, penalties, logit_bias, min_tokens,
        max_tokens, stop_token_ids, stop strings, ignore_eos, seed). `mask`: None, "selected" or
        "support". `grammar`: a JSON schema (dict or JSON string), (kind, value) or {"kind",
        "value"}. `return_text`: fill the `text` column with each sample's decoded output."""
        request = build_request(prompts, n, sampling, mask, grammar, request_id, return_text)
        return BatchStream(self._stub.Generate(request, timeout=self._deadline(timeout)))

    def abort(self, request_id: str, timeout: float | None = None) -> int:
        """Aborts a running request; returns how many unfinished samples it had."""
        reply = self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self._deadline(timeout))
        return reply.num_aborted

    def server_info(self, timeout: float | None = None) -> dict[str, Any]:
        return info_to_dict(self._stub.GetServerInfo(pb.ServerInfoRequest(), timeout=self._deadline(timeout)))

    def drafter_weights(self, path: str | os.PathLike | None = None,
                        timeout: float | None = None) -> dict[str, torch.Tensor]:
        """The server's live drafter weights (refreshed online with --drafter-refresh) as a state dict in
        the published checkpoint layout, which `update_weights(state, draft=True)` takes back; with
        `path`, also written there as a checkpoint directory (config.json, model.safetensors)."""
        chunks = self._stub.GetDrafterWeights(pb.DrafterWeightsRequest(), timeout=self._deadline(timeout))
        return drafter_state(*drafter_files(chunks)[:2], path)

    def update_weights(
        self,
        weights: Weights | None,
        draft: bool = False,
        *,
        draft_weights: Weights | None = None,
        update_id: str | None = None,
        timeout: float | None = None,
        streams: int = WEIGHT_STREAMS,
    ) -> int:
        """Pushes a state dict or safetensors file(s) to the target (or, with draft=True, to the
        drafter); `draft_weights` replaces the drafter in the same call. Returns the new
        policy_version, once the server applied it. If the call fails or times out before the
        update applied, the server withdraws it; pass the same `update_id` when retrying to make
        sure it applies once even if the reply, not the update, was lost. The bytes go over up to
        `streams` parallel calls (whole tensors or files each; one call applies nothing alone)."""
        if self._max_weight_streams is None:
            self._find_weight_port(timeout)
        uploads = self._weight_uploads(weights, draft, draft_weights, update_id, streams)
        calls = [call.future(messages, timeout=self._deadline(timeout)) for call, messages in uploads]
        return self._reply(_first_failure_or_reply(calls))

    def _find_weight_port(self, timeout: float | None) -> None:
        """Before the first update: the server's limits, and its weight port if it connects."""
        target = self._learn_weight_target(self.server_info(timeout=timeout))
        if target is None:
            return
        channel = self._weight_channel(target)
        try:
            grpc.channel_ready_future(channel).result(timeout=WEIGHT_PORT_CONNECT_S)
        except grpc.FutureTimeoutError:
            channel.close()
            warn_weight_port(target, self.address)
            return
        self._use_weight_channel(target, channel)

    def update_weights_shared(
        self,
        weights: Mapping[str, torch.Tensor] | None,
        draft: bool = False,
        *,
        draft_weights: Mapping[str, torch.Tensor] | None = None,
        update_id: str | None = None,
        timeout: float | None = None,
    ) -> int:
        """`update_weights` for a server on this host, without sending the bytes: CUDA tensors go
        as CUDA IPC handles, CPU tensors through one /dev/shm file (trainer_client.shared). Keep the
        tensors unchanged until it returns (once the update is applied)."""
        with SharedUpdate(weights, draft, draft_weights, update_id or "") as shared:
            return self._reply(self._stub.UpdateWeightsShared(shared.request, timeout=self._deadline(timeout)))

    def release_memory(self, weights: bool = False, hold_requests: bool = False,
                       timeout: float | None = None) -> dict[str, Any]:  # fmt: skip
        """Between rollouts, for a trainer on the same GPU: the server frees its KV cache and CUDA
        graphs (and with `weights`, moves the weights to host memory). Requests fail with
        UNAVAILABLE until `resume_memory` (or wait for it, with `hold_requests`). Returns the
        MemoryState: bytes freed, the device's free bytes, seconds."""
        request = pb.ReleaseMemoryRequest(weights=weights, hold_requests=hold_requests)
        return memory_to_dict(self._stub.ReleaseMemory(request, timeout=self._deadline(timeout)))

    def resume_memory(self, timeout: float | None = None) -> dict[str, Any]:
        """Takes the memory back (weights, KV cache); returns the MemoryState."""
        return memory_to_dict(self._stub.ResumeMemory(pb.ResumeMemoryRequest(), timeout=self._deadline(timeout)))

    def close(self) -> None:
        for channel in (self._channel, *self._weight_channels):
            channel.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
