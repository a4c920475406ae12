"""Giving the engine's device memory to a colocated trainer between rollouts, and taking it back.

`release` (only while the engine is idle: nothing admitted, no update draining) frees the KV
caches (the target's and the drafter's), the CUDA graphs with their memory pool, and, with
`weights`, moves every parameter to page-locked host memory and frees its device copy; torch's
cache is then emptied so the driver can hand the memory to another process. Cached prompt
prefixes are forgotten (their KV is gone). While released, a new request is refused
(`Unavailable`: gRPC UNAVAILABLE), or, when released with `hold`, waits in the queue until
`resume`; a weight update still applies (to the host copies when the weights are there).
`resume` copies the weights back, allocates the KV caches again (same number of blocks) and lets
CUDA graphs be captured anew as steps need them. On CPU the same path runs: the KV caches are
freed and reallocated; the weights already live in host memory and stay.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rollout.engine.kv import allocate_kv
from rollout.engine.weight_specs import ALIGN
from rollout.engine.weight_stage import page_lock
from rollout.errors import FailedPrecondition, Unavailable


@dataclass(frozen=True)
class MemoryReport:
    """What a release or resume did: `bytes` of device memory freed or taken (on CPU: the KV
    caches' bytes), the device's free bytes afterwards (0 on CPU) and how long it took."""

    released: bool
    weights_offloaded: bool
    bytes: int
    device_free_bytes: int
    seconds: float


class DeviceMemory:
    def __init__(self, engine):
        self.engine = engine
        self.released = False
        self.hold = False
        self._host_weights: dict[int, torch.Tensor] = {}  # id(parameter) -> its host copy while released
        self._unlock = None  # unlocks the host copies' page-locked memory

    def check_admission(self) -> None:
        """Raises Unavailable for a request arriving while released (unless released with `hold`)."""
        if self.released and not self.hold:
            raise Unavailable("memory: the engine's device memory is released (ReleaseMemory) for training; "
                              "call ResumeMemory first, or release with hold_requests to queue requests")

    def release(self, weights: bool, hold: bool) -> MemoryReport:
        eng, start = self.engine, time.perf_counter()
        if self.released:
            return self.report(0, start)
        if eng.scheduler.has_unfinished() or eng.weights.pending:
            raise FailedPrecondition("memory: requests are running or a weight update is draining; release "
                                     "between rollouts")
        before = self._held()
        eng.kv_caches, eng.graphs = [], None
        if eng.drafter is not None:
            eng.drafter.caches, eng.drafter.graphs = [], None
        eng.block_manager.reset_prefix_cache()
        if weights and eng.device.type == "cuda":
            self._offload()
        self.released, self.hold = True, hold
        _empty_cache(eng.device)
        return self.report(before - self._held(), start)

    def resume(self) -> MemoryReport:
        eng, start = self.engine, time.perf_counter()
        if not self.released:
            return self.report(0, start)
        before = self._held()
        self._restore()
        num_blocks, mcfg = eng.block_manager.num_blocks, eng.loaded.config
        eng.kv_caches = allocate_kv(mcfg, num_blocks + 1, eng.config.block_size, eng.device,
                                    eng.model.embed_tokens.weight.dtype)  # fmt: skip
        if eng.drafter is not None:
            eng.drafter.allocate(num_blocks + 1, eng.config.block_size)
        if eng.device.type == "cuda" and eng.config.cuda_graphs:
            eng.graphs = eng.make_step_graphs(capture=True)
        self.released, self.hold = False, False
        _synchronize(eng.device)
        return self.report(self._held() - before, start)

    def report(self, nbytes: int, start: float) -> MemoryReport:
        device = self.engine.device
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
        return MemoryReport(self.released, bool(self._host_weights), nbytes, free, time.perf_counter() - start)

    def _parameters(self) -> list[torch.nn.Parameter]:
        models = [self.engine.model, getattr(self.engine.drafter, "model", None)]
        unique = {id(p): p for m in models if m is not None for p in m.parameters()}
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

    def _restore(self) -> None:
        for param in self._parameters():
            if id(param) in self._host_weights:
                param.data = self._host_weights[id(param)].to(self.engine.device, non_blocking=True)
        _synchronize(self.engine.device)
        if self._unlock is not None:  # (before the host copies, and with them their memory, go)
            self._unlock()
            self._unlock = None
        self._host_weights = {}

    def _held(self) -> int:
        """Device memory the engine holds: torch's reserved bytes on CUDA, the KV caches' on CPU."""
        eng = self.engine
        if eng.device.type == "cuda":
            return torch.cuda.memory_reserved(eng.device)
        caches = list(eng.kv_caches) + list(getattr(eng.drafter, "caches", []))
        return sum(t.numel() * t.element_size() for pair in caches for t in pair)


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
