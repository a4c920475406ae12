"""UpdateWeightsShared: a trainer on the same host hands its tensors over without sending bytes.

Each tensor is either bytes in a file under /dev/shm (shared memory; the trainer wrote them
there, trainer_client.shared) or a CUDA tensor shared through CUDA IPC (the fields of
torch.multiprocessing's reduction of it, so nothing is unpickled). The server checks every
name, shape and dtype first (`shared_job`), then the engine's process maps the files or opens the
IPC handles (`SharedJob.stage`): a CUDA tensor on the engine's device is read in place by the
swap (no copy until then), others are staged as usual. The caller keeps its tensors alive and
unchanged until the reply, which comes after the swap.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from rollout.engine.weight_specs import FLOAT_DTYPES, TensorSpec, WeightSpecs
from rollout.engine.weight_stage import WeightStage, field_of
from rollout.errors import InvalidArgument
from rollout.proto.rollout.v1 import rollout_pb2 as pb
from rollout.server.weight_jobs import EngineSide, closed_on_error

SHARED_ROOT = Path("/dev/shm")


@dataclass(frozen=True)
class SharedEntry:
    """One tensor of the request: its name and spec, and where it is (a file, or CUDA IPC fields)."""

    draft: bool
    key: str
    name: str
    dtype: str
    spec: TensorSpec
    path: str = ""
    offset: int = 0
    cuda: bytes = b""  # a serialised CudaIpcTensor


@dataclass
class SharedJob:
    token: str
    update_id: str
    entries: list[SharedEntry]

    def stage(self, engine, side: EngineSide) -> WeightStage:
        stage = engine.weights.new_stage(sum(e.spec.nbytes for e in self.entries if not e.cuda))
        files: dict[str, memoryview] = {}
        with closed_on_error(stage):
            for e in self.entries:
                tensor = _cuda_tensor(e) if e.cuda else _file_tensor(e, files)
                stage.adopt(e.draft, e.key, e.name, e.spec, tensor)
                stage.keep.append(tensor)
            stage.check()
        return stage


def shared_job(request: pb.SharedWeights, specs: WeightSpecs, token: str) -> SharedJob:
    """The request checked against the specs (names, shapes, dtypes, locations): InvalidArgument
    naming the first tensor that does not fit, before any of them is opened."""
    entries, seen = [], set()
    for t in request.tensors:
        meta = t.meta
        key, spec = specs.check(meta.name, meta.dtype, meta.shape, meta.draft)
        if (meta.draft, key) in seen:
            raise InvalidArgument(field_of(meta.draft), f"tensor {meta.name!r} is sent twice")
        seen.add((meta.draft, key))
        where = t.WhichOneof("location")
        if where == "file":
            entries.append(SharedEntry(meta.draft, key, meta.name, meta.dtype, spec, _shared_path(meta, t.file.path),
                                       t.file.offset))  # fmt: skip
        elif where == "cuda":
            entries.append(SharedEntry(meta.draft, key, meta.name, meta.dtype, spec, cuda=t.cuda.SerializeToString()))
        else:
            raise InvalidArgument(field_of(meta.draft), f"tensor {meta.name!r} has neither a file nor a CUDA handle")
    if not entries:
        raise InvalidArgument("weights", "the update carries no tensors")
    return SharedJob(token, request.update_id, entries)


def _shared_path(meta: pb.TensorMeta, path: str) -> str:
    resolved = Path(os.path.realpath(path))
    if resolved.parent != SHARED_ROOT:
        raise InvalidArgument(field_of(meta.draft), f"tensor {meta.name!r}: {path!r} is not a file in {SHARED_ROOT}")
    return str(resolved)


def _file_tensor(e: SharedEntry, files: dict[str, memoryview]) -> torch.Tensor:
    """The entry's bytes in its file (mapped once per file and job), as its dtype and shape."""
    if e.path not in files:
        try:
            with open(e.path, "rb") as f:
                files[e.path] = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        except (OSError, ValueError) as exc:  # (ValueError: an empty file cannot be mapped)
            raise InvalidArgument(field_of(e.draft), f"tensor {e.name!r}: cannot map {e.path}: {exc}") from exc
    data, itemsize = files[e.path], FLOAT_DTYPES[e.dtype].itemsize
    nbytes = e.spec.numel * itemsize
    if e.offset < 0 or e.offset % itemsize or e.offset + nbytes > len(data):
        raise InvalidArgument(field_of(e.draft), f"tensor {e.name!r}: bytes [{e.offset}, {e.offset + nbytes}) are "
                                                 f"not {e.dtype} elements inside {e.path} ({len(data)} bytes)")
    flat = torch.frombuffer(data, dtype=torch.uint8, offset=e.offset, count=nbytes) if nbytes else torch.empty(0)
    return flat.view(FLOAT_DTYPES[e.dtype]).view(e.spec.shape)


def _cuda_tensor(e: SharedEntry) -> torch.Tensor:
    """The CUDA tensor the entry's IPC fields describe (opened in this process)."""
    ipc = pb.CudaIpcTensor.FromString(e.cuda)
    device = _local_device(ipc.device_uuid, e)
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            device, ipc.handle, ipc.storage_size_bytes, ipc.storage_offset_bytes, ipc.ref_counter_handle,
            ipc.ref_counter_offset, ipc.event_handle or None, ipc.event_sync_required,
        )  # fmt: skip
        tensor = torch.empty(0, dtype=FLOAT_DTYPES[e.dtype], device=f"cuda:{device}")
        return tensor.set_(storage, ipc.tensor_offset, e.spec.shape, tuple(ipc.stride))
    except RuntimeError as exc:  # a handle that does not open, a view outside its storage
        raise InvalidArgument(field_of(e.draft), f"tensor {e.name!r}: its CUDA IPC handle does not open here: "
                                                 f"{exc}") from exc


def _local_device(uuid: str, e: SharedEntry) -> int:
    """This process's index of the GPU whose UUID is `uuid` (processes may number GPUs differently)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for index in range(count):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise InvalidArgument(field_of(e.draft), f"tensor {e.name!r}: GPU {uuid} is not visible to the server")
