"""Paged attention in plain torch: the KV cache is a pool of fixed-size blocks, each sequence
owns a block table, and one step attends a ragged, flattened batch of queries (prefill chunks,
single decode tokens and verify blocks mixed) to the keys its sequences have in the cache.

`paged_attention` writes this step's keys/values at `slot_mapping`, gathers each sequence's keys
through its block table, pads the queries to `[S, max_query_len]`, and runs torch SDPA with a
causal-by-position mask. GQA folds the query heads of one KV head into the query-length axis, so
K/V are never repeated. The per-step work that does not depend on the layer (scatter indices,
mask) is built once per `AttentionMetadata` and reused by every layer. The cache must be
allocated with zeros (never `torch.empty`): masked keys still enter the matmul, and a NaN left
in an unused block would poison the softmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from rollout.engine.prefix_attention import SharedPrefixPlan


@dataclass
class _Plan:
    """Layer-independent tensors derived from one step's metadata (built once, used by all layers)."""

    seq_ids: Tensor | None  # [T] int64: sequence of each query token (None on the decode path)
    local_ids: Tensor | None  # [T] int64: index of each query token inside its sequence
    mask: Tensor  # [S, 1, max_q, L] bool: True where a query may attend a key
    group_masks: dict[int, Tensor] = field(default_factory=dict)  # G -> [S, 1, G * max_q, L]


@dataclass
class AttentionMetadata:
    """What one forward step needs to read and write the paged KV cache.

    The queries of sequence s are `cu_seqlens_q[s]:cu_seqlens_q[s+1]` in the flattened batch; they
    sit at consecutive positions ending at `context_lens[s] - 1` (a prefill chunk, one decode
    token, or a verify block). Every sequence has at least one query token. `block_tables` needs
    at least ceil(max_context_len / block_size) columns; max_context_len may exceed the longest
    context (e.g. a CUDA-graph bucket): keys past each sequence's context_len are masked.

    The layer-independent plan (scatter indices, mask) is cached on the object at first use. To
    capture a CUDA graph over static metadata buffers, capture with an object whose plan is not
    built yet, so that the plan's ops are recorded and replayed with the buffers' new values.

    `shared`, when set, is the step's shared-prefix plan (prefix_plan.py): the Triton backend then
    reads the KV blocks that several sequences share once for all of them.
    """

    positions: Tensor  # [T] int64: absolute position of each token in its sequence
    slot_mapping: Tensor  # [T] int64: flat cache slot (block_id * block_size + offset) of each token
    cu_seqlens_q: Tensor  # [S+1] int64: offsets of each sequence's tokens in the flattened batch
    context_lens: Tensor  # [S] int64: keys of each sequence once this step's tokens are written
    block_tables: Tensor  # [S, max_blocks] int64, padded with 0
    max_query_len: int  # host int
    max_context_len: int  # host int
    block_size: int
    shared: SharedPrefixPlan | None = None
    _plan: _Plan | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if self.max_query_len <= 0 or self.max_context_len < self.max_query_len:
            raise ValueError(
                f"need 0 < max_query_len <= max_context_len, got {self.max_query_len}, {self.max_context_len}"
            )
        if self.block_tables.shape[1] * self.block_size < self.max_context_len:
            raise ValueError(
                f"block_tables has {self.block_tables.shape[1]} columns of {self.block_size} slots, "
                f"fewer than max_context_len {self.max_context_len}"
            )

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def is_decode(self) -> bool:
        """Every sequence has exactly one query token."""
        return self.max_query_len == 1

    def plan(self) -> _Plan:
        """The layer-independent scatter indices and mask of this step, built on first use."""
        if self._plan is None:
            self._plan = _decode_plan(self) if self.is_decode else _ragged_plan(self)
        return self._plan


def _key_positions(meta: AttentionMetadata) -> Tensor:
    # key_pos: [L]
    return torch.arange(meta.max_context_len, device=meta.context_lens.device)


def _decode_plan(meta: AttentionMetadata) -> _Plan:
    mask = _key_positions(meta)[None, :] < meta.context_lens[:, None]  # [S, L]
    return _Plan(seq_ids=None, local_ids=None, mask=mask[:, None, None, :])


def _ragged_plan(meta: AttentionMetadata) -> _Plan:
    num_tokens = meta.slot_mapping.shape[0]
    device = meta.context_lens.device
    q_lens = meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]  # [S]
    seq_ids = torch.repeat_interleave(
        torch.arange(meta.num_seqs, device=device), q_lens, output_size=num_tokens
    )
    local_ids = torch.arange(num_tokens, device=device) - meta.cu_seqlens_q[seq_ids]  # [T]
    # Query j of sequence s sits at position context_len - q_len + j; padded rows (j >= q_len) land
    # past the context and see every key, so no row is fully masked (no NaN), and they are dropped.
    first_pos = meta.context_lens - q_lens  # [S]
    q_pos = first_pos[:, None] + torch.arange(meta.max_query_len, device=device)[None, :]  # [S, max_q]
    key_pos = _key_positions(meta)  # [L]
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (
        key_pos[None, None, :] < meta.context_lens[:, None, None]
    )
    return _Plan(seq_ids=seq_ids, local_ids=local_ids, mask=mask[:, None])


def _group_mask(plan: _Plan, groups: int) -> Tensor:
    """The ragged mask repeated for G query heads folded into the query axis (rows g * max_q + j)."""
    if groups not in plan.group_masks:
        plan.group_masks[groups] = plan.mask.repeat(1, 1, groups, 1)
    return plan.group_masks[groups]


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Store this step's keys/values. k, v: [T, Hkv, D]; caches: [NB, BS, Hkv, D]; slot_mapping: [T]."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather_kv(cache: Tensor, block_tables: Tensor, max_len: int) -> Tensor:
    """Read each sequence's first `max_len` cache rows through its block table.

    cache: [NB, BS, Hkv, D]; block_tables: [S, max_blocks] -> [S, max_len, Hkv, D]
    """
    block_size = cache.shape[1]
    num_blocks = -(-max_len // block_size)
    blocks = cache[block_tables[:, :num_blocks]]  # [S, num_blocks, BS, Hkv, D]
    return blocks.flatten(1, 2)[:, :max_len]


def paged_attention(
    q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float
) -> Tensor:
    """Write k/v into the cache, then attend every query causally to its own sequence's keys.

    q: [T, Hq, D]; k, v: [T, Hkv, D]; k_cache, v_cache: [NB, BS, Hkv, D]. Returns [T, Hq, D].
    This is the reference that triton_attention.paged_attention_triton is tested against.
    """
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    groups = num_heads // num_kv_heads
    keys = gather_kv(k_cache, meta.block_tables, meta.max_context_len).transpose(1, 2)  # [S, Hkv, L, D]
    values = gather_kv(v_cache, meta.block_tables, meta.max_context_len).transpose(1, 2)  # [S, Hkv, L, D]
    plan = meta.plan()
    if meta.is_decode:
        q_fold = q.view(num_tokens, num_kv_heads, groups, head_dim)  # [S, Hkv, G, D]
        out = F.scaled_dot_product_attention(q_fold, keys, values, attn_mask=plan.mask, scale=scale)
        return out.reshape(num_tokens, num_heads, head_dim)
    max_q = meta.max_query_len
    q_pad = q.new_zeros(meta.num_seqs, num_kv_heads, groups, max_q, head_dim)  # [S, Hkv, G, max_q, D]
    q_pad[plan.seq_ids, :, :, plan.local_ids] = q.view(num_tokens, num_kv_heads, groups, head_dim)
    q_fold = q_pad.view(meta.num_seqs, num_kv_heads, groups * max_q, head_dim)  # [S, Hkv, G*max_q, D]
    out = F.scaled_dot_product_attention(
        q_fold, keys, values, attn_mask=_group_mask(plan, groups), scale=scale
    )
    out = out.view(meta.num_seqs, num_kv_heads, groups, max_q, head_dim)[plan.seq_ids, :, :, plan.local_ids]
    return out.reshape(num_tokens, num_heads, head_dim)  # [T, Hkv, G, D] -> [T, Hq, D]
