"""Shared-prefix attention, host side: which running sequences of a step share leading KV blocks,
and the list of work items the kernel runs (numpy on the step's padded block table; no torch).

RL sends n samples of every prompt. Forked samples hold the prompt's full blocks by reference,
and the prefix cache hands the same blocks to any request with the same leading tokens, so
sequences of one step often have the same physical block ids at the same leading columns of
their block tables (prompt blocks only: those are the only blocks either shares, so only the
columns of each sequence's prompt are compared). Those keys are read once for all the queries
of the sequences that share them (Hydragen / cascade attention); each sequence reads its own
remainder; the partial results are merged by their log-sum-exp.

Units. A *shared unit* is a set of >= 2 sequences and a key range [lo, hi) that all of them hold
in the same blocks; a *suffix unit* is one sequence's remaining keys [lo, ctx). Two levels of
sharing are planned: the *top* group (every sequence holding the same first block: a system
prompt, or one prompt's samples) and the *bottom* group inside it (the sequences holding the same
deepest shared block: one prompt's samples under a common system prompt). A top group's range is
[0, e_top), a bottom group's [e_top, e_bottom) (or [0, e_bottom) when its top is not kept), and
the suffix starts where the sequence's last kept group ends. Deeper nesting (three or more
levels, e.g. turns of one conversation) folds into the bottom group, whose members then re-read
the intermediate blocks per bottom group: correct, less sharing. Every range end is clamped to the
first query position of every member, so shared keys precede every query of the group (they were
written in earlier steps, and need no causal mask); that clamp is also what lets a range end
mid-block, should sequences ever share a block that is not full (today's block manager shares
only full, computed blocks). A group is kept only where the key reads it saves outweigh the
partial results it adds: `(members - 1) * keys > members * q_max * groups` (writing and merging
a query's partial results moves about as many bytes as `groups` keys; see `_worth`).

Work items. Each unit's key range is cut into chunks (only when the step has too few items to
fill the GPU: `_chunk_size`) and its query rows (token x query head of one KV head) into tiles
(SHARED_BLOCK_M rows for a shared unit; for a suffix unit the step's longest query, rounded up:
`suffix_block_m`, so that a decode row does not pay for a 64-row tile); one item is (unit rows
tile, key chunk), which the kernel runs once per KV head, shared units' items first. A
query token's partial results (one per unit chunk covering it) are stored at consecutive
*partial rows*; a token covered by a single item (no sharing, no chunking) is written straight
to the output ("direct", slot -1). Only decode and verify rows share (at most
MAX_SHARED_QUERY_LEN queries); a prefill chunk is a suffix unit over its whole context, tiled.

Capacities (`partial_rows_cap`, `items_cap`) bound every array by the step's token count, so a
CUDA graph captured for a padded token count holds any plan of a smaller step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

SHARED_BLOCK_M = 64  # query rows (token x query head of one KV head) per shared unit's item
MIN_BLOCK_M = 16  # the smallest row tile tl.dot takes
KEY_ALIGN = 64  # chunk sizes are multiples of the kernel's keys per iteration
MIN_CHUNK = 256  # keys: a chunk shorter than this is not worth its partial result
TARGET_PROGRAMS = 512  # chunk the key ranges until a step has about this many (item, KV head) programs
MAX_SHARED_QUERY_LEN = 64  # decode and verify rows share; longer prefill chunks attend alone
# partial rows a plan may use: PARTIALS_PER_TOKEN per query token (3 units, and chunks of them)
# plus SPLIT_ROWS (a few tokens whose long keys are cut into many chunks)
PARTIALS_PER_TOKEN = 5
SPLIT_ROWS = 1024
# one work item: tokens tok_start .. tok_start + tok_count (of unit_tokens when indirect, else of
# the step), query rows row0 .. row0 + block_m of them, keys [key_lo, key_hi) of block-table row
# table_row, written to partial slot `slot` of each token (-1: straight to the output)
ITEM_FIELDS = ("tok_start", "tok_count", "row0", "table_row", "key_lo", "key_hi", "slot", "indirect")


class PlanArrays(NamedTuple):
    """A plan's int64 arrays, host numpy arrays until the step's one upload makes them device tensors
    (rollout.engine.transfer.upload_groups; `items` arrives flat)."""

    item_counts: np.ndarray  # [2] shared units' items, all items
    items: np.ndarray  # [W, 8] fields ITEM_FIELDS
    unit_tokens: np.ndarray  # [U]
    part_start: np.ndarray  # [T]
    part_count: np.ndarray  # [T]


@dataclass
class HostPlan:
    """One step's shared-prefix plan as host arrays (uploaded with the step's other indices)."""

    items: np.ndarray  # [W, 8] int64, fields ITEM_FIELDS, shared units' items first
    num_shared_items: int  # items[:num_shared_items] have SHARED_BLOCK_M rows, the rest suffix_block_m
    suffix_block_m: int
    unit_tokens: np.ndarray  # [U] int64 tokens of the shared units, unit after unit
    part_start: np.ndarray  # [T] int64 first partial row of each token (unused when direct)
    part_count: np.ndarray  # [T] int64 partial rows of each token; 1 = written directly
    num_partial_rows: int
    shared_keys: int  # keys read by shared units (once each), for benchmarks
    plain_keys: int  # keys the same units' members would read one by one

    def arrays(self) -> PlanArrays:
        """The arrays the device plan (prefix_attention.SharedPrefixPlan) reads."""
        return PlanArrays(np.array([self.num_shared_items, len(self.items)], np.int64), self.items,
                          self.unit_tokens, self.part_start, self.part_count)


@dataclass(frozen=True)
class SharedPrefixPlanner:
    """Plans shared-prefix attention for one model shape (see the module docstring)."""

    block_size: int
    groups: int  # query heads per KV head
    num_kv_heads: int

    def partial_rows_cap(self, num_tokens: int) -> int:
        """Most partial rows a plan of `num_tokens` query tokens uses (buffers of a CUDA graph)."""
        return PARTIALS_PER_TOKEN * num_tokens + SPLIT_ROWS

    def items_cap(self, num_tokens: int) -> int:
        """Most work items a plan of `num_tokens` query tokens has: each item covers at least one
        (token, slot) pair, and a tile boundary may split one token's heads over two items."""
        return (self.partial_rows_cap(num_tokens) + num_tokens) * (-(-self.groups // MIN_BLOCK_M) + 1)

    def suffix_block_m(self, max_query_len: int) -> int:
        """Rows of a suffix unit's tile: a sequence's query rows, as a power of two in [16, 64]."""
        rows = max_query_len * self.groups
        return min(SHARED_BLOCK_M, max(MIN_BLOCK_M, 1 << (rows - 1).bit_length()))

    def plan(self, table: np.ndarray, starts, q_lens, prompt_lens) -> HostPlan | None:
        """table: [S, W] the step's padded block tables; starts[s]: computed tokens before this
        step (its first query position); q_lens[s]: its query tokens; prompt_lens[s]: its prompt
        tokens (forks and the prefix cache share prompt blocks only, so only those are compared).
        None when no group is worth sharing (the plain kernel runs)."""
        starts = np.asarray(starts, dtype=np.int64)  # [S]
        q = np.asarray(q_lens, dtype=np.int64)  # [S]
        shareable = np.minimum(starts, np.asarray(prompt_lens, dtype=np.int64))  # [S] keys before the queries
        units = _shared_units(table, shareable, q, self.block_size, self.groups)
        if units is None:
            return None
        return self._work(units, starts, q)

    def _work(self, units: _Units, starts: np.ndarray, q: np.ndarray) -> HostPlan:
        ctx = starts + q
        num_tokens = int(q.sum())
        lens = np.concatenate([units.hi - units.lo, ctx - units.suffix_lo])  # [U + S] keys per unit
        rows = self.groups * np.concatenate([units.num_tokens, q])  # [U + S]
        suffix_m = self.suffix_block_m(int(q.max()))
        block_m = np.where(np.arange(len(rows)) < len(units.lo), SHARED_BLOCK_M, suffix_m)  # [U + S]
        tiles = -(-rows // block_m)
        splittable = np.concatenate([np.ones(len(units.lo), bool), q <= MAX_SHARED_QUERY_LEN])
        chunk = _chunk_size(int((tiles * lens).sum()), self.num_kv_heads)
        while True:
            chunks = np.where(splittable, -(-lens // chunk), 1)  # [U + S]
            slots = _slots(units, chunks, q)
            items = int((tiles * chunks).sum())
            if slots.num_partial_rows <= self.partial_rows_cap(num_tokens) and items <= self.items_cap(num_tokens):
                break
            chunk *= 2  # fewer chunks until the plan fits its capacities (no chunks always fits)
        per_chunk = -(-lens // chunks)  # [U + S] even chunks (at most `chunk` keys once aligned)
        span = -(-per_chunk // KEY_ALIGN) * KEY_ALIGN
        work = _items(units, starts, q, block_m, chunks, span, slots, self.groups)
        return HostPlan(items=work, num_shared_items=int((tiles * chunks)[: len(units.lo)].sum()),
                        suffix_block_m=suffix_m, unit_tokens=units.tokens, part_start=slots.part_start,
                        part_count=slots.part_count, num_partial_rows=slots.num_partial_rows,
                        shared_keys=int((units.hi - units.lo).sum()),
                        plain_keys=int(((units.hi - units.lo) * units.num_members).sum()))


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
    suffix_lo: np.ndarray  # [S] first key the sequence reads alone


def _shared_units(table: np.ndarray, shareable: np.ndarray, q: np.ndarray, block_size: int,
                  groups: int) -> _Units | None:
    """Top and bottom groups from the blocks holding the eligible sequences' first `shareable`
    keys (see the module docstring), with the groups not worth their partial results dropped."""
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
    keep_top = _worth(top, top_end, top_size, q, groups)  # [num top groups]
    top_of_bottom = _first_value(bottom, top)  # [num bottom groups]
    bottom_lo = np.where(keep_top[top_of_bottom], top_end[top_of_bottom], 0)
    fewer = bottom_size < top_size[top_of_bottom]  # else the same sequences: the top group covers it
    keep_bottom = fewer & _worth(bottom, bottom_end - bottom_lo, bottom_size, q, groups)
    if not keep_top.any() and not keep_bottom.any():
        return None
    return _kept_units(top, bottom, keep_top, keep_bottom, top_end, bottom_lo, bottom_end, q)


def _kept_units(top, bottom, keep_top, keep_bottom, top_end, bottom_lo, bottom_end, q) -> _Units:
    num_top = int(keep_top.sum())
    top_unit = np.where(keep_top, np.cumsum(keep_top) - 1, -1)  # top group -> unit
    bottom_unit = np.where(keep_bottom, num_top + np.cumsum(keep_bottom) - 1, -1)
    seq_top, seq_bottom = _lookup(top_unit, top, -1), _lookup(bottom_unit, bottom, -1)  # [S]
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
    suffix_lo = np.maximum(_lookup(hi, seq_top, 0), _lookup(hi, seq_bottom, 0))
    return _Units(lo=lo, hi=hi, leader=_first_value(unit_of, seq_of, num_units),
                  num_members=np.bincount(unit_of, minlength=num_units), num_tokens=num_tokens,
                  token_start=np.concatenate([[0], np.cumsum(num_tokens)[:-1]]), tokens=tokens,
                  top=seq_top, bottom=seq_bottom, suffix_lo=suffix_lo)


def _worth(gid: np.ndarray, keys: np.ndarray, size: np.ndarray, q: np.ndarray, groups: int) -> np.ndarray:
    """[num groups] whether sharing a group's `keys` saves more key reads ((members - 1) * keys)
    than its members' partial results cost (a partial result per query row of each of the
    `groups` query heads: writing and reading it moves about as many bytes as `groups` keys)."""
    q_max = np.zeros(len(size), np.int64)
    np.maximum.at(q_max, gid[gid >= 0], q[gid >= 0])
    return (size - 1) * keys > size * q_max * groups


@dataclass
class _Slots:
    part_start: np.ndarray  # [T]
    part_count: np.ndarray  # [T]
    num_partial_rows: int
    first_slot: np.ndarray  # [U + S] slot of each unit's first chunk (-1: direct)


def _slots(units: _Units, chunks: np.ndarray, q: np.ndarray) -> _Slots:
    """A token's partial rows: its top unit's chunks, its bottom unit's, then its suffix's."""
    num_units = len(units.lo)
    unit_chunks, suffix_chunks = chunks[:num_units], chunks[num_units:]
    top_chunks = _lookup(unit_chunks, units.top, 0)  # [S]
    bottom_chunks = _lookup(unit_chunks, units.bottom, 0)
    per_seq = top_chunks + bottom_chunks + suffix_chunks  # [S]
    direct = per_seq == 1
    per_token = np.repeat(np.where(direct, 0, per_seq), q)  # [T] partial rows
    first_slot = np.zeros(num_units, np.int64)
    has_bottom = units.bottom >= 0
    first_slot[units.bottom[has_bottom]] = top_chunks[has_bottom]  # after the top unit's chunks
    return _Slots(part_start=np.cumsum(per_token) - per_token, part_count=np.repeat(per_seq, q),
                  num_partial_rows=int(per_token.sum()),
                  first_slot=np.concatenate([first_slot, np.where(direct, -1, top_chunks + bottom_chunks)]))


def _items(units: _Units, starts, q, block_m, chunks, span, slots: _Slots, groups: int) -> np.ndarray:
    """[W, 8] work items: per unit, per key chunk of span[unit] keys, per row tile of
    block_m[unit] rows (tiles of one chunk adjacent, so that they read the same keys at about
    the same time)."""
    num_units, num_seqs = len(units.lo), len(q)
    cu_q = np.concatenate([[0], np.cumsum(q)[:-1]])
    tok_start = np.concatenate([units.token_start, cu_q])  # [U + S]
    tok_count = np.concatenate([units.num_tokens, q])
    table_row = np.concatenate([units.leader, np.arange(num_seqs)])
    lo = np.concatenate([units.lo, units.suffix_lo])
    hi = np.concatenate([units.hi, starts + q])
    indirect = np.concatenate([np.ones(num_units, np.int64), np.zeros(num_seqs, np.int64)])
    tiles = -(-tok_count * groups // block_m)
    per_unit = tiles * chunks
    unit = np.repeat(np.arange(len(per_unit)), per_unit)  # [W]
    local = np.arange(len(unit)) - (np.cumsum(per_unit) - per_unit)[unit]
    c, t = local // tiles[unit], local % tiles[unit]
    key_lo = lo[unit] + c * span[unit]
    key_hi = np.minimum(key_lo + span[unit], hi[unit])
    row0 = t * block_m[unit]
    last_tok = (np.minimum(row0 + block_m[unit], tok_count[unit] * groups) - 1) // groups
    causal_end = np.where(indirect[unit] == 1, key_hi, starts[np.maximum(unit - num_units, 0)] + last_tok + 1)
    slot = np.where(slots.first_slot[unit] < 0, -1, slots.first_slot[unit] + c)
    return np.stack([tok_start[unit], tok_count[unit], row0, table_row[unit], key_lo,
                     np.minimum(key_hi, causal_end), slot, indirect[unit]], axis=1).astype(np.int64)


def _chunk_size(work: int, num_kv_heads: int) -> int:
    """Keys per chunk so that `work` (keys x row tiles over the units) makes about
    TARGET_PROGRAMS programs, at least MIN_CHUNK."""
    per_item = -(-work * num_kv_heads // TARGET_PROGRAMS)
    return max(MIN_CHUNK, -(-per_item // KEY_ALIGN) * KEY_ALIGN)


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


def _lookup(values: np.ndarray, ids: np.ndarray, default: int) -> np.ndarray:
    """values[ids], `default` where an id is -1."""
    out = np.full(len(ids), default, np.int64)
    out[ids >= 0] = values[ids[ids >= 0]]
    return out


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
