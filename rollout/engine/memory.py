"""The KV pool's size, planned rather than hoped for.

On CUDA the pool gets what is left of `gpu_memory_fraction` of the device once everything else a
running engine may need is accounted for: what is held (weights, the CUDA context, workspaces,
other processes), the transient peak of the largest step the configuration admits, and the CUDA
graph pools. rollout/engine/profile.py measures those by running such steps at startup, the way
vLLM and SGLang profile a dummy forward; this module is the arithmetic on the measurements, pure,
so it is tested on CPU. On CPU the pool is `cpu_kv_bytes`. A setting that cannot fit is refused
here with InvalidArgument naming it: a step that does not fit next to the weights, a pool that
cannot hold one sequence of an explicit `max_model_len`, a `num_kv_blocks` larger than what fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout.engine.config import EngineConfig
from rollout.errors import InvalidArgument

MIN_BLOCKS = 2  # one block for a sequence and one to fork or copy into


@dataclass(frozen=True)
class DeviceMemory:
    """What the profile measured, in bytes."""

    total: int  # the device's memory
    held: int  # in use once the profile's transient memory is freed: weights, context, other processes
    step: int  # the largest step's transient peak above `held`
    graphs: int  # the CUDA graph sets' static buffers and pools (their largest forwards); 0 without graphs
    step_setting: str  # the setting that sizes the largest step (its section of the profile)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def gpu_kv_blocks(mem: DeviceMemory, fraction: float, bytes_per_block: int) -> int:
    """KV blocks that fit in fraction x total next to what is held, the largest step and the graph
    pools (not counting the graphs' scratch block, which the caller adds)."""
    cap = int(fraction * mem.total)
    if mem.held + MIN_BLOCKS * bytes_per_block > cap:
        raise InvalidArgument("gpu_memory_fraction", f"{gib(mem.held)} are in use with the weights loaded, "
                              f"which leaves no KV cache in {fraction} of the device's {gib(mem.total)}")
    if mem.held + mem.step + MIN_BLOCKS * bytes_per_block > cap:
        raise InvalidArgument(mem.step_setting, f"the largest step it admits needs {gib(mem.step)} next to the "
                              f"{gib(mem.held)} held (weights), more than the {gib(cap)} of gpu_memory_fraction "
                              f"{fraction} leaves with a KV cache: lower {mem.step_setting}")
    budget = cap - mem.held - mem.step - mem.graphs
    if budget < MIN_BLOCKS * bytes_per_block:
        raise InvalidArgument("cuda_graphs", f"the CUDA graph pools need {gib(mem.graphs)} next to the largest step "
                              f"({gib(mem.step)}) and the weights ({gib(mem.held)}), more than the {gib(cap)} of "
                              f"gpu_memory_fraction {fraction}: run without CUDA graphs or lower {mem.step_setting}")
    return budget // bytes_per_block


def cpu_kv_blocks(budget: int, bytes_per_block: int) -> int:
    """KV blocks of `cpu_kv_bytes`."""
    blocks = budget // bytes_per_block
    if blocks < MIN_BLOCKS:
        raise InvalidArgument("cpu_kv_bytes", f"{budget} B hold {blocks} KV block(s) of {bytes_per_block} B; "
                              f"at least {MIN_BLOCKS} are needed")
    return blocks


def choose_kv_blocks(config: EngineConfig, planned: int) -> int:
    """`num_kv_blocks` when set (refused when more than the `planned` that fit), else `planned`."""
    if config.num_kv_blocks is None:
        return planned
    if config.num_kv_blocks > planned:
        raise InvalidArgument("num_kv_blocks", f"{config.num_kv_blocks} blocks do not fit next to the weights and "
                              f"the largest step: at most {planned} do")
    return config.num_kv_blocks


def context_limits(config: EngineConfig, max_position_embeddings: int, drafter_limit: int | None) -> dict[str, int]:
    """What bounds a sequence's length (prompt + output) before the pool is sized, by name: the
    model's positions (or `max_model_len` instead) and a drafter's (its draft block after the last
    anchor must fit in its positions too: max_position_embeddings - block + 2, 4090 for 4096 and a
    block of 8). The profile sizes steps for the smallest."""
    limits = {"max_model_len_by_flag": config.max_model_len} if config.max_model_len else {
        "max_model_len_by_model": max_position_embeddings}
    if drafter_limit:
        limits["max_model_len_by_drafter"] = drafter_limit
    return limits


def kv_cache_limit(config: EngineConfig, num_blocks: int) -> int:
    """The longest sequence a pool of `num_blocks` holds (one block stays free for a fork's copy).
    An explicit `max_model_len` the pool cannot hold is refused."""
    room = (num_blocks - 1) * config.block_size
    if config.max_model_len is not None and config.max_model_len > room:
        raise InvalidArgument("max_model_len", f"{config.max_model_len} tokens need "
                              f"{-(-config.max_model_len // config.block_size) + 1} KV blocks of "
                              f"{config.block_size} tokens, the pool holds {num_blocks}: lower max_model_len or "
                              f"give the KV cache more memory")
    return room
