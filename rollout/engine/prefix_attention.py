"""Shared-prefix attention, device side: the plan the kernel reads (`SharedPrefixPlan`), its static
buffers for CUDA graphs (`StaticSharedPrefix`), and the torch reference of the computation. What it
promises (plain attention's output): docs/attention.md.

A step whose sequences share leading KV blocks (prefix_plan.py says how they are found and cut into
work items) attends in two passes. Pass 1 runs every work item: the query rows of a unit's tokens
against a key range of one block-table row, with an online softmax, giving a partial result per
(token, query head): the normalised output o and the log-sum-exp lse of its scores. Pass 2 merges
each token's partial results: out = sum_p exp(lse_p - m) o_p / sum_p exp(lse_p - m), m = max lse_p
(the split-KV merge of flash-decoding). A token with one partial result was written directly by
pass 1; a token with none (a padded row of a CUDA graph) gets 0. (The Triton kernels of a decode
step fold pass 2 into their last pass: triton_prefix_attention.py.)

`shared_prefix_attention_reference` is that computation in plain torch, item by item: the tests
compare it and the Triton kernel (triton_prefix_attention.py) with plain paged attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from rollout.engine.prefix_items import ITEM_FIELDS, SEG_FIELDS
from rollout.engine.prefix_launch import LaunchConfig
from rollout.engine.prefix_plan import HostPlan, PlanArrays, SharedPrefixPlanner


@dataclass
class SharedPrefixPlan:
    """One step's work items on the device (AttentionMetadata.shared). Tensor rows past the step's
    own counts (a CUDA graph's padding) are never read: `item_counts` bounds the items, and padded
    query tokens have part_count 0."""

    item_counts: Tensor  # [2] int64: shared units' items, all items
    items: Tensor  # [>= item_counts[1], 13] int64, fields prefix_items.ITEM_FIELDS
    segments: Tensor  # [NS, 5] int64 fused suffix segments, fields prefix_items.SEG_FIELDS
    unit_tokens: Tensor  # [U] int64 query tokens of the shared units
    part_start: Tensor  # [T] int64 first partial row of each query token
    part_count: Tensor  # [T] int64 its partial rows (1: written directly, 0: padding, gets 0)
    num_partial_rows: int  # host values: rows of the partial-result buffers,
    max_items: int  # at least item_counts[1] (sizes the launch),
    suffix_block_m: int  # the row tile of lone units' items (SharedPrefixPlanner.suffix_block_m),
    max_query_len: int  # the step's longest query (for a graph: the one it was captured for),
    config: LaunchConfig  # and the launch parameters the plan was cut for
    _buffers: tuple[Tensor, ...] | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_host(cls, host: HostPlan, tensors: PlanArrays) -> SharedPrefixPlan:
        """`tensors`: host.arrays() on the device."""
        return cls(item_counts=tensors.item_counts, items=tensors.items.view(-1, len(ITEM_FIELDS)),
                   segments=tensors.segments.view(-1, len(SEG_FIELDS)), unit_tokens=tensors.unit_tokens,
                   part_start=tensors.part_start, part_count=tensors.part_count,
                   num_partial_rows=host.num_partial_rows, max_items=len(host.items),
                   suffix_block_m=host.suffix_block_m, max_query_len=host.max_query_len, config=host.config)

    def buffers(self, q: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Allocated once per step and reused by every layer: the partial results o [P, Hq, D] in
        q's dtype and lse [P, Hq] float32 (q: [T, Hq, D]), the item kernel's work counter [1] and
        each token's count of finished lone chunks [T] (0 before each layer: the pass that last
        reads them resets them)."""
        if self._buffers is None:
            rows = max(self.num_partial_rows, 1)
            counts = torch.zeros(1 + q.shape[0], dtype=torch.int32, device=q.device)  # one allocation
            self._buffers = (q.new_empty(rows, q.shape[1], q.shape[2]),
                             torch.empty(rows, q.shape[1], dtype=torch.float32, device=q.device), counts[:1],
                             counts[1:])
        return self._buffers


class StaticSharedPrefix:
    """Fixed device buffers a CUDA graph's shared-prefix plan lives in, sized for `max_tokens`
    query tokens: each replay copies the step's plan in (`load`); `plan` gives the plan over them
    for a padded token count and the step's longest query, with host ints that
    depend on those alone."""

    def __init__(self, planner: SharedPrefixPlanner, max_tokens: int, device: torch.device):
        self.planner = planner
        kw = dict(dtype=torch.int64, device=device)
        self.item_counts = torch.zeros(2, **kw)
        self.items = torch.zeros(planner.items_cap(max_tokens), len(ITEM_FIELDS), **kw)
        self.segments = torch.zeros(planner.segments_cap(max_tokens), len(SEG_FIELDS), **kw)
        self.unit_tokens = torch.zeros(2 * max_tokens, **kw)
        self.part_start = torch.zeros(max_tokens, **kw)
        self.part_count = torch.zeros(max_tokens, **kw)

    def load(self, plan: SharedPrefixPlan, padded_tokens: int) -> None:
        num_tokens = plan.part_count.shape[0]
        self.item_counts.copy_(plan.item_counts)
        self.items[: plan.items.shape[0]].copy_(plan.items)
        self.segments[: plan.segments.shape[0]].copy_(plan.segments)
        self.unit_tokens[: plan.unit_tokens.shape[0]].copy_(plan.unit_tokens)
        self.part_start[:num_tokens].copy_(plan.part_start)
        self.part_count[:num_tokens].copy_(plan.part_count)
        self.part_count[num_tokens:padded_tokens].fill_(0)  # padded rows: no partial result, output 0

    def plan(self, padded_tokens: int, query_len: int) -> SharedPrefixPlan:
        planner = self.planner
        return SharedPrefixPlan(
            item_counts=self.item_counts, items=self.items, segments=self.segments, unit_tokens=self.unit_tokens,
            part_start=self.part_start[:padded_tokens], part_count=self.part_count[:padded_tokens],
            num_partial_rows=planner.partial_rows_cap(padded_tokens), max_items=planner.items_cap(padded_tokens),
            suffix_block_m=planner.suffix_block_m(query_len), max_query_len=query_len,
            config=planner.config(query_len))


def shared_prefix_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                                      positions: Tensor, plan: SharedPrefixPlan, scale: float) -> Tensor:
    """The two passes in torch. q: [T, Hq, D]; caches: [NB, BS, Hkv, D] (this step's keys already
    written); block_tables: [S, W]; positions: [T]. Returns [T, Hq, D]."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    out = torch.zeros_like(q)
    part_o = q.new_zeros(max(plan.num_partial_rows, 1), num_heads, head_dim, dtype=torch.float32)
    part_lse = torch.full(part_o.shape[:2], float("-inf"), device=q.device)
    count = plan.part_count  # [T]
    for item in plan.items[: int(plan.item_counts[1])].tolist():
        tokens, heads, o, lse = _attend_item(q, k_cache, v_cache, block_tables, positions, plan, item, scale)
        direct = count[tokens] == 1  # [R]
        out[tokens[direct, None], heads[direct]] = o[direct].to(q.dtype)
        rows = plan.part_start[tokens[~direct]] + item[ITEM_FIELDS.index("slot")]
        part_o[rows[:, None], heads[~direct]] = o[~direct]
        part_lse[rows[:, None], heads[~direct]] = lse[~direct]
    merged = count != 1
    rows = plan.part_start[:, None] + torch.arange(int(count.max()), device=q.device)[None, :]  # [T, P]
    seen = rows < (plan.part_start + count)[:, None]
    lse = torch.where(seen[..., None], part_lse[rows.clamp(max=part_lse.shape[0] - 1)], float("-inf"))  # [T, P, Hq]
    weight = torch.nan_to_num(torch.softmax(lse, dim=1))  # no partial (padding): weight 0 -> output 0
    total = (weight[..., None] * part_o[rows.clamp(max=part_o.shape[0] - 1)]).sum(1)  # [T, Hq, D]
    out[merged] = total[merged].to(q.dtype)
    return out


def _attend_item(q, k_cache, v_cache, block_tables, positions, plan, item, scale):
    """One work item for every KV head: (tokens [R], heads [R, Hkv], o [R, Hkv, D], lse [R, Hkv])."""
    fields = dict(zip(ITEM_FIELDS, item, strict=True))
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    groups = q.shape[1] // num_kv_heads
    block_m = plan.config.block_m if fields["indirect"] else plan.suffix_block_m
    rows = torch.arange(fields["row0"], min(fields["row0"] + block_m, fields["tok_count"] * groups),
                        device=q.device)  # [R]
    local = fields["tok_start"] + rows // groups
    tokens = plan.unit_tokens[local] if fields["indirect"] else local
    heads = torch.arange(num_kv_heads, device=q.device)[None, :] * groups + (rows % groups)[:, None]  # [R, Hkv]
    table_row, pos, owner = _item_keys(fields, plan.segments, q.device)  # [N] each
    slots = block_tables[table_row, pos // block_size] * block_size + pos % block_size
    k = k_cache.view(-1, num_kv_heads, head_dim)[slots].float()  # [N, Hkv, D]
    v = v_cache.view(-1, num_kv_heads, head_dim)[slots].float()
    scores = torch.einsum("rhd,nhd->rhn", q[tokens[:, None], heads].float(), k) * scale  # [R, Hkv, N]
    mine = (owner[None, :, 0] <= tokens[:, None]) & (tokens[:, None] < owner[None, :, 1])  # [R, N]
    seen = mine & (pos[None, :] <= positions[tokens][:, None])
    scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [R, Hkv]; -inf where no key is seen
    p = torch.nan_to_num(torch.exp(scores - lse[..., None]))
    return tokens, heads, torch.einsum("rhn,nhd->rhd", p, v), lse


def _item_keys(fields: dict, segments: Tensor, device) -> tuple[Tensor, Tensor, Tensor]:
    """The item's virtual keys v_lo .. v_hi as (block-table row [N], position [N], tokens that
    see the key [N, 2] as a range): the unit's own keys (every token), then fused segments."""
    virtual = torch.arange(fields["v_lo"], max(fields["v_lo"], fields["v_hi"]), device=device)  # [N]
    segs = segments[fields["seg_start"]: fields["seg_start"] + fields["seg_count"]]  # [G, 5]
    starts = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), segs[:, 0]])
    which = torch.searchsorted(starts, virtual, right=True) - 1  # [N] 0: own keys, g + 1: segment g
    own = torch.tensor([[fields["table_row"], fields["key_lo"], 0, 1 << 62]], device=device)
    chosen = torch.cat([own, segs[:, 1:]])[which]  # [N, 4]: row, position offset, token range
    return chosen[:, 0], virtual + chosen[:, 1], chosen[:, 2:]


def plan_to_device(host: HostPlan, device: torch.device) -> SharedPrefixPlan:
    """A host plan on `device` on its own (tests and benchmarks; the engine uploads it with the step)."""
    arrays = host.arrays()
    tensors = arrays._make(torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays)
    return SharedPrefixPlan.from_host(host, tensors)
