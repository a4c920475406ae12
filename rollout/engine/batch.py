"""One step's inputs, built on the host from the scheduler's plan: the plain dataclasses the
device side receives. Flattened tokens with offsets, no padding.

A `StepBatch` has two views:
* `TokenBatch`, the token view: every token the target computes (prefill chunks, decode
  anchors, drafts), what the forward reads;
* `SampleRows`, the row view: every sample that draws tokens this step (an entry). Entry e owns
  the logits rows `cu_rows[e] .. cu_rows[e+1]-1`: one per draft plus one (bonus / plain sample).
  A prompt whose last chunk is computed this step also has an entry for each sample forked from
  it, reusing the parent's last row. The policy, verification (docs/verification.md names the
  terms) and mask capture read this view.
Their index arrays (`TokenArrays`, `RowArrays`, and the shared-prefix plan's `PlanArrays` when
the step has a planner) reach the device in one packed copy.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from rollout.engine.attention import AttentionMetadata
from rollout.engine.prefix_attention import SharedPrefixPlan
from rollout.engine.prefix_plan import SharedPrefixPlanner
from rollout.engine.scheduler import ScheduledSeq
from rollout.engine.sequence import Sequence
from rollout.engine.transfer import upload_groups


class TokenArrays(NamedTuple):
    """The token view's index arrays ([T] tokens of [S] sequences), host numpy arrays until the
    step's one upload makes them device tensors (int64)."""

    input_ids: Tensor  # [T] (draft slots hold 0 until the drafts are scattered in)
    positions: Tensor  # [T]
    slot_mapping: Tensor  # [T]
    cu_seqlens_q: Tensor  # [S+1]
    context_lens: Tensor  # [S]
    block_tables: Tensor  # [S * W] the padded block tables, flat
    draft_token_index: Tensor  # [D] index into the T tokens of each draft slot


class RowArrays(NamedTuple):
    """The row view's index arrays ([R] logits rows of [E] entries, [D'] judged drafts), host numpy
    arrays until the step's one upload makes them device tensors (int64)."""

    logits_index: Tensor  # [R] token index of each logits row
    row_entry: Tensor  # [R] entry of each row
    row_position: Tensor  # [R] position of the token each row predicts
    draft_of_row: Tensor  # [D'] flat draft index judged by each judging row
    judge_row: Tensor  # [D'] rows judging drafts, aligned with draft_of_row
    row_seed: Tensor  # [R] seed of each row's sample
    entry_first_row: Tensor  # [E] cu_rows[:-1]
    entry_num_draft: Tensor  # [E] num_draft
    entry_first_draft: Tensor  # [E] flat index of each entry's first draft


@dataclass
class TokenBatch:
    """Token view: every token the target computes this step (what the forward reads)."""

    items: list[ScheduledSeq]
    input_ids: Tensor  # [T] int64 (draft slots hold 0 until the drafts are scattered in)
    meta: AttentionMetadata
    draft_token_index: Tensor  # [D] int64 index into the T tokens of each draft slot


@dataclass
class SampleRows:
    """Row view: the sampling entries and their logits rows (what the policy, verification and
    mask capture read). Host lists first, then the device tensors of `RowArrays`."""

    entries: list[Sequence]  # the sample of each entry (a fork child for forked entries)
    entry_item: list[int]  # index into the step's items of the sequence whose logits the entry reads
    num_draft: list[int]  # [E] drafts per entry
    cu_rows: list[int]  # [E+1] row offsets
    first_draft: list[int]  # [E] flat index of each entry's first draft (without drafts: the running total)
    logits_index: Tensor  # [R] int64 token index of each logits row
    row_entry: Tensor  # [R] int64 entry of each row
    row_position: Tensor  # [R] int64 position of the token each row predicts
    draft_of_row: Tensor  # [D'] int64 flat draft index judged by each judging row
    judge_row: Tensor  # [D'] int64 rows judging drafts, aligned with draft_of_row
    row_seed: Tensor  # [R] int64 seed of each row's sample
    entry_first_row: Tensor  # [E] int64 cu_rows[:-1] on the device
    entry_num_draft: Tensor  # [E] int64 num_draft on the device
    entry_first_draft: Tensor  # [E] int64 flat index of each entry's first draft

    @property
    def num_entries(self) -> int:
        return len(self.entries)


@dataclass
class StepBatch:
    tokens: TokenBatch
    rows: SampleRows

    def accepted_per_item(self, num_accepted: list[int] | None) -> list[int]:
        """Drafts each item accepted: its own entry's count (`num_accepted` [E], None without
        entries); 0 for items without an entry of their own and for forked entries."""
        per_item = [0] * len(self.tokens.items)
        if num_accepted is not None:
            for e, (seq, i) in enumerate(zip(self.rows.entries, self.rows.entry_item)):
                if seq is self.tokens.items[i].seq:
                    per_item[i] = num_accepted[e]
        return per_item


def build_step(items: list[ScheduledSeq], num_drafts: list[int], block_size: int, device: torch.device,
               table: np.ndarray | None = None, planner: SharedPrefixPlanner | None = None) -> StepBatch:
    """Flatten the scheduled sequences. num_drafts[i]: drafts item i carries this step; `table`:
    their padded block tables (`padded_block_table`, which the engine builds once per step for
    the drafter and this); `planner`: plan shared-prefix attention (meta.shared) when set. Host
    work is a few list appends per sequence; the token and row indices are whole-array numpy
    ops, and every index tensor of the step reaches the device in one copy."""
    ids, starts, q_lens, new_lens, tables, slack = [], [], [], [], [], []
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
        slack.append(seq.pending_drafts)  # its positions may lie this much further (rollout.engine.overlap)
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
    cu_rows = list(itertools.accumulate([k + 1 for k in entry_draft], initial=0))  # a row per draft + 1
    first_draft = list(itertools.accumulate(entry_draft[:-1], initial=0)) if entries else []
    seeds = np.fromiter((s.seed for s in entries), np.int64, len(entries))
    token_arrays = _token_arrays(np.asarray(ids, dtype=np.int64), starts, q_lens, new_lens, table, block_size)
    row_arrays = _row_arrays(entry_draft, entry_row0, entry_pos, entry_base, seeds, cu_rows, first_draft)
    longest = [s + e for s, e in zip(starts, slack)] if any(slack) else starts  # the kernels' key bounds
    shared = None if planner is None else planner.plan(table, longest, q_lens,
                                                         [item.seq.num_prompt_tokens for item in items])
    groups = (token_arrays, row_arrays) if shared is None else (token_arrays, row_arrays, shared.arrays())
    tok, row, *plan = upload_groups(groups, device)
    meta = AttentionMetadata(
        positions=tok.positions, slot_mapping=tok.slot_mapping, cu_seqlens_q=tok.cu_seqlens_q,
        context_lens=tok.context_lens, block_tables=tok.block_tables.view(len(tables), -1),
        max_query_len=max(q_lens), max_context_len=max(s + n for s, n in zip(longest, q_lens)),
        block_size=block_size, shared=None if shared is None else SharedPrefixPlan.from_host(shared, plan[0]),
    )
    tokens = TokenBatch(items, tok.input_ids, meta, tok.draft_token_index)
    rows = SampleRows(entries, entry_item, entry_draft, cu_rows, first_draft, **row._asdict())
    return StepBatch(tokens, rows)


def _token_arrays(ids: np.ndarray, starts: list[int], q_lens: list[int], new_lens: list[int], table: np.ndarray,
                  block_size: int) -> TokenArrays:
    """The token view's arrays from the token ids [T], as whole-batch numpy ops."""
    q = np.asarray(q_lens, dtype=np.int64)  # [S]
    cu_q = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q, out=cu_q[1:])
    seq_of = np.repeat(np.arange(len(q_lens)), q)  # [T]
    local = np.arange(len(seq_of)) - cu_q[seq_of]  # [T] index of each token inside its sequence's query
    start = np.asarray(starts, dtype=np.int64)
    positions = start[seq_of] + local
    slots = table[seq_of, positions // block_size] * block_size + positions % block_size
    draft_tok = np.flatnonzero(local >= np.asarray(new_lens, dtype=np.int64)[seq_of])  # drafts follow the new tokens
    return TokenArrays(ids, positions, slots, cu_q, start + q, table, draft_tok)


def _row_arrays(entry_draft: list[int], entry_row0: list[int], entry_pos: list[int], entry_base: list[int],
                seeds: np.ndarray, cu_rows: list[int], first_draft: list[int]) -> RowArrays:
    """Row view: entry e owns rows cu_rows[e] .. cu_rows[e] + k_e (k_e = entry_draft[e]); its
    row j reads token entry_row0[e] + j, predicts position entry_pos[e] + j and, for j < k_e,
    judges flat draft entry_base[e] + j. seeds: [E] each entry's sample seed."""
    k = np.asarray(entry_draft, dtype=np.int64)  # [E]
    row_entry = np.repeat(np.arange(len(k)), k + 1)  # [R]
    first_row = np.cumsum(k + 1) - (k + 1)  # [E]
    j = np.arange(len(row_entry)) - first_row[row_entry]  # [R] row index inside its entry
    judge_row = np.flatnonzero(j < k[row_entry])
    draft_of_row = np.asarray(entry_base, dtype=np.int64)[row_entry[judge_row]] + j[judge_row]
    per_entry = [np.asarray(x, dtype=np.int64) for x in (cu_rows[:-1], entry_draft, first_draft)]
    return RowArrays(np.asarray(entry_row0, dtype=np.int64)[row_entry] + j, row_entry,
                     np.asarray(entry_pos, dtype=np.int64)[row_entry] + j, draft_of_row, judge_row,
                     seeds[row_entry], *per_entry)


def padded_block_table(tables: list[list[int]]) -> np.ndarray:
    """Block tables of several sequences as one [S, max_blocks] int64 host array, 0-padded: one
    pass over the block ids in C, no padded Python lists."""
    lens = np.fromiter(map(len, tables), np.int64, len(tables))  # [S]
    out = np.zeros((len(tables), int(lens.max())), np.int64)
    ids = np.fromiter(itertools.chain.from_iterable(tables), np.int64, int(lens.sum()))
    out[np.arange(out.shape[1]) < lens[:, None]] = ids
    return out
