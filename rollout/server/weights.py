"""An UpdateWeights stream, received straight into the weight arena (rollout.server.arena).

Chunks carry named raw tensors (pieces with the same name are concatenated in order) or pieces
of safetensors files (concatenated per file index; the header is read as soon as it is complete,
then each tensor's bytes go where they belong). Every tensor is checked against the engine's
`WeightSpecs` from the first piece of it: an unknown name, a wrong shape or a non-floating dtype
fails before any of its bytes are held. Its bytes are then written (cast to the parameter's dtype
on the way, when it was sent in another) into the arena space reserved for it; nothing is
joined or copied in between. `finish` checks that every tensor and file is complete and returns
the `UploadJob` the engine stages and applies. Target and drafter tensors are kept apart by the
chunk's `draft` flag. Anything malformed raises InvalidArgument naming the tensor or file.
"""

from __future__ import annotations

import json
import time

import numpy as np
import torch

from rollout.engine.weight_specs import FLOAT_DTYPES, WeightSpecs
from rollout.errors import InvalidArgument
from rollout.server.arena import HostArena
from rollout.server.weight_jobs import ArenaTensor, UploadJob
from rollout.weight_wire import WirePiece

MAX_HEADER_BYTES = 64 << 20  # a safetensors header (JSON) larger than this is refused
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}  # fmt: skip


class TensorSink:
    """Writes one tensor's bytes, sent as `src_dtype`, into `dest` (flat, the parameter's dtype) in
    the order they come; a piece may end inside an element."""

    def __init__(self, name: str, field_name: str, src_dtype: str, shape, dest: torch.Tensor):
        self.name, self.field, self.src_dtype, self.shape = name, field_name, src_dtype, tuple(shape)
        self.dest = dest  # [numel] in the parameter's dtype
        self.itemsize = FLOAT_DTYPES[src_dtype].itemsize
        self.total = dest.numel() * self.itemsize
        self.written = 0
        self._carry = b""
        # sent in the parameter's dtype: bytes copied as they are (numpy: one plain memcpy, where
        # torch's copy_ splits each piece over its thread pool, slower while gRPC's threads run)
        same = FLOAT_DTYPES[src_dtype] == dest.dtype
        self._dest_bytes = dest.view(torch.uint8).numpy() if same else None  # [nbytes]

    @property
    def complete(self) -> bool:
        return self.written == self.total

    def write(self, data: memoryview) -> None:
        if self.written + len(data) > self.total:
            raise InvalidArgument(self.field, f"tensor {self.name!r}: more than the {self.total} bytes of "
                                              f"{self.src_dtype} {list(self.shape)}")
        start = self.written // self.itemsize  # the element the first byte of `data` belongs to
        self.written += len(data)
        if self._carry:
            need = self.itemsize - len(self._carry)
            self._carry += bytes(data[:need])
            data = data[need:]
            if len(self._carry) < self.itemsize:
                return
            self._copy(start, memoryview(self._carry))
            self._carry, start = b"", start + 1
        whole = len(data) - len(data) % self.itemsize
        if whole:
            self._copy(start, data[:whole])
        self._carry = bytes(data[whole:])

    def _copy(self, start: int, data: memoryview) -> None:
        if self._dest_bytes is not None:  # one memcpy, without the GIL
            offset = start * self.itemsize
            np.copyto(self._dest_bytes[offset : offset + len(data)], np.frombuffer(data, dtype=np.uint8))
            return
        src = torch.frombuffer(data, dtype=FLOAT_DTYPES[self.src_dtype])
        self.dest[start : start + src.numel()].copy_(src)

    def check_complete(self) -> None:
        if not self.complete:
            raise InvalidArgument(self.field, f"tensor {self.name!r}: {self.written} bytes do not fill "
                                              f"{self.src_dtype} {list(self.shape)} ({self.total} bytes)")


class WeightUpload:
    """One UpdateWeights stream (see the module docstring). `add` each decoded chunk, then `finish`."""

    def __init__(self, specs: WeightSpecs, arena: HostArena, token: str):
        self.specs, self.arena, self.token = specs, arena, token
        self.update_id = ""
        self._tensors: dict[tuple[bool, str], tuple[TensorSink, int]] = {}  # (draft, key) -> sink, offset
        self._files: dict[tuple[bool, int], SafetensorsStream] = {}
        self.bytes = 0
        self.started = time.perf_counter()

    def add(self, piece: WirePiece) -> None:
        if piece.error:
            raise InvalidArgument("weights", piece.error)
        self.update_id = piece.update_id or self.update_id
        self.bytes += len(piece.data)
        if piece.kind == "tensor":
            self._add_tensor(piece)
        elif piece.kind == "safetensors":
            key = (piece.draft, piece.file)
            stream = self._files.setdefault(key, SafetensorsStream(self, piece.file, piece.draft))
            stream.feed(piece.data)
        else:
            raise InvalidArgument("weights", "a WeightChunk carries neither safetensors nor tensor")

    def _add_tensor(self, piece: WirePiece) -> None:
        key = (piece.draft, piece.name.removeprefix("model."))
        entry = self._tensors.get(key)
        if entry is None:
            sink = self.open(piece.name, piece.dtype, piece.shape, piece.draft)
        else:
            sink = entry[0]
            if (sink.name, sink.src_dtype, sink.shape) != (piece.name, piece.dtype, piece.shape):
                raise InvalidArgument(sink.field, f"tensor {piece.name!r}: pieces disagree on name, dtype or shape "
                                                  f"(or it is sent twice)")
        sink.write(piece.data)

    def open(self, name: str, dtype: str, shape, draft: bool) -> TensorSink:
        """Checks a tensor against the specs and reserves its arena space: its sink."""
        key, spec = self.specs.check(name, dtype, shape, draft)
        field_name = "draft_weights" if draft else "weights"
        if (draft, key) in self._tensors:
            raise InvalidArgument(field_name, f"tensor {name!r} is sent twice")
        offset, space = self.arena.take(spec.nbytes)
        sink = TensorSink(name, field_name, dtype, shape, space.view(FLOAT_DTYPES[spec.dtype]))
        self._tensors[(draft, key)] = (sink, offset)
        return sink

    def finish(self, keep_locked: bool = False) -> UploadJob:
        """The job of the complete upload (`keep_locked`: the arena stays page-locked after it)."""
        for stream in self._files.values():
            stream.check_complete()
        tensors = []
        for (draft, key), (sink, offset) in self._tensors.items():
            sink.check_complete()
            tensors.append(ArenaTensor(draft, key, sink.name, offset, str(sink.dest.dtype).removeprefix("torch.")))
        if not tensors:
            raise InvalidArgument("weights", "the update carries no tensors")
        return UploadJob(self.token, self.update_id, tensors, self.arena.size, keep_locked)


class SafetensorsStream:
    """One safetensors file arriving in pieces: the 8-byte header length and the JSON header are
    collected (at most MAX_HEADER_BYTES), every tensor in it is checked and given its sink, then
    the data bytes are routed to the sinks in file order (the format leaves no holes)."""

    def __init__(self, upload: WeightUpload, index: int, draft: bool):
        self.upload, self.index, self.draft = upload, index, draft
        self.field = f"safetensors file {index}"
        self._head = bytearray()
        self._sinks: list[TensorSink] | None = None  # in data order, once the header is read
        self._current = 0

    def feed(self, data: memoryview) -> None:
        if self._sinks is None:
            data = self._read_header(data)
            if self._sinks is None:
                return
        while len(data):
            if self._current == len(self._sinks):
                raise InvalidArgument(self.field, "bytes past the end of the file's data")
            sink = self._sinks[self._current]
            take = min(len(data), sink.total - sink.written)
            sink.write(data[:take])
            data = data[take:]
            self._current += sink.complete
        self._skip_complete()

    def _read_header(self, data: memoryview) -> memoryview:
        """Collects header bytes from `data`; once the header is complete, opens its tensors.
        Returns what is left of `data` (the start of the tensors' bytes)."""
        while self._sinks is None and len(data):
            take = min(len(data), self._header_end() - len(self._head))
            self._head += data[:take]
            data = data[take:]
            if len(self._head) == self._header_end():
                self._open_tensors(self._parse_header())
        return data

    def _header_end(self) -> int:
        """8 until the length is known, then 8 + the header's length."""
        if len(self._head) < 8:
            return 8
        size = int.from_bytes(self._head[:8], "little")
        if size > MAX_HEADER_BYTES:
            raise InvalidArgument(self.field, f"header of {size} bytes is larger than {MAX_HEADER_BYTES}")
        return 8 + size

    def _parse_header(self) -> list[tuple[str, str, list, int, int]]:
        """(name, dtype, shape, begin, end) of every tensor, in data order."""
        try:
            header = json.loads(bytes(self._head[8:]))
            entries = [_entry(name, value) for name, value in header.items() if name != "__metadata__"]
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise InvalidArgument(self.field, f"cannot be parsed: not a safetensors header ({exc!r})") from exc
        return sorted(entries, key=lambda entry: entry[3])

    def _open_tensors(self, entries: list[tuple[str, str, list, int, int]]) -> None:
        sinks, end = [], 0
        for name, dtype, shape, begin, stop in entries:
            sink = self.upload.open(name, dtype, shape, self.draft)
            if (begin, stop) != (end, end + sink.total):
                raise InvalidArgument(self.field, f"tensor {name!r}: data_offsets {[begin, stop]} do not follow "
                                                  f"the previous tensor or do not fit {dtype} {shape}")
            sinks.append(sink)
            end = stop
        self._sinks = sinks
        self._skip_complete()

    def _skip_complete(self) -> None:
        while self._sinks and self._current < len(self._sinks) and self._sinks[self._current].complete:
            self._current += 1

    def check_complete(self) -> None:
        if self._sinks is None or self._current < len(self._sinks):
            raise InvalidArgument(self.field, "ends before its last tensor's bytes")


def _entry(name: str, value: dict) -> tuple[str, str, list, int, int]:
    begin, stop = value["data_offsets"]
    dtype = SAFETENSORS_DTYPES.get(value["dtype"], str(value["dtype"]))
    return name, dtype, list(value["shape"]), int(begin), int(stop)
