"""The `WeightChunk` messages of UpdateWeights, written and read without copying tensor bytes
through protobuf objects.

Python protobuf copies a `bytes` field when a message is built, again when it is serialised,
when it is parsed and when the field is read: four passes over every byte of a 16 GB update.
Here the client writes a chunk as its encoded header followed by a memoryview of the tensor's
own memory (one copy without the GIL, `encode_piece`), and the server reads the header fields and takes the
payload as a memoryview of the received message (`decode_chunk`). The bytes on the wire are
ordinary `rollout.v1.WeightChunk` messages: any protobuf client may send them, and
`decode_chunk` reads what protobuf writes (unknown fields skipped, packed or unpacked shapes).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from rollout.proto.rollout.v1 import rollout_pb2 as pb

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_EMPTY = memoryview(b"")
# PyBytes_FromStringAndSize(NULL, size): a bytes object whose contents its creator writes before sharing it
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.argtypes, _new_bytes.restype = (ctypes.c_char_p, ctypes.c_ssize_t), ctypes.py_object
_bytes_address = ctypes.pythonapi.PyBytes_AsString
_bytes_address.argtypes, _bytes_address.restype = (ctypes.py_object,), ctypes.c_void_p


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64 / int32: ten bytes of two's complement
    out = bytearray()
    while True:
        bits, value = value & 0x7F, value >> 7
        out.append(bits | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


@dataclass(frozen=True)
class EncodedPiece:
    """One WeightChunk: `head` (everything up to the payload's bytes), the payload itself (a
    view of the sender's memory) and `tail` (fields after it)."""

    head: bytes
    data: memoryview | bytes
    tail: bytes = b""


def encode_piece(piece: EncodedPiece) -> bytes:
    """The request serializer of UpdateWeights: the one copy of the payload on the client, into a new
    bytes object filled before it is returned. numpy copies without the GIL, where b"".join of a
    memoryview holds it for the whole copy, stalling the other calls' gRPC threads of the process."""
    data = np.frombuffer(piece.data, dtype=np.uint8)  # [payload bytes]
    head, tail = len(piece.head), len(piece.tail)
    size = head + data.size + tail  # > 0: the head holds at least the payload's field key
    message = _new_bytes(None, size)
    out = np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(_bytes_address(message)))  # [size] uint8
    out[:head] = np.frombuffer(piece.head, dtype=np.uint8)
    np.copyto(out[head : size - tail], data)
    out[size - tail :] = np.frombuffer(piece.tail, dtype=np.uint8)
    return message


def _wrap(payload_field: int, inner_head: bytes, data_field: int, size: int, draft: bool,
          update_id: str, streams: int) -> tuple[bytes, bytes]:  # fmt: skip
    inner = inner_head + _key(data_field, _LEN) + _varint(size)
    head = (_key(1, _VARINT) + b"\x01" if draft else b"") + _key(payload_field, _LEN)
    tail = pb.WeightChunk(update_id=update_id, streams=streams).SerializeToString()
    return head + _varint(len(inner) + size) + inner, tail


def tensor_piece(name: str, dtype: str, shape: tuple[int, ...], data, draft: bool = False,
                 update_id: str = "", streams: int = 0) -> EncodedPiece:  # fmt: skip
    """A WeightChunk carrying a piece of the raw bytes of tensor `name` (`streams`: the update's
    count of parallel calls, see WeightChunk.streams)."""
    fields = pb.Tensor(name=name, dtype=dtype, shape=shape).SerializeToString()
    head, tail = _wrap(3, fields, 4, len(data), draft, update_id, streams)
    return EncodedPiece(head, data, tail)


def file_piece(index: int, data, draft: bool = False, update_id: str = "", streams: int = 0) -> EncodedPiece:
    """A WeightChunk carrying a piece of safetensors file number `index`."""
    fields = pb.SafetensorsPart(file=index).SerializeToString()
    head, tail = _wrap(2, fields, 2, len(data), draft, update_id, streams)
    return EncodedPiece(head, data, tail)


@dataclass
class WirePiece:
    """A decoded WeightChunk. `kind` is "tensor", "safetensors" or "" (neither); `data` views the
    received message; `error` says why the bytes are not a WeightChunk ("" if they are)."""

    draft: bool = False
    kind: str = ""
    name: str = ""
    dtype: str = ""
    shape: tuple[int, ...] = ()
    file: int = 0
    data: memoryview = _EMPTY
    update_id: str = ""
    streams: int = 0
    error: str = ""


def decode_chunk(raw: bytes) -> WirePiece:
    """The request deserializer of UpdateWeights; never raises (a gRPC deserializer that raises
    fails the call as INTERNAL): undecodable bytes come back as a piece with `error` set."""
    try:
        return _decode_chunk(memoryview(raw))
    except (IndexError, ValueError) as exc:  # (UnicodeDecodeError is a ValueError)
        return WirePiece(error=f"not a WeightChunk message: {exc}")


def _decode_chunk(buf: memoryview) -> WirePiece:
    piece = WirePiece()
    for field, wire_type, value in _fields(buf):
        if field == 1 and wire_type == _VARINT:
            piece.draft = bool(value)
        elif field == 2 and wire_type == _LEN:
            piece.kind = "safetensors"
            _decode_file(value, piece)
        elif field == 3 and wire_type == _LEN:
            piece.kind = "tensor"
            _decode_tensor(value, piece)
        elif field == 4 and wire_type == _LEN:
            piece.update_id = str(value, "utf-8")
        elif field == 5 and wire_type == _VARINT:
            piece.streams = value
    return piece


def _decode_tensor(buf: memoryview, piece: WirePiece) -> None:
    shape: list[int] = []
    for field, wire_type, value in _fields(buf):
        if field == 1 and wire_type == _LEN:
            piece.name = str(value, "utf-8")
        elif field == 2 and wire_type == _LEN:
            piece.dtype = str(value, "utf-8")
        elif field == 3 and wire_type == _VARINT:
            shape.append(_signed(value))
        elif field == 3 and wire_type == _LEN:
            shape.extend(_signed(v) for v in _packed(value))
        elif field == 4 and wire_type == _LEN:
            piece.data = value
    piece.shape = tuple(shape)


def _decode_file(buf: memoryview, piece: WirePiece) -> None:
    for field, wire_type, value in _fields(buf):
        if field == 1 and wire_type == _VARINT:
            piece.file = _signed(value)
        elif field == 2 and wire_type == _LEN:
            piece.data = value


def _fields(buf: memoryview):
    """(field number, wire type, value) of every field: an int, or a memoryview for LEN fields."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _read_varint(buf, pos)
        wire_type = key & 7
        if wire_type == _VARINT:
            value, pos = _read_varint(buf, pos)
        elif wire_type in (_I64, _I32):
            size = 8 if wire_type == _I64 else 4
            value, pos = int.from_bytes(buf[pos : pos + size], "little"), pos + size
        elif wire_type == _LEN:
            size, pos = _read_varint(buf, pos)
            value, pos = buf[pos : pos + size], pos + size
        else:
            raise ValueError(f"wire type {wire_type} of field {key >> 3}")
        if pos > end:
            raise ValueError(f"field {key >> 3} runs past the end of the message")
        yield key >> 3, wire_type, value


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise ValueError("varint longer than ten bytes")


def _packed(buf: memoryview):
    pos = 0
    while pos < len(buf):
        value, pos = _read_varint(buf, pos)
        yield value


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value
