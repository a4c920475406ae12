"""KV-cache memory: the bytes of a block and the per-layer cache tensors (how many blocks fit:
rollout/engine/memory.py)."""

from __future__ import annotations

import torch

from rollout.engine.model import ModelConfig
from rollout.engine.transfer import upload


def bytes_per_block(mcfg: ModelConfig, block_size: int, elem: int) -> int:
    """KV bytes of one block of the layers `mcfg` describes (K and V, `elem` bytes each): the
    target's, and a block drafter's for its own layers."""
    return 2 * mcfg.num_hidden_layers * block_size * mcfg.num_key_value_heads * mcfg.head_dim * elem


def allocate_kv(mcfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k_cache, v_cache) per layer, each [num_blocks, block_size, Hkv, D], zero-filled."""
    shape = (num_blocks, block_size, mcfg.num_key_value_heads, mcfg.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(mcfg.num_hidden_layers)]


def copy_blocks(caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
    """KV copy of whole blocks (src -> dst) in every layer's caches, e.g. a forked sample's
    partially filled last block."""
    device = caches[0][0].device
    src = upload([s for s, _ in pairs], torch.int64, device)
    dst = upload([d for _, d in pairs], torch.int64, device)
    for k_cache, v_cache in caches:
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]
