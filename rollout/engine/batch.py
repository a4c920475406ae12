"""One step's inputs, built on the host from the scheduler's plan: the plain dataclass the
device side receives. Flattened tokens with offsets, no padding (DESIGN.md).

Two views of the step:
* token rows: every token the target computes (prefill chunks, decode anchors, drafts);
* sampling entries: every sample that draws tokens this step. Entry e owns the logits rows
  `cu_rows[e] .. cu_rows[e+1]-1`: one per draft plus one (bonus / plain sample). A prompt
  whose last chunk is computed this step also has an entry for each sample forked from it,
  reusing the parent's last row.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from rollout.engine.attention import AttentionMetadata
from rollout.engine.prefix_attention import SharedPrefixPlan
from rollout.engine.prefix_plan import SharedPrefixPlanner
from rollout.engine.scheduler import ScheduledSeq
from rollout.engine.sequence import Sequence
from rollout.engine.transfer import upload_packed


@dataclass
class StepBatch:
    items: list[ScheduledSeq]
    input_ids: torch.Tensor  # [T] int64 (draft slots hold 0 until the drafts are scattered in)
    meta: AttentionMetadata
    draft_token_index: torch.Tensor  # [D] int64 index into the T tokens of each draft slot
    # sampling entries
    entries: list[Sequence]  # the sample of each entry (a fork child for forked entries)
    entry_item: list[int]  # index into items of the sequence whose logits the entry reads
    num_draft: list[int]  # [E] drafts per entry (host)
    cu_rows: list[int]  # [E+1] row offsets (host)
    first_draft: list[int]  # [E] flat index of each entry's first draft (without drafts: the running total)
    logits_index: torch.Tensor  # [R] int64 token index of each logits row
    row_entry: torch.Tensor  # [R] int64 entry of each row
    row_position: torch.Tensor  # [R] int64 position of the token each row predicts
    draft_of_row: torch.Tensor  # [R - E] int64 flat draft index judged by each non-final row
    judge_row: torch.Tensor  # [D'] rows judging drafts, aligned with draft_of_row
    row_seed: torch.Tensor  # [R] int64 seed of each row's sample
    entry_first_row: torch.Tensor  # [E] int64 cu_rows[:-1] on the device
    entry_num_draft: torch.Tensor  # [E] int64 num_draft on the device
    entry_first_draft: torch.Tensor  # [E] int64 flat index of each entry's first draft

    @property
    def num_entries(self) -> int:
        return len(self.entries)


def build_step(items: list[ScheduledSeq], num_drafts: list[int], block_size: int, device: torch.device,
               table: np.ndarray | None = None, planner: SharedPrefixPlanner | None = None) -> StepBatch:
    """Flatten the scheduled sequences. num_drafts[i]: drafts item i carries this step; `table`:
    their padded block tables (`padded_block_table`, which the engine builds once per step for
    the drafter and this); `planner`: plan shared-prefix attention (meta.shared) when set. Host
    work is a few list appends per sequence; the token and row indices are whole-array numpy
    ops, and every index tensor of the step reaches the device in one copy."""
    ids, starts, q_lens, new_lens, tables = [], [], [], [], []
    entries, entry_item, entry_draft, entry_row0, entry_pos, entry_base = [], [], [], [], [], []
    n_draft_total = 0
    for i, (item, k) in enumerate(zip(items, num_drafts)):
        seq = item.seq
        start, new = seq.num_computed_tokens, item.num_new_tokens
        ids += seq.tokens(start, start + new)
        ids += [0] * k
        starts.append(start)
        q_lens.append(new + k)
        new_lens.append(new)
        tables.append(seq.block_table)
        if item.samples:  # the row after the last computed token predicts position start + new
            for e_seq in [seq, *(seq.children if seq.num_output_tokens == 0 else [])]:
                entries.append(e_seq)
                entry_item.append(i)
                entry_draft.append(k if e_seq is seq else 0)
                entry_row0.append(len(ids) - k - 1)
                entry_pos.append(start + new)
                entry_base.append(n_draft_total)
        n_draft_total += k
    if table is None:
        table = padded_block_table(tables)
    tokens = _token_arrays(starts, q_lens, new_lens, table, block_size)
    cu_rows = list(itertools.accumulate([k + 1 for k in entry_draft], initial=0))  # a row per draft + 1
    rows = _row_arrays(entry_draft, entry_row0, entry_pos, entry_base)
    first_draft = list(itertools.accumulate(entry_draft[:-1], initial=0)) if entries else []
    seeds = np.fromiter((s.seed for s in entries), np.int64, len(entries))
    per_entry = [np.asarray(x, dtype=np.int64) for x in (cu_rows[:-1], entry_draft, first_draft)]
    shared = None
    if planner is not None:
        shared = planner.plan(table, starts, q_lens, [item.seq.num_prompt_tokens for item in items])
    (input_ids, positions, slots, cu_q, ctx, table, draft_tok, logits_index, row_entry, row_pos, draft_of_row,
     judge_row, row_seed, first_row_dev, n_draft_dev, first_draft_dev, *shared_dev) = upload_packed(
        [np.asarray(ids, dtype=np.int64), *tokens, *rows, seeds[rows[1]], *per_entry,
         *(shared.arrays() if shared is not None else [])], device)
    meta = AttentionMetadata(
        positions=positions, slot_mapping=slots, cu_seqlens_q=cu_q, context_lens=ctx,
        block_tables=table.view(len(tables), -1), max_query_len=max(q_lens),
        max_context_len=max(s + n for s, n in zip(starts, q_lens)), block_size=block_size,
        shared=SharedPrefixPlan.from_host(shared, shared_dev) if shared is not None else None,
    )
    return StepBatch(
        items=items, input_ids=input_ids, meta=meta, draft_token_index=draft_tok, entries=entries,
        entry_item=entry_item, num_draft=entry_draft, cu_rows=cu_rows, first_draft=first_draft,
        logits_index=logits_index,
        row_entry=row_entry, row_position=row_pos, draft_of_row=draft_of_row, judge_row=judge_row,
        row_seed=row_seed, entry_first_row=first_row_dev, entry_num_draft=n_draft_dev,
        entry_first_draft=first_draft_dev,
    )


def _token_arrays(starts: list[int], q_lens: list[int], new_lens: list[int], table: np.ndarray,
                  block_size: int) -> list[np.ndarray]:
    """Token view: positions [T], slots [T], cu_seqlens_q [S+1], context_lens [S], the padded
    block table [S, W] and the index of each draft slot [D], as whole-batch numpy ops."""
    q = np.asarray(q_lens, dtype=np.int64)  # [S]
    cu_q = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q, out=cu_q[1:])
    seq_of = np.repeat(np.arange(len(q_lens)), q)  # [T]
    local = np.arange(len(seq_of)) - cu_q[seq_of]  # [T] index of each token inside its sequence's query
    start = np.asarray(starts, dtype=np.int64)
    positions = start[seq_of] + local
    slots = table[seq_of, positions // block_size] * block_size + positions % block_size
    draft_tok = np.flatnonzero(local >= np.asarray(new_lens, dtype=np.int64)[seq_of])  # drafts follow the new tokens
    return [positions, slots, cu_q, start + q, table, draft_tok]


def _row_arrays(entry_draft: list[int], entry_row0: list[int], entry_pos: list[int],
                entry_base: list[int]) -> list[np.ndarray]:
    """Row view: entry e owns rows cu_rows[e] .. cu_rows[e] + k_e (k_e = entry_draft[e]); its
    row j reads token entry_row0[e] + j, predicts position entry_pos[e] + j and, for j < k_e,
    judges flat draft entry_base[e] + j. Returns logits_index, row_entry, row_position [R],
    draft_of_row and judge_row [D']."""
    k = np.asarray(entry_draft, dtype=np.int64)  # [E]
    row_entry = np.repeat(np.arange(len(k)), k + 1)  # [R]
    first_row = np.cumsum(k + 1) - (k + 1)  # [E]
    j = np.arange(len(row_entry)) - first_row[row_entry]  # [R] row index inside its entry
    judge_row = np.flatnonzero(j < k[row_entry])
    draft_of_row = np.asarray(entry_base, dtype=np.int64)[row_entry[judge_row]] + j[judge_row]
    return [np.asarray(entry_row0, dtype=np.int64)[row_entry] + j, row_entry,
            np.asarray(entry_pos, dtype=np.int64)[row_entry] + j, draft_of_row, judge_row]


def padded_block_table(tables: list[list[int]]) -> np.ndarray:
    """Block tables of several sequences as one [S, max_blocks] int64 host array, 0-padded: one
    pass over the block ids in C, no padded Python lists."""
    lens = np.fromiter(map(len, tables), np.int64, len(tables))  # [S]
    out = np.zeros((len(tables), int(lens.max())), np.int64)
    ids = np.fromiter(itertools.chain.from_iterable(tables), np.int64, int(lens.sum()))
    out[np.arange(out.shape[1]) < lens[:, None]] = ids
    return out
