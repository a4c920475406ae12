"""Errors raised where bad input enters; the server maps them to gRPC status codes in one place."""

from __future__ import annotations


class RolloutError(Exception):
    """Base class of every error `rollout` raises on purpose."""


class InvalidArgument(RolloutError, ValueError):
    """A request field is out of range or malformed. `field` names it (gRPC INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message

    def __reduce__(self):  # (the engine process sends errors to the server's process)
        return type(self), (self.field, self.message)


class ResourceExhausted(RolloutError):
    """The request queue is full (gRPC RESOURCE_EXHAUSTED)."""


class FailedPrecondition(RolloutError):
    """A sample failed during generation, e.g. a mask support overflowed its bound
    (gRPC FAILED_PRECONDITION). The whole sample fails; no partial masks."""


class Aborted(RolloutError):
    """A request collides with one still running: its request id stays taken until that request
    has finished or its abort (a cancel, a deadline, an Abort call) has been handled
    (gRPC ABORTED, which a caller may retry)."""


class Unavailable(RolloutError):
    """The engine is gone: its process exited (gRPC UNAVAILABLE). Every request fails fast."""


class GrammarRejected(FailedPrecondition):
    """A committed token that the sample's grammar does not accept (verification applies the
    grammar's bitmask, so this marks a bug): that sample fails, the engine keeps serving."""


class LoadError(RolloutError):
    """A checkpoint cannot be loaded: unsupported model_type, missing or mis-shaped tensor,
    vocabulary mismatch, drafter that does not fit its target. The message names the culprit."""
