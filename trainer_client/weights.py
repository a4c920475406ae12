"""The trainer's side of UpdateWeights: a state dict or safetensors files as a stream of
WeightChunk pieces whose bytes are views of the tensors' (or files') own memory.

A contiguous CPU tensor is sent from its storage (a memoryview, no copy before the one that
builds each message); a CUDA tensor is copied once, piece by piece, into a pinned host buffer;
a safetensors file is mapped, not read. `encoded_ahead` builds each message (its copy, and a CUDA
piece's copy to the host) on a worker thread one piece ahead of gRPC's sending thread, which waits
for each message to be written before it asks for the next: building and sending overlap instead
of taking turns (at most two messages held). Pieces are `WEIGHT_PIECE_BYTES` long: below glibc's
largest mmap threshold (32 MiB), so the messages gRPC allocates for them on both sides reuse
warm heap memory instead of mapping fresh pages for each (measured: 64 MiB pieces moved a third
of the bytes per second of 16 MiB ones over loopback).
"""

from __future__ import annotations

import itertools
import mmap
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch

from rollout.engine.weight_specs import dtype_name
from rollout.errors import InvalidArgument
from rollout.weight_wire import EncodedPiece, encode_piece, file_piece, tensor_piece

WEIGHT_PIECE_BYTES = 16 << 20
Weights = Mapping[str, torch.Tensor] | str | Path


def weight_pieces(weights: Weights | None, draft: bool = False, draft_weights: Weights | None = None,
                  update_id: str = "", piece_bytes: int = WEIGHT_PIECE_BYTES) -> Iterator[EncodedPiece]:  # fmt: skip
    """The UpdateWeights stream: `weights` for the target (or the drafter if `draft`), then
    `draft_weights` for the drafter. Paths are checked now (InvalidArgument); tensors and files
    are read lazily, as gRPC asks for the next piece."""
    return weight_streams(weights, draft, draft_weights, update_id, 1, piece_bytes)[0]


def weight_streams(weights: Weights | None, draft: bool = False, draft_weights: Weights | None = None,
                   update_id: str = "", streams: int = 1,
                   piece_bytes: int = WEIGHT_PIECE_BYTES) -> list[Iterator[EncodedPiece]]:  # fmt: skip
    """`weight_pieces` split over at most `streams` parallel UpdateWeights calls (WeightChunk.streams):
    whole tensors and files, balanced by bytes (the largest first, each onto the lightest call). One
    call when there is a single tensor or file; more need an `update_id`."""
    if piece_bytes < 1:
        raise InvalidArgument("piece_bytes", f"must be >= 1, got {piece_bytes}")
    if streams < 1:
        raise InvalidArgument("streams", f"must be >= 1, got {streams}")
    groups = _balanced(_sources(weights, draft, draft_weights), streams)
    count = len(groups) if len(groups) > 1 else 0
    if count and not update_id:
        raise InvalidArgument("update_id", "an update sent over several streams needs an update_id")
    return [itertools.chain.from_iterable(s.pieces(update_id, count, piece_bytes) for s in group) for group in groups]


class _Source(NamedTuple):
    """One tensor or file of an update: its size and its pieces `(update_id, streams, piece_bytes)`."""

    nbytes: int
    pieces: Callable[[str, int, int], Iterator[EncodedPiece]]


def _sources(weights: Weights | None, draft: bool, draft_weights: Weights | None) -> list[_Source]:
    sources: list[_Source] = []
    for source, to_draft in ((weights, draft), (draft_weights, True)):
        if isinstance(source, str | Path):
            files = enumerate(safetensors_files(Path(source)))
            sources += [_Source(file.stat().st_size, partial(_file_pieces, i, file, to_draft)) for i, file in files]
        elif source is not None:
            sources += [_Source(t.numel() * t.element_size(), partial(_tensor_pieces, name, t, to_draft))
                        for name, t in source.items()]  # fmt: skip
    return sources


def _balanced(sources: list[_Source], streams: int) -> list[list[_Source]]:
    """At most `streams` non-empty groups of `sources` with about equal bytes (one empty group for
    no sources), each in the sources' order."""
    if len(sources) <= 1 or streams == 1:
        return [sources]
    loads = [[0, g] for g in range(min(streams, len(sources)))]  # [bytes, group]
    members: list[list[int]] = [[] for _ in loads]
    for i in sorted(range(len(sources)), key=lambda i: -sources[i].nbytes):
        lightest = min(loads)
        lightest[0] += sources[i].nbytes
        members[lightest[1]].append(i)
    return [[sources[i] for i in sorted(m)] for m in members]


def encoded_ahead(pieces: Iterable[EncodedPiece]) -> Iterator[bytes]:
    """The messages of `pieces`, each encoded on a worker thread while the previous one is sent
    (see the module docstring); errors of `pieces` are raised here, in order. Closing this (or
    dropping it, as gRPC does when the call ends early) stops the worker after its current piece."""
    source = iter(pieces)

    def build() -> bytes | None:
        piece = next(source, None)
        return None if piece is None else encode_piece(piece)

    with ThreadPoolExecutor(1, thread_name_prefix="rollout-weights-encode") as worker:
        message = worker.submit(build)
        while (data := message.result()) is not None:
            message = worker.submit(build)
            yield data


def safetensors_files(path: Path) -> list[Path]:
    """The safetensors files a weights path names: the file itself, or a directory's *.safetensors
    in name order. Raises InvalidArgument("weights") when there are none."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise InvalidArgument("weights", f"{path} is neither a .safetensors file nor a directory holding some")
    return files


def _file_pieces(index: int, file: Path, draft: bool, update_id: str, streams: int,
                 piece_bytes: int) -> Iterator[EncodedPiece]:  # fmt: skip
    with open(file, "rb") as f:
        size = f.seek(0, 2)
        data = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)) if size else memoryview(b"")
    for start in range(0, max(size, 1), piece_bytes):
        yield file_piece(index, data[start : start + piece_bytes], draft, update_id, streams)


def _tensor_pieces(name: str, tensor: torch.Tensor, draft: bool, update_id: str, streams: int,
                   piece_bytes: int) -> Iterator[EncodedPiece]:  # fmt: skip
    tensor = tensor.detach()
    dtype, shape = dtype_name(tensor.dtype), tuple(tensor.shape)
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)  # [nbytes]
    views = _cuda_views(flat, piece_bytes) if flat.is_cuda else _host_views(flat, piece_bytes)
    for data in views:
        yield tensor_piece(name, dtype, shape, data, draft, update_id, streams)


def _host_views(flat: torch.Tensor, piece_bytes: int) -> Iterator[memoryview]:
    data = memoryview(flat.numpy()) if flat.numel() else memoryview(b"")
    for start in range(0, max(len(data), 1), piece_bytes):
        yield data[start : start + piece_bytes]


def _cuda_views(flat: torch.Tensor, piece_bytes: int) -> Iterator[memoryview]:
    """Pieces of a CUDA tensor through one pinned buffer: each piece is encoded (copied) before the
    next is asked for, so the buffer is reused."""
    pinned = torch.empty(min(piece_bytes, flat.numel()), dtype=torch.uint8, pin_memory=True)
    view = memoryview(pinned.numpy())
    for start in range(0, max(flat.numel(), 1), piece_bytes):
        size = min(piece_bytes, flat.numel() - start)
        pinned[:size].copy_(flat[start : start + size])
        yield view[:size]
