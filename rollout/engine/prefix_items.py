"""Shared-prefix attention, host side, part 2: the work items, fused suffix segments and partial
rows of one step, from its units (prefix_plan.py finds the units; numpy only, no torch).

Units. Every shared unit (a group's sequences and the key range they hold in the same blocks)
and every *lone unit* (one sequence's keys that no group covers: [suffix_lo, ctx), all of its
context when it shares nothing) is one unit. With `fuse_suffix` a group member has no lone unit:
its own keys [suffix_lo, ctx) are a *segment* of its deepest unit (the bottom group when it has
one, else the top), read by the same items as the group's keys but seen only by its own rows.

Virtual keys. An item of a unit walks a virtual key range: [0, range_len) are the unit's own keys
(positions key_lo + v, through block-table row table_row, seen by every row up to its position),
then the fused segments of the item's row tile, one after another (segment s: virtual keys from
v_start[s], positions v + pos_offset[s] of block-table row table_row[s], seen by the rows of
tokens tok_lo[s] .. tok_hi[s] up to their positions). A row tile's virtual range ends at
`tile_total`.

Items. A unit's query rows (token x query head of one KV head) are cut into row tiles
(config.block_m rows for a shared unit, `suffix_block_m` for a lone one), its virtual range into
`chunks` even key chunks (only when the step has too few items to fill the GPU: `chunk_size`);
one item is (unit, chunk, row tile), run once per KV head, shared units' items first, the tiles of
one chunk adjacent (they read the same keys at about the same time). A query token's partial
results (one per chunk of each unit covering it) are stored at consecutive *partial rows*; a token
covered by a single item (part_count 1) is written straight to the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rollout.engine.prefix_launch import LaunchConfig, max_segments

# one work item: tokens tok_start .. tok_start + tok_count (of unit_tokens when indirect, else of
# the step), query rows row0 .. row0 + block_m of them; the unit's keys: positions key_lo .. key_lo
# + range_len of block-table row table_row; its virtual keys v_lo .. v_hi (see the docstring);
# fused segments seg_start .. seg_start + seg_count; partial slot `slot` of each token not direct; the
# unit's `chunks` (items of one row tile: a decode step's lone pass merges a token when its last one ends)
ITEM_FIELDS = ("tok_start", "tok_count", "row0", "indirect", "table_row", "key_lo", "range_len", "v_lo", "v_hi",
               "seg_start", "seg_count", "slot", "chunks")
SEG_FIELDS = ("v_start", "table_row", "pos_offset", "tok_lo", "tok_hi")


@dataclass
class UnitArrays:
    """Shared units then lone units (U + L of them): what items are cut from."""

    tok_start: np.ndarray  # [U + L] first token (of unit_tokens for shared units, of the step for lone ones)
    tok_count: np.ndarray  # [U + L]
    indirect: np.ndarray  # [U + L] 1 for shared units
    table_row: np.ndarray  # [U + L] block-table row the unit's own keys are read through
    key_lo: np.ndarray  # [U + L] position of the unit's first key
    range_len: np.ndarray  # [U + L] its own keys
    block_m: np.ndarray  # [U + L] rows per tile
    tiles: np.ndarray  # [U + L] row tiles
    splittable: np.ndarray  # [U + L] bool: its keys may be cut into chunks
    first_query: np.ndarray  # [U + L] lone units: the sequence's first query position (causal cut)


@dataclass
class Segments:
    """Fused suffix segments, row tile after row tile of the shared units."""

    fields: np.ndarray  # [NS, 5] int64, SEG_FIELDS
    tile_start: np.ndarray  # [shared tiles] first segment of each row tile
    tile_count: np.ndarray  # [shared tiles]
    tile_total: np.ndarray  # [shared tiles] end of each tile's virtual range


def fused_segments(pair_unit, pair_seq, pair_offset, units: UnitArrays, num_shared: int, suffix_lo, cu_q, q, ctx,
                   block_m: int, groups: int) -> Segments:
    """Segments of the fused (unit, member) pairs (pair_offset: the member's first token among
    its unit's tokens; pairs in unit order, members in token order): one per row tile the member
    has rows in."""
    tiles = units.tiles[:num_shared]
    tile_base = np.cumsum(tiles) - tiles  # [U]
    first = pair_offset * groups // block_m  # [P] row tiles of each pair's rows
    last = ((pair_offset + q[pair_seq]) * groups - 1) // block_m
    count = last - first + 1
    seq = np.repeat(pair_seq, count)  # [NS]
    tile = np.repeat(tile_base[pair_unit] + first, count) + _local_index(count)  # [NS], non-decreasing
    length = ctx[seq] - suffix_lo[seq]
    num_tiles = int(tiles.sum())
    tile_count = np.bincount(tile, minlength=num_tiles)
    tile_start = np.cumsum(tile_count) - tile_count
    before = np.cumsum(length) - length  # [NS] keys of earlier segments
    own_len = np.repeat(units.range_len[:num_shared], tiles)  # [shared tiles]
    v_start = own_len[tile] + before - before[tile_start[tile]]
    fields = np.stack([v_start, seq, suffix_lo[seq] - v_start, cu_q[seq], cu_q[seq] + q[seq]], axis=1)
    if tile_count.max(initial=0) > max_segments(block_m, groups):
        raise AssertionError("a row tile holds more sequences than the kernel's segment bound")
    tile_total = own_len + np.bincount(tile, weights=length, minlength=num_tiles).astype(np.int64)
    return Segments(fields=fields.astype(np.int64).reshape(-1, len(SEG_FIELDS)), tile_start=tile_start,
                    tile_count=tile_count, tile_total=tile_total)


def chunk_size(work: int, num_kv_heads: int, config: LaunchConfig) -> int:
    """Keys per chunk so that `work` (virtual keys x row tiles over the units) makes about
    config.target_programs (item, KV head) pairs, at least config.min_chunk. A unit's keys are
    cut into round(keys / chunk) even chunks (not ceil: units a little longer than the average
    would get one chunk more than the rest)."""
    per_item = -(-work * num_kv_heads // config.target_programs)
    return max(config.min_chunk, -(-per_item // config.block_n) * config.block_n)


@dataclass
class Slots:
    part_start: np.ndarray  # [T]
    part_count: np.ndarray  # [T]
    num_partial_rows: int
    first_slot: np.ndarray  # [U + L] slot of each unit's first chunk


def partial_slots(top, bottom, lone, chunks: np.ndarray, num_shared: int, q: np.ndarray) -> Slots:
    """A token's partial rows: its top unit's chunks, its bottom unit's, then its lone unit's.
    top, bottom: [S] kept unit of each sequence (-1: none); lone: [L] sequences of the lone units."""
    unit_chunks = chunks[:num_shared]
    top_chunks = lookup(unit_chunks, top, 0)  # [S]
    bottom_chunks = lookup(unit_chunks, bottom, 0)
    lone_chunks = np.zeros(len(q), np.int64)
    lone_chunks[lone] = chunks[num_shared:]
    per_seq = top_chunks + bottom_chunks + lone_chunks  # [S], >= 1
    per_token = np.repeat(np.where(per_seq == 1, 0, per_seq), q)  # [T] partial rows
    first_slot = np.zeros(num_shared, np.int64)
    has_bottom = bottom >= 0
    first_slot[bottom[has_bottom]] = top_chunks[has_bottom]  # after the top unit's chunks
    return Slots(part_start=np.cumsum(per_token) - per_token, part_count=np.repeat(per_seq, q),
                 num_partial_rows=int(per_token.sum()),
                 first_slot=np.concatenate([first_slot, (top_chunks + bottom_chunks)[lone]]))


def work_items(units: UnitArrays, chunks, span, tile_total, tile_segs, first_slot, groups: int) -> np.ndarray:
    """[W, 13] items (ITEM_FIELDS): per unit, per key chunk of span[unit] virtual keys, per row
    tile; a lone unit's tiles stop at their last query's position. tile_total, tile_segs ([2,
    tiles]: first segment, segments): per row tile over all units."""
    tiles = units.tiles
    per_unit = tiles * chunks
    unit = np.repeat(np.arange(len(per_unit)), per_unit)  # [W]
    local = _local_index(per_unit)
    c, t = local // tiles[unit], local % tiles[unit]
    tile = (np.cumsum(tiles) - tiles)[unit] + t  # [W] row tile over all units
    v_lo = c * span[unit]
    row0 = t * units.block_m[unit]
    last_tok = (np.minimum(row0 + units.block_m[unit], units.tok_count[unit] * groups) - 1) // groups
    causal = np.where(units.indirect[unit] == 1, tile_total[tile],
                      units.first_query[unit] + last_tok + 1 - units.key_lo[unit])
    v_hi = np.minimum(np.minimum(v_lo + span[unit], tile_total[tile]), causal)
    return np.stack([units.tok_start[unit], units.tok_count[unit], row0, units.indirect[unit], units.table_row[unit],
                     units.key_lo[unit], units.range_len[unit], v_lo, v_hi, tile_segs[0, tile], tile_segs[1, tile],
                     first_slot[unit] + c, chunks[unit]], axis=1).astype(np.int64)


def _local_index(counts: np.ndarray) -> np.ndarray:
    """[sum counts] 0..counts[i]-1 for each i, concatenated."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def lookup(values: np.ndarray, ids: np.ndarray, default: int) -> np.ndarray:
    """values[ids], `default` where an id is -1."""
    out = np.full(len(ids), default, np.int64)
    out[ids >= 0] = values[ids[ids >= 0]]
    return out
