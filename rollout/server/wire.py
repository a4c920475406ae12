"""How the `rollout.v1.Rollout` methods are put on the grpc server.

The methods that take one request message (Generate, Abort, GetServerInfo, the weight and memory
RPCs) receive its raw bytes and parse them in the handler with `parse_request`: bytes that are not
such a message are INVALID_ARGUMENT through rollout.server.status, like any other bad input,
rather than the UNKNOWN "Unexpected DecodeError" grpc answers when a deserializer fails before the
handler runs. UpdateWeights' chunks are decoded by `rollout.weight_wire.decode_chunk` (their bytes
are views of the received message, not copies); one that does not decode carries its error to the
handler, which refuses it with INVALID_ARGUMENT.
"""

from __future__ import annotations

from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from rollout.errors import InvalidArgument
from rollout.proto.rollout.v1 import rollout_pb2 as pb
from rollout.weight_wire import decode_chunk

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Rollout"].full_name

M = TypeVar("M", bound=Message)


def parse_request(kind: type[M], data: bytes) -> M:
    """The request message in `data`; InvalidArgument("request") when the bytes are not one."""
    try:
        return kind.FromString(data)
    except DecodeError as exc:
        raise InvalidArgument("request", f"is not a valid {kind.DESCRIPTOR.full_name} message ({exc})") from None


def method_handlers(service: Any) -> dict[str, grpc.RpcMethodHandler]:
    """The service's handlers by method name, unary requests left as bytes (see module docstring)."""
    unary = {"Abort": pb.AbortResponse, "GetServerInfo": pb.ServerInfo, "UpdateWeightsShared": pb.UpdateWeightsResponse,
             "JoinWeightGroup": pb.JoinWeightGroupResponse, "LeaveWeightGroup": pb.LeaveWeightGroupResponse,
             "UpdateWeightsBroadcast": pb.UpdateWeightsResponse, "ReleaseMemory": pb.MemoryState,
             "ResumeMemory": pb.MemoryState}  # fmt: skip
    handlers = {name: grpc.unary_unary_rpc_method_handler(getattr(service, name),
                                                           response_serializer=kind.SerializeToString)
                for name, kind in unary.items()}  # fmt: skip
    handlers["Generate"] = grpc.unary_stream_rpc_method_handler(
        service.Generate, response_serializer=pb.GenerateResponse.SerializeToString
    )
    handlers["GetDrafterWeights"] = grpc.unary_stream_rpc_method_handler(
        service.GetDrafterWeights, response_serializer=pb.DrafterWeightsChunk.SerializeToString
    )
    handlers["UpdateWeights"] = grpc.stream_unary_rpc_method_handler(  # pieces decoded without copies
        service.UpdateWeights, request_deserializer=decode_chunk,
        response_serializer=pb.UpdateWeightsResponse.SerializeToString,
    )  # fmt: skip
    return handlers


def add_rollout_service(service: Any, server: grpc.aio.Server) -> None:
    """Registers `service` (a RolloutService) on `server`, as the generated
    `add_RolloutServicer_to_server` would, with `method_handlers`."""
    handlers = method_handlers(service)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
