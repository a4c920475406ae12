"""The WeightChunk codec without protobuf objects: what `encode_piece` writes protobuf reads as the
same message, what protobuf writes `decode_chunk` reads as the same fields (unknown fields,
unpacked shapes, negative numbers included), and bytes that are no WeightChunk come back as an
error instead of an exception."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from rollout.proto.rollout.v1 import rollout_pb2 as pb
from rollout.weight_wire import EncodedPiece, decode_chunk, encode_piece, file_piece, tensor_piece


@pytest.mark.parametrize("draft, update_id", [(False, ""), (True, "upd-7")])
def test_encoded_pieces_are_weight_chunks(draft, update_id):
    data = bytes(range(256)) * 3
    raw = encode_piece(tensor_piece("model.w", "bfloat16", (3, 128), memoryview(data), draft, update_id))
    want = pb.WeightChunk(draft=draft, update_id=update_id,
                          tensor=pb.Tensor(name="model.w", dtype="bfloat16", shape=[3, 128], data=data))
    assert pb.WeightChunk.FromString(raw) == want
    raw = encode_piece(file_piece(2, data[:10], draft, update_id))
    want = pb.WeightChunk(draft=draft, update_id=update_id, safetensors=pb.SafetensorsPart(file=2, data=data[:10]))
    assert pb.WeightChunk.FromString(raw) == want


def test_encoded_payload_is_the_bytes_of_any_buffer(tmp_path):
    """The payload is copied byte for byte whatever the buffer's item type: a float32 view, an empty
    one, a read-only mapped file; the message is a new bytes object each time."""
    floats = np.arange(7, dtype=np.float32)
    path = tmp_path / "f"
    path.write_bytes(bytes(range(200)))
    with open(path, "rb") as f:
        mapped = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        for data in (memoryview(floats), memoryview(b""), mapped[5:150], b"xyz"):
            piece = EncodedPiece(b"head", data, b"tail")
            raw = encode_piece(piece)
            assert type(raw) is bytes and raw == b"head" + bytes(data) + b"tail"
            assert encode_piece(piece) is not raw


def test_decoder_reads_what_protobuf_writes():
    msg = pb.WeightChunk(draft=True, update_id="u", tensor=pb.Tensor(name="a.b", dtype="float32", shape=[2, 0, -1],
                                                                      data=b"\x00" * 300))
    piece = decode_chunk(msg.SerializeToString())
    assert (piece.kind, piece.draft, piece.name, piece.dtype, piece.shape, piece.update_id, piece.error) == (
        "tensor", True, "a.b", "float32", (2, 0, -1), "u", "")
    assert bytes(piece.data) == b"\x00" * 300 and isinstance(piece.data, memoryview)
    piece = decode_chunk(pb.WeightChunk(safetensors=pb.SafetensorsPart(file=-3, data=b"xyz")).SerializeToString())
    assert (piece.kind, piece.file, bytes(piece.data), piece.draft) == ("safetensors", -3, b"xyz", False)
    assert decode_chunk(b"").kind == "" and decode_chunk(b"").error == ""


def test_decoder_skips_unknown_fields_and_reads_unpacked_shapes():
    unpacked = b"\x18\x05\x18\x07"  # Tensor.shape as two varint fields: 5, 7
    unknown = b"\x2d\x01\x02\x03\x04" + b"\x31" + bytes(8) + b"\x50\x09"  # fields 5 (I32), 6 (I64), 10 (varint)
    tensor = b"\x0a\x01w" + unpacked + unknown + b"\x22\x02ab"
    piece = decode_chunk(b"\x1a" + bytes([len(tensor)]) + tensor + unknown)
    assert (piece.name, piece.shape, bytes(piece.data), piece.error) == ("w", (5, 7), b"ab", "")


@pytest.mark.parametrize("raw", [b"\xff" * 12, b"\x1a\x10abc", b"\x0f", b"\x1a\x03\x0a\x01\xff", b"\x80"])
def test_undecodable_bytes_are_an_error_not_an_exception(raw):
    piece = decode_chunk(raw)
    assert piece.error.startswith("not a WeightChunk message")
