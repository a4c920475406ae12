"""Translation between wire messages and the engine's Python types.

Requests: a `GenerateRequest` becomes a `GenerateCall` (prompts as token ids, or text and chat
messages still to be tokenised by rollout.server.admission, `SamplingParams`, n, mask mode,
grammar, return_text). Results: finished
samples become one Arrow IPC message (schema with metadata + one record batch). Range checks
are not repeated here: the engine validates every field when the request is added.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pyarrow as pa

from rollout.engine.chat import ChatPrompt
from rollout.engine.grammar import GrammarSpec
from rollout.engine.params import SamplingParams
from rollout.errors import InvalidArgument
from rollout.outputs import SampleOutput
from rollout.proto.rollout.v1 import rollout_pb2 as pb
from rollout.schema import to_record_batch

_OPTIONAL_SAMPLING_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "min_tokens",
    "max_tokens",
    "ignore_eos",
    "seed",
)


@dataclass
class GenerateCall:
    """One Generate request in engine terms. `prompts` holds token ids, or text and chat messages
    until the server's admission has tokenised them (rollout.server.admission)."""

    request_id: str
    prompts: list[list[int] | str | ChatPrompt]
    params: SamplingParams
    n: int
    mask: str | None
    grammar: GrammarSpec | None
    return_text: bool = False

    @property
    def num_samples(self) -> int:
        return len(self.prompts) * self.n


def parse_generate(request: pb.GenerateRequest) -> GenerateCall:
    """GenerateRequest -> GenerateCall; assigns a request id when the client sent none."""
    grammar = (
        GrammarSpec(request.grammar.kind, request.grammar.value) if request.HasField("grammar") else None
    )
    return GenerateCall(
        request_id=request.request_id or f"req-{uuid.uuid4().hex[:16]}",
        prompts=[_prompt(i, p) for i, p in enumerate(request.prompts)],
        params=sampling_from_proto(request.sampling),
        n=request.n if request.HasField("n") else 1,
        mask=request.mask or None,
        grammar=grammar,
        return_text=request.return_text,
    )


def _prompt(index: int, prompt: pb.Prompt) -> list[int] | str | ChatPrompt:
    kind = prompt.WhichOneof("kind")
    if kind == "token_ids":
        return list(prompt.token_ids.ids)
    if kind == "text":
        return prompt.text
    if kind == "messages":
        return ChatPrompt([{"role": m.role, "content": m.content} for m in prompt.messages.messages])
    raise InvalidArgument(f"prompts[{index}]", "must carry token_ids, text or messages")


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Only the fields the client set; the rest keep SamplingParams' defaults."""
    kwargs = {name: getattr(msg, name) for name in _OPTIONAL_SAMPLING_FIELDS if msg.HasField(name)}
    return SamplingParams(logit_bias=dict(msg.logit_bias), stop_token_ids=list(msg.stop_token_ids),
                          stop=list(msg.stop), **kwargs)


# the IPC stream format's end-of-stream marker: continuation token, then a zero length
_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"


class StreamEncoder:
    """Finished samples -> one response holding an Arrow IPC stream of one record batch (schema
    message, batch message, end of stream). One per kind of call: its schema's metadata differs
    between responses only in the batch's policy version (the newest of its rows), so the schema
    message is built and serialised once per version, by `schema_for(policy_version=...)`."""

    def __init__(self, schema_for: Callable[..., pa.Schema]):
        self._schema_for = schema_for
        self._version: int | None = None
        self._schema: pa.Schema | None = None
        self._schema_message = b""

    def schema(self, policy_version: int) -> pa.Schema:
        if policy_version != self._version:
            self._schema = self._schema_for(policy_version=policy_version)
            self._schema_message = self._schema.serialize().to_pybytes()
            self._version = policy_version
        return self._schema

    def encode(self, samples: Sequence[SampleOutput]) -> pb.GenerateResponse:
        batch = to_record_batch(samples, self.schema(max(s.policy_version for s in samples)))
        stream = b"".join((self._schema_message, batch.serialize(), _END_OF_STREAM))  # (Arrow's buffer, not a copy)
        return pb.GenerateResponse(arrow_ipc=stream, num_rows=batch.num_rows)


MAX_WEIGHT_STREAMS = 16  # the most parallel calls of one UpdateWeights (rollout.server.weight_service)


def server_info_message(info: dict, kv_blocks: tuple[int, int], drafter: str, instance_id: str,
                        weight_port: int = 0) -> pb.ServerInfo:
    """engine.info() + engine.kv_blocks() -> ServerInfo. `limits` gathers the integer `max_*`
    entries (and the spec block size), whether info nests them under "limits" or not."""
    flat = {**info, **dict(info.get("limits", {}))}
    limits = {
        k: int(v)
        for k, v in flat.items()
        if (k.startswith("max_") or k == "spec_block_size") and isinstance(v, int) and not isinstance(v, bool)
    }
    free, total = kv_blocks
    return pb.ServerInfo(
        model=str(info["model"]),
        drafter=drafter,
        spec_method=str(info["spec_method"]),
        vocab_size=int(info["vocab_size"]),
        eos_token_ids=[int(t) for t in info["eos_token_ids"]],
        block_size=int(info["block_size"]),
        max_model_len=limits.get("max_model_len", 0),
        limits=limits,
        policy_version=int(info["policy_version"]),
        kv_blocks_free=free,
        kv_blocks_total=total,
        instance_id=instance_id,
        memory_released=bool(info.get("memory_released", False)),
        drafter_stats={str(k): float(v) for k, v in info.get("drafter_stats", {}).items()},
        max_weight_streams=MAX_WEIGHT_STREAMS,
        weight_port=weight_port,
    )
