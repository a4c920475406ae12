"""build_step (rollout.engine.batch) against a plain per-item reference: the flattened token
ids, positions, slots, block table and the row maps of a step that mixes a prefill chunk that
does not sample, a prompt's last chunk with samples to fork, and decode items with and without
drafts. No model."""

from __future__ import annotations

import torch

from rollout.engine.batch import build_step
from rollout.engine.params import SamplingParams
from rollout.engine.scheduler import ScheduledSeq
from rollout.engine.sequence import Sequence

BLOCK = 4


def _seq(seq_id: int, prompt_len: int, outputs: int, computed: int, blocks: list[int]) -> Sequence:
    seq = Sequence(seq_id=seq_id, request_id="r", prompt_index=0, sample_index=0,
                   prompt_token_ids=[(seq_id * 13 + i) % 50 for i in range(prompt_len)],
                   params=SamplingParams(), seed=seq_id)
    seq.output_token_ids = [60 + i for i in range(outputs)]
    seq.num_computed_tokens = computed
    seq.block_table = blocks
    return seq


def _reference(items: list[ScheduledSeq], num_drafts: list[int]) -> dict:
    """The step's host lists, one item at a time."""
    out = {k: [] for k in ("ids", "positions", "slots", "draft_tok", "logits_index", "row_entry", "row_position",
                           "judge_row", "draft_of_row", "num_draft", "entries")}
    n_draft = 0
    for item, k in zip(items, num_drafts):
        seq, start = item.seq, item.seq.num_computed_tokens
        t0 = len(out["ids"])
        out["ids"] += seq.tokens(start, start + item.num_new_tokens) + [0] * k
        for p in range(start, start + item.num_new_tokens + k):
            out["positions"].append(p)
            out["slots"].append(seq.block_table[p // BLOCK] * BLOCK + p % BLOCK)
        out["draft_tok"] += range(t0 + item.num_new_tokens, t0 + item.num_new_tokens + k)
        if item.samples:
            for e_seq in [seq, *(seq.children if seq.num_output_tokens == 0 else [])]:
                kk = k if e_seq is seq else 0
                r0, e = len(out["logits_index"]), len(out["entries"])
                out["entries"].append(e_seq)
                out["num_draft"].append(kk)
                out["logits_index"] += range(t0 + item.num_new_tokens - 1, t0 + item.num_new_tokens + kk)
                out["row_entry"] += [e] * (kk + 1)
                out["row_position"] += range(start + item.num_new_tokens, start + item.num_new_tokens + kk + 1)
                out["judge_row"] += range(r0, r0 + kk)
                out["draft_of_row"] += range(n_draft, n_draft + kk)
        n_draft += k
    return out


def test_build_step_matches_the_per_item_reference():
    chunk = _seq(1, 20, 0, 4, [10, 11, 12, 13, 14])  # prefill chunk 4..11, more prompt after it
    last_chunk = _seq(2, 9, 0, 8, [20, 21, 22])  # its last prompt token, two samples to fork
    last_chunk.children = [_seq(3, 9, 0, 0, []), _seq(4, 9, 0, 0, [])]
    drafting = _seq(5, 6, 3, 8, [30, 31, 32, 33])  # decode anchor + 3 draft slots
    plain = _seq(6, 5, 1, 5, [40, 41])  # decode without drafts
    items = [ScheduledSeq(chunk, 8), ScheduledSeq(last_chunk, 1), ScheduledSeq(drafting, 1, 3),
             ScheduledSeq(plain, 1)]
    num_drafts = [0, 0, 3, 0]
    step = build_step(items, num_drafts, BLOCK, torch.device("cpu"))
    ref = _reference(items, num_drafts)

    assert step.tokens.input_ids.tolist() == ref["ids"]
    assert step.tokens.meta.positions.tolist() == ref["positions"]
    assert step.tokens.meta.slot_mapping.tolist() == ref["slots"]
    assert step.tokens.meta.cu_seqlens_q.tolist() == [0, 8, 9, 13, 14]
    assert step.tokens.meta.context_lens.tolist() == [12, 9, 12, 6]
    assert step.tokens.meta.block_tables.tolist() == [[10, 11, 12, 13, 14], [20, 21, 22, 0, 0], [30, 31, 32, 33, 0],
                                               [40, 41, 0, 0, 0]]
    assert (step.tokens.meta.max_query_len, step.tokens.meta.max_context_len) == (8, 12)
    assert step.tokens.draft_token_index.tolist() == ref["draft_tok"]
    assert step.rows.entries == ref["entries"] and step.rows.num_draft == ref["num_draft"]
    assert step.rows.entry_item == [1, 1, 1, 2, 3]
    assert step.rows.cu_rows == [0, 1, 2, 3, 7, 8]
    for name in ("logits_index", "row_entry", "row_position", "judge_row", "draft_of_row"):
        assert getattr(step.rows, name).tolist() == ref[name], name
    assert step.rows.first_draft == [0, 0, 0, 0, 3]


def test_build_step_of_one_decode_token():
    seq = _seq(7, 3, 2, 4, [5, 6])
    step = build_step([ScheduledSeq(seq, 1)], [0], BLOCK, torch.device("cpu"))
    assert step.tokens.input_ids.tolist() == [61]
    assert (step.tokens.meta.positions.tolist(), step.tokens.meta.slot_mapping.tolist()) == ([4], [6 * BLOCK])
    assert step.rows.logits_index.tolist() == [0] and step.rows.row_position.tolist() == [5]
    assert step.rows.judge_row.tolist() == [] and step.rows.draft_of_row.tolist() == []
