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

import functools
import itertools
from dataclasses import dataclass

import torch

from rollout.engine.attention import AttentionMetadata
from rollout.engine.scheduler import ScheduledSeq
from rollout.engine.sequence import Sequence


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
    logits_index: torch.Tensor  # [R] int64 token index of each logits row
    row_entry: torch.Tensor  # [R] int64 entry of each row
    row_position: torch.Tensor  # [R] int64 position of the token each row predicts
    draft_of_row: torch.Tensor  # [R - E] int64 flat draft index judged by each non-final row
    judge_row: torch.Tensor  # [D'] rows judging drafts, aligned with draft_of_row

    @property
    def num_entries(self) -> int:
        return len(self.entries)

    @functools.cached_property
    def first_draft(self) -> list[int]:
        """Flat index of each entry's first draft (entries without drafts: the running total)."""
        return list(itertools.accumulate(self.num_draft[:-1], initial=0)) if self.num_draft else []


def build_step(items: list[ScheduledSeq], num_drafts: list[int], block_size: int,
               device: torch.device) -> StepBatch:
    """Flatten the scheduled sequences. num_drafts[i]: drafts item i carries this step.
    Host work is a few int-list appends per sequence; positions, slots and the block table
    are built as whole tensors."""
    ids, starts, q_lens, tables = [], [], [], []
    draft_tok, logits_index, row_entry, row_pos = [], [], [], []
    entries, entry_item, entry_draft, cu_rows = [], [], [], [0]
    judge_row, draft_of_row = [], []
    n_draft_total = 0
    for i, (item, k) in enumerate(zip(items, num_drafts)):
        seq = item.seq
        start = seq.num_computed_tokens
        n = item.num_new_tokens + k
        t0 = len(ids)
        ids += seq.tokens(start, start + item.num_new_tokens)
        ids += [0] * k
        draft_tok += range(t0 + item.num_new_tokens, t0 + n)
        starts.append(start)
        q_lens.append(n)
        tables.append(seq.block_table)
        if not item.samples:
            continue
        first = t0 + n - k - 1  # the row predicting the token after the last computed one
        for e_seq in [seq, *(seq.children if seq.num_output_tokens == 0 else [])]:
            e = len(entries)
            kk = k if e_seq is seq else 0
            entries.append(e_seq)
            entry_item.append(i)
            entry_draft.append(kk)
            r0 = len(logits_index)
            logits_index += range(first, first + kk + 1)
            row_entry += [e] * (kk + 1)
            row_pos += range(start + n - k, start + n - k + kk + 1)
            judge_row += range(r0, r0 + kk)
            draft_of_row += range(n_draft_total, n_draft_total + kk)
            cu_rows.append(len(logits_index))
        n_draft_total += k
    meta = _attention_metadata(starts, q_lens, tables, len(ids), block_size, device)
    as_dev = lambda x: torch.tensor(x, dtype=torch.int64).to(device, non_blocking=True)  # noqa: E731
    return StepBatch(
        items=items, input_ids=as_dev(ids), meta=meta, draft_token_index=as_dev(draft_tok),
        entries=entries, entry_item=entry_item, num_draft=entry_draft, cu_rows=cu_rows,
        logits_index=as_dev(logits_index), row_entry=as_dev(row_entry), row_position=as_dev(row_pos),
        draft_of_row=as_dev(draft_of_row), judge_row=as_dev(judge_row),
    )


def _attention_metadata(starts: list[int], q_lens: list[int], tables: list[list[int]], num_tokens: int,
                        block_size: int, device: torch.device) -> AttentionMetadata:
    """Positions, slots and the padded block table of the step, as whole-batch tensor ops."""
    table = padded_block_table(tables)  # [S, W]
    q = torch.tensor(q_lens, dtype=torch.int64)  # [S]
    cu_q = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    torch.cumsum(q, 0, out=cu_q[1:])
    seq_of = torch.repeat_interleave(torch.arange(len(q_lens)), q, output_size=num_tokens)  # [T]
    start = torch.tensor(starts, dtype=torch.int64)
    positions = start[seq_of] + torch.arange(num_tokens) - cu_q[seq_of]  # [T]
    slots = table[seq_of, positions // block_size] * block_size + positions % block_size  # [T]
    ctx = start + q
    to = lambda x: x.to(device, non_blocking=True)  # noqa: E731
    return AttentionMetadata(
        positions=to(positions), slot_mapping=to(slots), cu_seqlens_q=to(cu_q), context_lens=to(ctx),
        block_tables=to(table), max_query_len=max(q_lens), max_context_len=max(s + n for s, n in zip(starts, q_lens)),
        block_size=block_size,
    )


def padded_block_table(tables: list[list[int]]) -> torch.Tensor:
    """Block tables of several sequences as one [S, max_blocks] int64 CPU tensor, 0-padded."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
