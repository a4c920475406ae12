"""Host data to the device inside a step without waiting for the device.

`torch.tensor(data, device="cuda")` and a plain `.to("cuda")` are blocking copies: PyTorch
synchronises the stream before returning, so a step that builds a small index tensor after
launching the forward would wait for the whole forward and then launch the rest of the step
serially. `upload` builds the tensor on the host and copies it with `non_blocking=True`. From
pageable memory the driver stages the bytes before returning (so the host tensor may go away);
copies as small as a step's index tensors (under INLINE_BYTES) go without waiting for the stream,
but a larger one may wait for everything queued before it (CUDA's API synchronisation rules: a
pageable copy that must be staged "may synchronize with the stream"). A batch-256 step's packed
upload (block tables of 25 to 100 blocks a row) is 70-250 KiB: it would wait for the step in flight
and undo the overlap of the next step's launch (rollout.engine.overlap). So larger uploads go
through `PinnedStage`, a ring of pinned host chunks: the bytes are copied into the ring and the DMA
reads them from there, truly asynchronously; a chunk is reused only once the copies read from it
have completed (CUDA events, long done by then: the ring holds many steps' uploads).
tests/test_host_syncs.py flags blocking uploads inside a step.
"""

from __future__ import annotations

import functools
import itertools
import threading
from typing import NamedTuple, TypeVar

import numpy as np
import torch

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.bool_}
Group = TypeVar("Group", bound=NamedTuple)
INLINE_BYTES = 64 << 10  # pageable uploads up to this size are copied without waiting for the stream
STAGE_CHUNK_BYTES = 4 << 20  # one chunk of the pinned ring (larger uploads go pageable: rare, and slow anyway)
STAGE_CHUNKS = 4
_ALIGN = 64


def upload(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list (or nested list, or host array or tensor) as a tensor on `device`, queued behind the
    stream's work instead of waiting for it (past INLINE_BYTES through the pinned ring: see the module
    docstring). Lists go through numpy, which converts them several times faster than torch.tensor
    does (a long penalty history is millions of ids)."""
    host = data if isinstance(data, torch.Tensor) else torch.from_numpy(np.asarray(data, dtype=_NUMPY[dtype]))
    if device.type == "cuda" and host.device.type == "cpu" and host.numel() * host.element_size() > INLINE_BYTES:
        return _stage(device).upload(host.to(dtype), device)
    return host.to(device=device, dtype=dtype, non_blocking=True)


class PinnedStage:
    """A ring of `chunks` host chunks of `chunk_bytes` (pinned: `pin`) that uploads are copied through.
    Each chunk keeps the events recorded after the copies read from it; it is reused only after they
    complete. `event()` makes a recorded event (torch.cuda.Event recorded on the current stream; tests
    give their own)."""

    def __init__(self, chunk_bytes: int = STAGE_CHUNK_BYTES, chunks: int = STAGE_CHUNKS, pin: bool = True,
                 event=None):
        self.chunk_bytes = chunk_bytes
        self.chunks = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(chunks)]
        self.pending: list[list] = [[] for _ in range(chunks)]  # per chunk: events of the copies from it
        self.index, self.offset = 0, 0
        self.event = event or _recorded_event
        self.lock = threading.Lock()  # (a drafter refresh uploads from its own thread)

    def upload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """host (a CPU tensor) on `device` via the ring (pageable when larger than a chunk)."""
        nbytes = host.numel() * host.element_size()
        if nbytes > self.chunk_bytes:
            return host.to(device, non_blocking=True)
        with self.lock:
            return self._upload(host, nbytes, device)

    def _upload(self, host: torch.Tensor, nbytes: int, device: torch.device) -> torch.Tensor:
        start = -(-self.offset // _ALIGN) * _ALIGN
        if start + nbytes > self.chunk_bytes:  # the next chunk, once what was copied from it is done
            self.index, start = (self.index + 1) % len(self.chunks), 0
            for done in self.pending[self.index]:
                done.synchronize()
            self.pending[self.index] = []
        staged = self.chunks[self.index][start:start + nbytes].view(host.dtype).view(host.shape)
        staged.copy_(host)
        out = staged.to(device, non_blocking=True)
        self.pending[self.index].append(self.event())
        self.offset = start + nbytes
        return out


def _recorded_event():
    event = torch.cuda.Event()
    event.record()
    return event


@functools.cache
def _stage(device: torch.device) -> PinnedStage:
    """The pinned ring of a CUDA device (made at its first large upload)."""
    return PinnedStage()


def upload_packed(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Several int64 host arrays as device tensors with one copy (see `upload`): flat views of
    one device buffer, in order."""
    packed = torch.from_numpy(np.concatenate([a.ravel() for a in arrays]))
    return list(upload(packed, torch.int64, device).split_with_sizes([a.size for a in arrays]))


def upload_groups(groups: tuple[Group, ...], device: torch.device) -> tuple[Group, ...]:
    """Named tuples of int64 host arrays as the same named tuples of device tensors, all in one
    copy (`upload_packed`): fields are read by name on both sides."""
    flat = iter(upload_packed([a for group in groups for a in group], device))
    return tuple(type(group)._make(itertools.islice(flat, len(group))) for group in groups)
