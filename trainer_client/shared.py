"""The trainer's side of UpdateWeightsShared: a state dict handed to a server on the same host
without sending its bytes (rollout.server.shared_weights).

CUDA tensors go as CUDA IPC handles (torch.multiprocessing's reduction of their storage, the
way colocated trainers share weights with an inference engine): the server reads them where
they are. CPU tensors are copied once into one file in /dev/shm that the server maps. The tensors
must stay alive and unchanged until the call returns (it returns once the update is applied);
the file is removed then. Both processes must run on the same host (and, for CUDA, see the same
GPU; they may number it differently).
"""

from __future__ import annotations

import mmap
import os
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch

from rollout.engine.weight_specs import ALIGN, dtype_name
from rollout.proto.rollout.v1 import rollout_pb2 as pb

SHM_DIR = Path("/dev/shm")


class SharedUpdate:
    """`with SharedUpdate(state, ...) as shared:` send `shared.request`; the /dev/shm file holding
    the CPU tensors (if any) is removed on leaving the block."""

    def __init__(self, weights: Mapping[str, torch.Tensor] | None, draft: bool = False,
                 draft_weights: Mapping[str, torch.Tensor] | None = None, update_id: str = ""):  # fmt: skip
        items = [(draft, n, t.detach()) for n, t in (weights or {}).items()]
        items += [(True, n, t.detach()) for n, t in (draft_weights or {}).items()]
        self.path: Path | None = None
        offsets = self._write_host([(d, n, t) for d, n, t in items if not t.is_cuda])
        tensors = [_shared_tensor(d, n, t, self.path, offsets.get((d, n), 0)) for d, n, t in items]
        self.request = pb.SharedWeights(tensors=tensors, update_id=update_id)

    def _write_host(self, items: list[tuple[bool, str, torch.Tensor]]) -> dict[tuple[bool, str], int]:
        """Copies the CPU tensors into one new /dev/shm file; their offsets in it."""
        if not items:
            return {}
        offsets, total = {}, 0
        for draft, name, tensor in items:
            offsets[(draft, name)] = total
            total += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
        self.path = SHM_DIR / f"rollout-weights-{uuid.uuid4().hex}"
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(total, 1))  # (fails cleanly where /dev/shm is too small)
            buffer = torch.frombuffer(mmap.mmap(fd, max(total, 1)), dtype=torch.uint8)
        except BaseException:
            self.close()
            raise
        finally:
            os.close(fd)
        for draft, name, tensor in items:
            flat = tensor.contiguous().reshape(-1).view(torch.uint8)  # [nbytes]
            buffer[offsets[(draft, name)] : offsets[(draft, name)] + flat.numel()].copy_(flat)
        return offsets

    def close(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None

    def __enter__(self) -> SharedUpdate:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shared_tensor(draft: bool, name: str, tensor: torch.Tensor, path: Path | None, offset: int) -> pb.SharedTensor:
    meta = pb.TensorMeta(name=name, dtype=dtype_name(tensor.dtype), shape=tensor.shape, draft=draft)
    if not tensor.is_cuda:
        return pb.SharedTensor(meta=meta, file=pb.SharedFile(path=str(path), offset=offset))
    return pb.SharedTensor(meta=meta, cuda=cuda_ipc(tensor))


def cuda_ipc(tensor: torch.Tensor) -> pb.CudaIpcTensor:
    """The CUDA IPC fields of `tensor` (its storage's allocation handle, offsets and stride)."""
    device, handle, size, offset, ref_handle, ref_offset, event, event_sync = tensor.untyped_storage()._share_cuda_()
    return pb.CudaIpcTensor(
        device_uuid=str(torch.cuda.get_device_properties(device).uuid), handle=handle, storage_size_bytes=size,
        storage_offset_bytes=offset, ref_counter_handle=ref_handle, ref_counter_offset=ref_offset,
        event_handle=event or b"", event_sync_required=event_sync, tensor_offset=tensor.storage_offset(),
        stride=tensor.stride(),
    )  # fmt: skip
