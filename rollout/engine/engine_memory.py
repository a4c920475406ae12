"""The engine's device memory (LLMEngine's part): the KV pool's size, planned from a profile of the
largest step on CUDA (rollout.engine.memory, rollout.engine.profile), its allocation for the target
and the drafter, and its release to a trainer between rollouts and return
(rollout.engine.release: what is freed, held and refused meanwhile)."""

from __future__ import annotations

import logging
import time

import torch

from rollout.engine import memory, profile
from rollout.engine.kv import allocate_kv, bytes_per_block
from rollout.engine.release import MemoryReport
from rollout.errors import FailedPrecondition

log = logging.getLogger(__name__)


class EngineMemory:
    """LLMEngine's device-memory methods; they read the engine's config, device, model, drafter,
    block manager, weights, pipeline and memory (a ReleasedMemory), and set its KV caches and CUDA
    graphs."""

    def _plan_kv_blocks(self, max_model_len: int) -> int:
        """KV blocks for the pool (see rollout.engine.memory): on CUDA what the profile of the largest
        step leaves under gpu_memory_fraction (or num_kv_blocks, when that fits), on CPU
        num_kv_blocks or cpu_kv_bytes."""
        config, per_block = self.config, self._bytes_per_block()
        if self.device.type != "cuda":
            return config.num_kv_blocks or memory.cpu_kv_blocks(config.cpu_kv_bytes, per_block)
        measured = self.memory_plan = profile.measure(self, max_model_len)
        log.info("memory plan: %s held, largest step %s (%s), CUDA graphs %s", memory.gib(measured.held),
                 memory.gib(measured.step), measured.step_setting, memory.gib(measured.graphs))
        planned = memory.gpu_kv_blocks(measured, config.gpu_memory_fraction, per_block) - 1  # the scratch block
        return memory.choose_kv_blocks(config, planned)

    def _bytes_per_block(self) -> int:
        """KV bytes of one block, the target's and the drafter's."""
        per_block = bytes_per_block(self.loaded.config, self.config.block_size,
                                    self.model.embed_tokens.weight.element_size())
        return per_block + (self.drafter.bytes_per_block(self.config.block_size) if self.drafter else 0)

    def _allocate_kv(self, num_blocks: int) -> None:
        """The target's and the drafter's KV caches, one more block than the manager hands out: the
        scratch block of padded graph rows."""
        self.kv_caches = allocate_kv(self.loaded.config, num_blocks + 1, self.config.block_size, self.device,
                                     self.model.embed_tokens.weight.dtype)
        if self.drafter is not None:
            self.drafter.allocate(num_blocks + 1, self.config.block_size)

    def release_memory(self, weights: bool = False, hold: bool = False) -> MemoryReport:
        """Frees the KV caches, the CUDA graphs and, with `weights`, the weights' device memory for a
        trainer (rollout.engine.release); requests are refused meanwhile, or held with `hold`.
        FailedPrecondition while requests run or an update drains; a no-op when released already."""
        start = time.perf_counter()
        if self.memory.released:
            return self.memory.report(0, start)
        if self.scheduler.has_unfinished() or self.weights.pending:
            raise FailedPrecondition("memory: requests are running or a weight update is draining; release "
                                     "between rollouts")
        before = self._device_bytes()
        self.pipeline.take()  # a step left in flight holds only discarded slots (its samples were aborted)
        self.pipeline.take_held()  # (the same)
        self.kv_caches, self.graphs = [], None
        if self.drafter is not None:
            self.drafter.free()
        self.block_manager.reset_prefix_cache()  # (their KV is gone)
        self.memory.enter(weights, hold)
        self.weights.host_staging = True  # the device is the trainer's meanwhile
        return self.memory.report(before - self._device_bytes(), start)

    def resume_memory(self) -> MemoryReport:
        """Takes the memory back: the weights, the KV pool of the planned size, the CUDA graphs.
        ResourceExhausted, still released, when the device has no room for them yet."""
        start = time.perf_counter()
        if not self.memory.released:
            return self.memory.report(0, start)
        plan_graphs = self.memory_plan.graphs if self.memory_plan is not None and self.config.cuda_graphs else 0
        self.memory.check_room(self._bytes_per_block() * (self.block_manager.num_blocks + 1) + plan_graphs)
        before = self._device_bytes()
        self.memory.restore_weights()
        self._allocate_kv(self.block_manager.num_blocks)
        if self.device.type == "cuda" and self.config.cuda_graphs:
            self.graphs = self.make_step_graphs(capture=True)
        self.memory.resumed()
        self.weights.host_staging = False
        return self.memory.report(self._device_bytes() - before, start)

    def _device_bytes(self) -> int:
        """Device memory the engine holds: torch's reserved bytes on CUDA, the KV caches' on CPU."""
        if self.device.type == "cuda":
            return torch.cuda.memory_reserved(self.device)
        return self._bytes_per_block() * (self.block_manager.num_blocks + 1) if self.kv_caches else 0
