"""Reassembles an `UpdateWeights` chunk stream into state dicts for `engine.update_weights`.

Chunks carry either pieces of safetensors files (concatenated per file index, then parsed) or
named raw tensors (pieces with the same name concatenated, then viewed as dtype and shape).
Target and drafter payloads are kept apart by the chunk's `draft` flag. Anything malformed
raises InvalidArgument naming the tensor or file; names, shapes and dtypes against the model
are checked by the engine.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from safetensors.torch import load as load_safetensors

from rollout.errors import InvalidArgument
from rollout.proto.rollout.v1 import rollout_pb2 as pb

DTYPES = {
    name: getattr(torch, name)
    for name in (
        "float32",
        "float16",
        "bfloat16",
        "float64",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
    )
}


class WeightAssembler:
    """Collects chunks for one destination (target or drafter)."""

    def __init__(self, destination: str):
        self.destination = destination
        self._files: dict[int, list[bytes]] = {}
        self._tensors: dict[str, tuple[str, tuple[int, ...], list[bytes]]] = {}

    def add(self, chunk: pb.WeightChunk) -> None:
        kind = chunk.WhichOneof("payload")
        if kind == "safetensors":
            self._files.setdefault(chunk.safetensors.file, []).append(chunk.safetensors.data)
        elif kind == "tensor":
            self._add_tensor(chunk.tensor)
        else:
            raise InvalidArgument("weights", "a WeightChunk carries neither safetensors nor tensor")

    def _add_tensor(self, t: pb.Tensor) -> None:
        if t.dtype not in DTYPES:
            raise InvalidArgument(f"tensor {t.name}", f"dtype {t.dtype!r} is not one of {sorted(DTYPES)}")
        shape = tuple(t.shape)
        dtype, first_shape, parts = self._tensors.setdefault(t.name, (t.dtype, shape, []))
        if (dtype, first_shape) != (t.dtype, shape):
            raise InvalidArgument(f"tensor {t.name}", "pieces disagree on dtype or shape")
        parts.append(t.data)

    def build(self) -> dict[str, torch.Tensor]:
        """The assembled state dict; a name given twice (two files, or file and tensor) is refused."""
        state: dict[str, torch.Tensor] = {}
        for index in sorted(self._files):
            self._merge(state, _parse_file(index, b"".join(self._files[index])))
        for name, (dtype, shape, parts) in self._tensors.items():
            self._merge(state, {name: _rebuild(name, dtype, shape, b"".join(parts))})
        return state

    def _merge(self, state: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
        for name, tensor in new.items():
            if name in state:
                raise InvalidArgument(f"tensor {name}", f"sent twice for the {self.destination}")
            state[name] = tensor


def _parse_file(index: int, data: bytes) -> dict[str, torch.Tensor]:
    try:
        return load_safetensors(data)
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise InvalidArgument(f"safetensors file {index}", f"cannot be parsed: {exc}") from exc


def _rebuild(name: str, dtype: str, shape: tuple[int, ...], data: bytes) -> torch.Tensor:
    torch_dtype = DTYPES[dtype]
    numel = 1
    for dim in shape:
        numel *= dim
    expected = numel * torch.tensor([], dtype=torch_dtype).element_size()
    if len(data) != expected or any(d < 0 for d in shape):
        raise InvalidArgument(f"tensor {name}", f"{len(data)} bytes do not fill {dtype} {list(shape)}")
    if numel == 0:
        return torch.empty(shape, dtype=torch_dtype)
    return torch.frombuffer(bytearray(data), dtype=torch_dtype).reshape(shape)


def assemble(
    chunks: Iterable[pb.WeightChunk],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """Chunks -> (target state, drafter state or None when no drafter chunk came)."""
    target, draft = WeightAssembler("target"), WeightAssembler("drafter")
    saw_draft = False
    for chunk in chunks:
        saw_draft |= chunk.draft
        (draft if chunk.draft else target).add(chunk)
    state, draft_state = target.build(), (draft.build() if saw_draft else None)
    if not state and not draft_state:
        raise InvalidArgument("weights", "the update carries no tensors")
    return state, draft_state
