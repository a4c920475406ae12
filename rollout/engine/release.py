"""Giving the engine's device memory to a colocated trainer between rollouts, and taking it back.

`LLMEngine.release_memory` (only while the engine is idle: nothing admitted, no update draining)
frees the KV caches (the target's and the drafter's), the CUDA graphs with their memory pool, and,
with `weights`, moves every parameter to page-locked host memory and frees its device copy;
torch's cache is then emptied so the driver can hand the memory to another process. Cached
prompt prefixes are forgotten (their KV is gone). While released, a new request is refused
(`Unavailable`: gRPC UNAVAILABLE), or, when released with `hold`, waits in the queue until resume;
a weight update still applies (staged in host memory, applied to the host copies when the weights
are there).
`LLMEngine.resume_memory` first checks that the device has room again for what it takes back (the
weights, the KV pool of the memory plan's size, the plan's CUDA graph pools: rollout.engine.memory),
refusing with ResourceExhausted and staying released when the trainer still holds it; then copies
the weights back, allocates the KV caches (same number of blocks) and captures the CUDA graphs
anew. On CPU the same path runs: the KV caches are freed and reallocated; the weights already
live in host memory and stay.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from rollout.engine.memory import gib
from rollout.engine.weight_specs import ALIGN
from rollout.engine.weight_stage import page_lock
from rollout.errors import ResourceExhausted, Unavailable


@dataclass(frozen=True)
class MemoryReport:
    """What a release or resume did: `bytes` of device memory freed or taken (on CPU: the KV
    caches' bytes), the device's free bytes afterwards (0 on CPU) and how long it took."""

    released: bool
    weights_offloaded: bool
    bytes: int
    device_free_bytes: int
    seconds: float


class ReleasedMemory:
    """Whether the memory of an engine on `device` is released, and the host copies of the
    parameters of `modules` while they are offloaded."""

    def __init__(self, device: torch.device, modules: list[nn.Module]):
        self.device, self.modules = device, modules
        self.released = False
        self.hold = False
        self._host_weights: dict[int, torch.Tensor] = {}  # id(parameter) -> its host copy while released
        self._unlock = None  # unlocks the host copies' page-locked memory

    def check_admission(self) -> None:
        """Raises Unavailable for a request arriving while released (unless released with `hold`)."""
        if self.released and not self.hold:
            raise Unavailable("memory: the engine's device memory is released (ReleaseMemory) for training; "
                              "call ResumeMemory first, or release with hold_requests to queue requests")

    def enter(self, weights: bool, hold: bool) -> None:
        """Released from now (the caller has dropped its caches); the weights offloaded with `weights`
        on CUDA; torch's cached blocks given back to the driver."""
        if weights and self.device.type == "cuda":
            self._offload()
        self.released, self.hold = True, hold
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def check_room(self, kv_and_graphs: int) -> None:
        """ResourceExhausted unless the device has room for the offloaded weights and `kv_and_graphs`
        bytes (what a resume takes back); nothing changes."""
        if self.device.type != "cuda":
            return
        need = kv_and_graphs + sum(t.numel() * t.element_size() for t in self._host_weights.values())
        free = torch.cuda.mem_get_info(self.device)[0]
        if free < need:
            raise ResourceExhausted(f"memory: resuming needs {gib(need)} of device memory (weights, KV cache, "
                                    f"CUDA graphs), {gib(free)} are free: the trainer must give it back first")

    def restore_weights(self) -> None:
        """The weights back on the device (if offloaded)."""
        for param in self._parameters():
            if id(param) in self._host_weights:
                param.data = self._host_weights[id(param)].to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self._unlock is not None:  # (before the host copies, and with them their memory, go)
            self._unlock()
            self._unlock = None
        self._host_weights = {}

    def resumed(self) -> None:
        """Not released from now (the caller has rebuilt its caches)."""
        self.released, self.hold = False, False

    def report(self, nbytes: int, start: float) -> MemoryReport:
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        return MemoryReport(self.released, bool(self._host_weights), nbytes, free, time.perf_counter() - start)

    def _parameters(self) -> list[nn.Parameter]:
        unique = {id(p): p for m in self.modules for p in m.parameters()}
        return list(unique.values())

    def _offload(self) -> None:
        """Every parameter into one page-locked host buffer (one registration of exactly the bytes
        needed: torch's pinned allocator would round each tensor up to a power of two)."""
        params = self._parameters()
        sizes = [-(-p.numel() * p.element_size() // ALIGN) * ALIGN for p in params]
        buffer = torch.empty(sum(sizes), dtype=torch.uint8)
        self._unlock = page_lock(buffer)
        offset = 0
        for param, size in zip(params, sizes):
            host = buffer[offset : offset + param.numel() * param.element_size()].view(param.dtype).view(param.shape)
            host.copy_(param.data)
            self._host_weights[id(param)] = host
            param.data = host
            offset += size
