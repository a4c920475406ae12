"""Shared-prefix attention, host side: which running sequences of a step share leading KV blocks
(numpy on the step's padded block table; no torch), and the plan the kernel runs (its work items:
prefix_items.py; its launch parameters: prefix_launch.py).

RL sends n samples of every prompt. Forked samples hold the prompt's full blocks by reference,
and the prefix cache hands the same blocks to any request with the same leading tokens, so
sequences of one step often have the same physical block ids at the same leading columns of
their block tables (prompt blocks only: those are the only blocks either shares, so only the
columns of each sequence's prompt are compared). Those keys are read once for all the queries
of the sequences that share them (Hydragen / cascade attention); each sequence's own remainder
is read either inside its group's items (fused, `LaunchConfig.fuse_suffix`) or alone; partial
results are merged by their log-sum-exp.

Units. A *shared unit* is a set of >= 2 sequences and a key range [lo, hi) that all of them hold
in the same blocks; the keys [suffix_lo, ctx) past a sequence's last kept group are its own. Two
levels of sharing are planned: the *top* group (every sequence holding the same first block: a
system prompt, or one prompt's samples) and the *bottom* group inside it (the sequences holding
the same deepest shared block: one prompt's samples under a common system prompt). A top group's
range is [0, e_top), a bottom group's [e_top, e_bottom) (or [0, e_bottom) when its top is not
kept). Deeper nesting (three or more levels, e.g. turns of one conversation) folds into the
bottom group, whose members then re-read the intermediate blocks per bottom group: correct, less
sharing. Every range end is clamped to the first query position of every member, so shared keys
precede every query of the group (they were written in earlier steps, and need no causal mask);
that clamp is also what lets a range end mid-block, should sequences ever share a block that is
not full (today's block manager shares only full, computed blocks). A group is kept only where
the H200 measured sharing to win (`SHARE_RULE` in prefix_launch.py: enough members for its shared
keys, a short enough query; its members otherwise read their whole context alone) and the key
reads it saves outweigh the partial results it may add: `(members - 1) * keys > members * q_max
* groups` (writing and merging a query's partial results moves about as many bytes as `groups`
keys; see `_worth`). A whole step runs the plain kernel where its launch parameters say so
(`LaunchConfig.enabled`, per decode / verify step) or no group is kept.

Only decode and verify rows share (at most MAX_SHARED_QUERY_LEN queries); a prefill chunk reads
its whole context alone, in causal row tiles. Capacities (`partial_rows_cap`, `items_cap`,
`segments_cap`) bound every array by the step's token count, so a CUDA graph captured for a
padded token count holds any plan of a smaller step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from rollout.engine import prefix_launch  # DEFAULT_LAUNCH read when an engine is built (benchmarks set it)
from rollout.engine.prefix_items import (
    ITEM_FIELDS,
    SEG_FIELDS,
    Segments,
    UnitArrays,
    chunk_size,
    fused_segments,
    lookup,
    partial_slots,
    work_items,
)
from rollout.engine.prefix_launch import (
    DEFAULT_LAUNCH,
    MAX_FUSED_SEGMENTS,
    SHARE_RULE,
    GroupRule,
    LaunchConfig,
    LaunchConfigs,
    ShareRule,
    lone_launch,
    max_segments,
)

MIN_BLOCK_M = 16  # the smallest row tile tl.dot takes
MAX_SHARED_QUERY_LEN = 64  # decode and verify rows share; longer prefill chunks attend alone
# partial rows a plan may use: PARTIALS_PER_TOKEN per query token (3 units, and chunks of them)
# plus SPLIT_ROWS (a few tokens whose long keys are cut into many chunks)
PARTIALS_PER_TOKEN = 5
SPLIT_ROWS = 1024

__all__ = ["ITEM_FIELDS", "SEG_FIELDS", "HostPlan", "PlanArrays", "SharedPrefixPlanner", "planner_for"]


class PlanArrays(NamedTuple):
    """A plan's int64 arrays, host numpy arrays until the step's one upload makes them device tensors
    (rollout.engine.transfer.upload_groups; `items` arrives flat)."""

    item_counts: np.ndarray  # [2] shared units' items, all items
    items: np.ndarray  # [W, 13] fields ITEM_FIELDS
    segments: np.ndarray  # [NS, 5] fields SEG_FIELDS
    unit_tokens: np.ndarray  # [U]
    part_start: np.ndarray  # [T]
    part_count: np.ndarray  # [T]


@dataclass
class HostPlan:
    """One step's shared-prefix plan as host arrays (uploaded with the step's other indices)."""

    items: np.ndarray  # [W, 13] int64, fields ITEM_FIELDS, shared units' items first
    num_shared_items: int  # items[:num_shared_items] have config.block_m rows, the rest suffix_block_m
    config: LaunchConfig
    suffix_block_m: int
    max_query_len: int  # the step's longest query (1: a decode step)
    segments: np.ndarray  # [NS >= 1, 5] int64 fused suffix segments, fields SEG_FIELDS
    unit_tokens: np.ndarray  # [U] int64 tokens of the shared units, unit after unit
    part_start: np.ndarray  # [T] int64 first partial row of each token (unused when direct)
    part_count: np.ndarray  # [T] int64 partial rows of each token; 1 = written directly
    num_partial_rows: int
    shared_keys: int  # keys read by shared units (once each), for benchmarks
    plain_keys: int  # keys the same units' members would read one by one

    def arrays(self) -> PlanArrays:
        """The arrays the device plan (prefix_attention.SharedPrefixPlan) reads."""
        return PlanArrays(np.array([self.num_shared_items, len(self.items)], np.int64), self.items, self.segments,
                          self.unit_tokens, self.part_start, self.part_count)


@dataclass(frozen=True)
class SharedPrefixPlanner:
    """Plans shared-prefix attention for one model shape (see the module docstring)."""

    block_size: int
    groups: int  # query heads per KV head
    num_kv_heads: int
    launch: LaunchConfigs = DEFAULT_LAUNCH
    rule: ShareRule = SHARE_RULE  # which groups share (measured: prefix_launch.SHARE_RULE)

    def partial_rows_cap(self, num_tokens: int) -> int:
        """Most partial rows a plan of `num_tokens` query tokens uses (buffers of a CUDA graph)."""
        return PARTIALS_PER_TOKEN * num_tokens + SPLIT_ROWS

    def items_cap(self, num_tokens: int) -> int:
        """Most work items a plan of `num_tokens` query tokens has: each item covers at least one
        (token, slot) pair, and a tile boundary may split one token's heads over two items."""
        return (self.partial_rows_cap(num_tokens) + num_tokens) * self._tiles_per_token()

    def segments_cap(self, num_tokens: int) -> int:
        """Most fused segments: one per row tile a sequence has rows in (and a placeholder)."""
        return num_tokens * self._tiles_per_token() + 1

    def _tiles_per_token(self) -> int:
        return -(-self.groups // MIN_BLOCK_M) + 1

    def config(self, max_query_len: int) -> LaunchConfig:
        """A step's launch parameters: the table's, with fusion off where a row tile could hold
        more sequences than MAX_FUSED_SEGMENTS (e.g. one query head per KV head)."""
        config = self.launch.pick(max_query_len)
        if config.fuse_suffix and max_segments(config.block_m, self.groups) > MAX_FUSED_SEGMENTS:
            return replace(config, fuse_suffix=False)
        return config

    def suffix_block_m(self, max_query_len: int) -> int:
        """Rows of a lone unit's tile: a sequence's query rows, as a power of two in [16, block_m]."""
        rows = max_query_len * self.groups
        return min(self.config(max_query_len).block_m, max(MIN_BLOCK_M, 1 << (rows - 1).bit_length()))

    def plan(self, table: np.ndarray, starts, q_lens, prompt_lens) -> HostPlan | None:
        """table: [S, W] the step's padded block tables; starts[s]: computed tokens before this
        step (its first query position); q_lens[s]: its query tokens; prompt_lens[s]: its prompt
        tokens (forks and the prefix cache share prompt blocks only, so only those are compared).
        None when no group is worth sharing or the step's launch parameters turn sharing off (the
        plain kernel runs)."""
        starts = np.asarray(starts, dtype=np.int64)  # [S]
        q = np.asarray(q_lens, dtype=np.int64)  # [S]
        if not self.config(int(q.max())).enabled:
            return None
        shareable = np.minimum(starts, np.asarray(prompt_lens, dtype=np.int64))  # [S] keys before the queries
        units = _shared_units(table, shareable, q, self.block_size, self.groups, self.rule)
        if units is None:
            return None
        return self._work(units, starts, q)

    def _work(self, units: _Units, starts: np.ndarray, q: np.ndarray) -> HostPlan:
        config = self.config(int(q.max()))
        num_shared = len(units.lo)
        arrays, segs, lone = self._unit_arrays(units, starts, q, config)
        lone_tiles = arrays.tiles[num_shared:]
        tile_total = np.concatenate([segs.tile_total, np.repeat(arrays.range_len[num_shared:], lone_tiles)])  # [tiles]
        lens = np.maximum.reduceat(tile_total, np.cumsum(arrays.tiles) - arrays.tiles)  # [U + L] longest tile's keys
        chunks, slots = self._chunks(arrays, lens, units, lone, q, config)
        per_chunk = -(-lens // chunks)  # [U + L] even chunks, aligned to the kernel's key tile
        span = -(-per_chunk // config.block_n) * config.block_n
        tile_segs = np.concatenate([np.stack([segs.tile_start, segs.tile_count]),
                                    np.zeros((2, int(lone_tiles.sum())), np.int64)], axis=1)  # [2, tiles]
        items = work_items(arrays, chunks, span, tile_total, tile_segs, slots.first_slot, self.groups)
        segments = segs.fields if len(segs.fields) else np.zeros((1, len(SEG_FIELDS)), np.int64)
        return HostPlan(items=items, num_shared_items=int((arrays.tiles * chunks)[:num_shared].sum()), config=config,
                        suffix_block_m=self.suffix_block_m(int(q.max())), max_query_len=int(q.max()),
                        segments=segments,
                        unit_tokens=units.tokens, part_start=slots.part_start, part_count=slots.part_count,
                        num_partial_rows=slots.num_partial_rows, shared_keys=int((units.hi - units.lo).sum()),
                        plain_keys=int(((units.hi - units.lo) * units.num_members).sum()))

    def _chunks(self, arrays: UnitArrays, lens, units: _Units, lone, q, config: LaunchConfig):
        """(chunks [U + L], partial slots): about config.target_programs (item, KV head) pairs, and
        in a lone pass no lone item longer than config.lone_max_keys; fewer chunks until the plan
        fits its capacities (no chunks always fits)."""
        num_tokens = int(q.sum())
        chunk = chunk_size(int((arrays.tiles * lens).sum()), self.num_kv_heads, config)
        lone_max = config.lone_max_keys if lone_launch(config, self.suffix_block_m(int(q.max()))) else 0
        num_shared = len(units.lo)
        while True:
            chunks = np.maximum(1, (lens + chunk // 2) // chunk)  # [U + L] rounded
            if lone_max:  # a lone item is one program's serial work: long ones are cut (balance)
                chunks[num_shared:] = np.maximum(chunks[num_shared:], -(-lens[num_shared:] // lone_max))
            chunks = np.where(arrays.splittable, chunks, 1)
            slots = partial_slots(units.top, units.bottom, lone, chunks, len(units.lo), q)
            num_items = int((arrays.tiles * chunks).sum())
            if slots.num_partial_rows <= self.partial_rows_cap(num_tokens) and num_items <= self.items_cap(num_tokens):
                return chunks, slots
            chunk, lone_max = chunk * 2, lone_max * 2

    def _unit_arrays(self, units: _Units, starts, q, config: LaunchConfig) -> tuple[UnitArrays, Segments, np.ndarray]:
        """The shared units, then a lone unit for each sequence whose own keys are not fused into
        its deepest group; the fused segments; the lone units' sequences."""
        deepest = np.where(units.bottom >= 0, units.bottom, units.top)  # [S]
        fused = (deepest >= 0) & config.fuse_suffix
        lone = np.flatnonzero(~fused)  # [L]
        ctx, cu_q = starts + q, np.cumsum(q) - q
        num_shared = len(units.lo)
        block_m = np.concatenate([np.full(num_shared, config.block_m), np.full(len(lone), self.suffix_block_m(
            int(q.max())))])
        tok_count = np.concatenate([units.num_tokens, q[lone]])
        arrays = UnitArrays(
            tok_start=np.concatenate([units.token_start, cu_q[lone]]), tok_count=tok_count,
            indirect=np.concatenate([np.ones(num_shared, np.int64), np.zeros(len(lone), np.int64)]),
            table_row=np.concatenate([units.leader, lone]), key_lo=np.concatenate([units.lo, units.suffix_lo[lone]]),
            range_len=np.concatenate([units.hi - units.lo, ctx[lone] - units.suffix_lo[lone]]), block_m=block_m,
            tiles=-(-tok_count * self.groups // block_m),
            splittable=np.concatenate([np.ones(num_shared, bool), q[lone] <= MAX_SHARED_QUERY_LEN]),
            first_query=np.concatenate([np.zeros(num_shared, np.int64), starts[lone]]))
        pairs = fused[units.pair_seq] & (deepest[units.pair_seq] == units.pair_unit)
        segs = fused_segments(units.pair_unit[pairs], units.pair_seq[pairs], units.pair_offset[pairs], arrays,
                              num_shared, units.suffix_lo, cu_q, q, ctx, config.block_m, self.groups)
        return arrays, segs, lone


@dataclass
class _Units:
    """Kept shared units (top ones, then bottom ones) and each sequence's place among them."""

    lo: np.ndarray  # [U] first key of each shared unit
    hi: np.ndarray  # [U] end of its key range
    leader: np.ndarray  # [U] a member whose block-table row the unit's keys are read through
    num_members: np.ndarray  # [U]
    num_tokens: np.ndarray  # [U] query tokens of its members
    token_start: np.ndarray  # [U] offset of its tokens in `tokens`
    tokens: np.ndarray  # [sum num_tokens] the members' query tokens, unit after unit
    top: np.ndarray  # [S] kept top unit of each sequence, -1 if none
    bottom: np.ndarray  # [S] kept bottom unit of each sequence, -1 if none
    suffix_lo: np.ndarray  # [S] first key past the sequence's kept groups
    pair_unit: np.ndarray  # [P] (unit, member) pairs, unit after unit, members in sequence order
    pair_seq: np.ndarray  # [P]
    pair_offset: np.ndarray  # [P] the member's first token among its unit's tokens


def _shared_units(table: np.ndarray, shareable: np.ndarray, q: np.ndarray, block_size: int,
                  groups: int, rule: ShareRule) -> _Units | None:
    """Top and bottom groups from the blocks holding the eligible sequences' first `shareable`
    keys (see the module docstring), with the groups not worth their partial results or that
    `rule` does not admit dropped."""
    num_seqs = len(q)
    cols = np.where(q <= MAX_SHARED_QUERY_LEN, -(-shareable // block_size), 0)  # [S]
    width = int(cols.max(initial=0))
    if width == 0:
        return None
    sub = table[:, :width]  # [S, C]
    valid = np.arange(width)[None, :] < cols[:, None]  # [S, C]
    holders = np.bincount(sub[valid])[np.where(valid, sub, 0)] * valid  # [S, C] eligible holders of each block
    depth = _leading_run(holders >= 2)  # [S] leading blocks shared with someone
    has = depth > 0
    if not has.any():
        return None
    top = _group_ids(np.where(has, sub[:, 0], -1))  # [S]
    deepest = sub[np.arange(num_seqs), np.maximum(depth - 1, 0)]
    bottom = _group_ids(np.where(has & (top >= 0), top * (int(table.max()) + 1) + deepest, -1))
    top_end = _group_end(top, sub, valid, shareable, block_size)
    bottom_end = _group_end(bottom, sub, valid, shareable, block_size)
    top_size, bottom_size = _group_sizes(top), _group_sizes(bottom)
    keep_top = _worth(top, top_end, top_size, q, groups, rule)  # [num top groups]
    top_of_bottom = _first_value(bottom, top)  # [num bottom groups]
    bottom_lo = np.where(keep_top[top_of_bottom], top_end[top_of_bottom], 0)
    fewer = bottom_size < top_size[top_of_bottom]  # else the same sequences: the top group covers it
    keep_bottom = fewer & _worth(bottom, bottom_end - bottom_lo, bottom_size, q, groups, rule)
    if not keep_top.any() and not keep_bottom.any():
        return None
    return _kept_units(top, bottom, keep_top, keep_bottom, top_end, bottom_lo, bottom_end, q)


def _kept_units(top, bottom, keep_top, keep_bottom, top_end, bottom_lo, bottom_end, q) -> _Units:
    num_top = int(keep_top.sum())
    top_unit = np.where(keep_top, np.cumsum(keep_top) - 1, -1)  # top group -> unit
    bottom_unit = np.where(keep_bottom, num_top + np.cumsum(keep_bottom) - 1, -1)
    seq_top, seq_bottom = lookup(top_unit, top, -1), lookup(bottom_unit, bottom, -1)  # [S]
    lo = np.concatenate([np.zeros(num_top, np.int64), bottom_lo[keep_bottom]])
    hi = np.concatenate([top_end[keep_top], bottom_end[keep_bottom]])
    member_unit = np.concatenate([seq_top, seq_bottom])  # [2S]: (unit, sequence) pairs, -1 = none
    member_seq = np.concatenate([np.arange(len(q)), np.arange(len(q))])
    order = np.argsort(np.where(member_unit >= 0, member_unit, len(lo)), kind="stable")
    order = order[member_unit[order] >= 0]  # members unit after unit, sequences in order
    unit_of, seq_of = member_unit[order], member_seq[order]
    num_units = len(lo)
    cu_q = np.concatenate([[0], np.cumsum(q)])
    num_tokens = np.bincount(unit_of, weights=q[seq_of], minlength=num_units).astype(np.int64)
    tokens = _ranges(cu_q[seq_of], q[seq_of])
    suffix_lo = np.maximum(lookup(hi, seq_top, 0), lookup(hi, seq_bottom, 0))
    token_start = np.concatenate([[0], np.cumsum(num_tokens)[:-1]])
    return _Units(lo=lo, hi=hi, leader=_first_value(unit_of, seq_of, num_units),
                  num_members=np.bincount(unit_of, minlength=num_units), num_tokens=num_tokens,
                  token_start=token_start, tokens=tokens, top=seq_top, bottom=seq_bottom, suffix_lo=suffix_lo,
                  pair_unit=unit_of, pair_seq=seq_of,
                  pair_offset=np.cumsum(q[seq_of]) - q[seq_of] - token_start[unit_of])


def _worth(gid: np.ndarray, keys: np.ndarray, size: np.ndarray, q: np.ndarray, groups: int,
           rule: ShareRule) -> np.ndarray:
    """[num groups] whether `rule` admits a group (its members, its `keys`, its longest query)
    and sharing its keys saves more key reads ((members - 1) * keys) than its members' partial
    results cost (a partial result per query row of each of the `groups` query heads: writing
    and reading it moves about as many bytes as `groups` keys)."""
    q_max = np.zeros(len(size), np.int64)
    np.maximum.at(q_max, gid[gid >= 0], q[gid >= 0])
    decode = (q_max <= 1) & _admitted(rule.decode, size, keys)
    verify = (q_max > 1) & (q_max <= rule.max_verify_query_len) & _admitted(rule.verify, size, keys)
    return (decode | verify) & ((size - 1) * keys > size * q_max * groups)


def _admitted(steps: tuple[GroupRule, ...], size: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """[num groups] whether any of a kind's GroupRules admits a group (its members, its keys)."""
    return np.logical_or.reduce([(size >= step.min_members) & (keys >= step.min_keys) for step in steps])


def _leading_run(mask: np.ndarray) -> np.ndarray:
    """[S, C] bool -> [S] number of leading True entries of each row."""
    return np.where(mask.all(axis=1), mask.shape[1], np.argmin(mask, axis=1))


def _group_ids(keys: np.ndarray) -> np.ndarray:
    """[S] keys (-1: none) -> [S] group ids 0.. of the keys held by >= 2 sequences, else -1."""
    gid = np.full(len(keys), -1, np.int64)
    has = keys >= 0
    _, inv, counts = np.unique(keys[has], return_inverse=True, return_counts=True)
    shared = counts[inv] >= 2
    _, gid_shared = np.unique(inv[shared], return_inverse=True)
    gid[np.flatnonzero(has)[shared]] = gid_shared
    return gid


def _group_sizes(gid: np.ndarray) -> np.ndarray:
    return np.bincount(gid[gid >= 0], minlength=int(gid.max(initial=-1)) + 1)


def _first_value(gid: np.ndarray, values: np.ndarray, num_groups: int | None = None) -> np.ndarray:
    """[num groups] the value at each group's first member (in sequence order)."""
    num_groups = int(gid.max(initial=-1)) + 1 if num_groups is None else num_groups
    out = np.zeros(num_groups, np.int64)
    members = np.flatnonzero(gid >= 0)[::-1]  # the last write wins: reversed, the first member's
    out[gid[members]] = values[members]
    return out


def _group_end(gid: np.ndarray, sub: np.ndarray, valid: np.ndarray, shareable: np.ndarray,
               block_size: int) -> np.ndarray:
    """[num groups] keys every member holds in the same blocks as the group's first member,
    clamped to every member's shareable keys (which end before its first query)."""
    num_groups = int(gid.max(initial=-1)) + 1
    members = np.flatnonzero(gid >= 0)
    leader = _first_value(gid, np.arange(len(gid)), num_groups)[gid[members]]
    same = (sub[members] == sub[leader]) & valid[members] & valid[leader]  # [M, C]
    end = np.minimum(_leading_run(same) * block_size, shareable[members])
    out = np.full(num_groups, np.iinfo(np.int64).max)
    np.minimum.at(out, gid[members], end)
    return out


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated arange(start, start + count) for each pair."""
    offsets = np.cumsum(counts) - counts
    return np.repeat(starts - offsets, counts) + np.arange(int(counts.sum()))


def planner_for(enabled: bool, backend: str, block_size: int, model_config) -> SharedPrefixPlanner | None:
    """The engine's planner, or None. Shared-prefix attention runs on the Triton backend only: the
    torch path gathers every sequence's keys into a dense copy anyway, so reading a shared block
    once would not save that."""
    if not enabled or backend != "triton":
        return None
    groups = model_config.num_attention_heads // model_config.num_key_value_heads
    return SharedPrefixPlanner(block_size, groups, model_config.num_key_value_heads, prefix_launch.DEFAULT_LAUNCH)
