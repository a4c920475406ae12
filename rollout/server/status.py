"""The one place where errors become gRPC status codes (docs/wire.md, "Errors").

Everything the service raises or receives from the engine loop passes through `to_status`;
handlers never pick a status code themselves. Messages of INVALID_ARGUMENT start with the
offending field (`InvalidArgument.__str__` is "field: message").
"""

from __future__ import annotations

import grpc

from rollout.errors import Aborted, FailedPrecondition, InvalidArgument, LoadError, ResourceExhausted, Unavailable

_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (LoadError, grpc.StatusCode.INVALID_ARGUMENT),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (Aborted, grpc.StatusCode.ABORTED),
)


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Maps an exception to (status code, message). Unknown exceptions are INTERNAL: the
    request fails, the server keeps serving."""
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
