"""A weight update between its arrival and its swap: the new values of the tensors it sets, held
where the swap reads them fast, and checked.

Staging runs off the engine thread while the engine keeps generating on the old weights. Its
location is spare device memory (the swap is then a device copy) or host memory (the swap is one
host-to-device copy per tensor), see `WeightUpdater.new_stage`. Checks before anything is applied:
every value finite, and a tied alias (`lm_head.weight` of a model with tied embeddings) equal to
the tensor it shares (the one in the same update, else the current parameter). Each check is one
reduction on the tensor's device; `check` then reads all the results at once (one
synchronisation per update, not one per tensor) and refuses the first failure by name.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch

from rollout.engine.weight_specs import FLOAT_DTYPES, TensorSpec
from rollout.errors import InvalidArgument

Key = tuple[bool, str]  # (drafter?, key)


def field_of(draft: bool) -> str:
    return "draft_weights" if draft else "weights"


class WeightStage:
    """Staged tensors of one update, by (drafter?, key), for an engine on `device`: staged in
    device memory (`on_device`) or in host memory. `current(draft, key)` is a parameter's value now
    (to check a tied alias that comes without the tensor it shares). Host memory staged for a CUDA
    engine is page-locked (`pin_region`) so that the swap copies at full speed; `close` unlocks it
    and drops what the stage holds once it is applied or dropped."""

    def __init__(self, device: torch.device, on_device: bool, current: Callable[[bool, str], torch.Tensor]):
        if device.type == "cuda" and device.index is None:  # ("cuda" != "cuda:0" when devices are compared)
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.location = device if on_device else torch.device("cpu")
        self._current = current
        self._pin = device.type == "cuda" and not on_device
        self._closers: list[Callable[[], None]] = []
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.tensors: dict[Key, torch.Tensor] = {}
        self.specs: dict[Key, TensorSpec] = {}
        self.names: dict[Key, str] = {}
        self.keep: list = []  # what the staged tensors view and must outlive them (mapped files)

    def _claim(self, draft: bool, key: str, name: str, spec: TensorSpec) -> None:
        if (draft, key) in self.tensors:
            raise InvalidArgument(field_of(draft), f"tensor {name!r} is sent twice")
        self.specs[(draft, key)], self.names[(draft, key)] = spec, name

    def adopt(self, draft: bool, key: str, name: str, spec: TensorSpec, tensor: torch.Tensor) -> None:
        """Stages `tensor` (the spec's shape, a floating dtype, any device): copied to the staging
        location unless it is there already or on the engine's device (a CUDA IPC tensor: the swap
        reads it where it is)."""
        self._claim(draft, key, name, spec)
        if tensor.device not in (self.location, self.device):
            with self.on_stream():
                tensor = tensor.to(self.location, non_blocking=True)
        self.tensors[(draft, key)] = tensor

    def slot(self, draft: bool, key: str, name: str, spec: TensorSpec, dtype: str) -> torch.Tensor:
        """An empty staging tensor of the spec's shape in `dtype`, for the caller to fill."""
        self._claim(draft, key, name, spec)
        with self.on_stream():
            tensor = torch.empty(spec.shape, dtype=FLOAT_DTYPES[dtype], device=self.location)
        self.tensors[(draft, key)] = tensor
        return tensor

    @property
    def pins_host(self) -> bool:
        """Host memory staged here is page-locked for the swap (a CUDA engine staging on the host)."""
        return self._pin

    @property
    def reads_host_to_device(self) -> bool:
        """Host memory given to this stage is copied to a CUDA device (now, or at the swap): page-locked
        memory copies ~8x faster than pageable."""
        return self.device.type == "cuda"

    def pin_region(self, region: torch.Tensor) -> None:
        """Page-locks the host memory of `region` (a uint8 view the staged tensors live in) until
        `close`, when this stage is host memory for a CUDA engine."""
        unlock = page_lock(region) if self.pins_host else None
        if unlock is not None:
            self._closers.append(unlock)

    def close(self) -> None:
        """Releases what `pin_region` locked and what `keep` holds (idempotent); the staged
        tensors are not used after."""
        closers, self._closers = self._closers, []
        for close in closers:
            close()
        self.tensors.clear()
        self.keep.clear()

    def on_stream(self):
        """The stage's CUDA stream as the current one (a context); nothing off CUDA. Work that fills
        staged tensors runs in it, so that `check` sees it done."""
        return torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def count(self, draft: bool) -> int:
        return sum(d == draft for d, _ in self.tensors)

    def check(self) -> None:
        """InvalidArgument naming the first tensor that is not finite, or the first tied alias that
        differs from the tensor it shares; one synchronisation for the whole update."""
        flags: list[torch.Tensor] = []
        failures: list[tuple[bool, str]] = []
        if self._stream is not None:  # (and whatever the caller's stream did: e.g. an IPC tensor's event)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with self.on_stream():
            for (draft, key), tensor in self.tensors.items():
                name = self.names[(draft, key)]
                flags.append(_finite(tensor))
                failures.append((draft, f"tensor {name!r} has values that are not finite (NaN or Inf)"))
                alias_of = self.specs[(draft, key)].alias_of
                if alias_of is not None:
                    shared = self.tensors.get((draft, alias_of))
                    flags.append(_equal(tensor, shared if shared is not None else self._current(draft, alias_of)))
                    other = self.names.get((draft, alias_of), alias_of)
                    failures.append((draft, f"tensor {name!r} is tied to {other!r} (the model shares one "
                                            f"matrix) but its values differ from it"))
            values = _to_host(flags)  # (on the staging stream: it waits for the copies and reductions)
        for ok, (draft, message) in zip(values, failures, strict=True):
            if not ok:
                raise InvalidArgument(field_of(draft), message)


def _finite(tensor: torch.Tensor) -> torch.Tensor:
    """0-dim bool on the tensor's device: every value finite (one reduction, no full-size temporary)."""
    if tensor.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    low, high = torch.aminmax(tensor)
    return torch.isfinite(low) & torch.isfinite(high)


def _equal(alias: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """0-dim bool: `alias`, in `shared`'s dtype, equals `shared` (on `shared`'s device)."""
    return torch.eq(alias.to(device=shared.device, dtype=shared.dtype), shared).all()


def _to_host(flags: list[torch.Tensor]) -> list[bool]:
    """The flags' values, with one device-to-host copy per device."""
    values: dict[int, bool] = {}
    by_device: dict[torch.device, list[int]] = {}
    for i, flag in enumerate(flags):
        by_device.setdefault(flag.device, []).append(i)
    for index in by_device.values():
        host = torch.stack([flags[i] for i in index]).tolist()
        values.update(zip(index, host))
    return [values[i] for i in range(len(flags))]


def page_lock(region: torch.Tensor) -> Callable[[], None] | None:
    """Page-locks (pins) the host memory of `region` for fast, asynchronous copies to the GPU; returns
    the call that unlocks it, or None when the driver refuses (the memory stays pageable: slower
    copies, same results)."""
    if region.numel() == 0:
        return None
    cudart, address = torch.cuda.cudart(), region.data_ptr()
    if int(cudart.cudaHostRegister(address, region.numel() * region.element_size(), 0)) != 0:
        return None
    return lambda: cudart.cudaHostUnregister(address)
