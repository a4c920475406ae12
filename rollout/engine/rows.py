"""Per-row sampling parameters for one step (host -> device), the input of the sampling
distribution (docs/sampling.md).

Row r of a step belongs to sampling entry e (a sample) and predicts output index
`num_output(e) + (r - cu_rows[e])`; its conditioning prefix is the sample's committed
tokens plus the drafts before it, so penalty counts include those drafts (docs/verification.md).
Under overlapped scheduling a sample's last token may be pending (drawn by the step in flight, on the
device only: rollout.engine.overlap): its output index counts it, and penalty counts read it from
the step's input ids, where it is the token the sample's first row reads.
Processors no row needs are left out entirely.
"""

from __future__ import annotations

import numpy as np
import torch

from rollout.engine.batch import SampleRows
from rollout.engine.grammar import allocate_bitmask, upload_bitmask
from rollout.engine.params import SamplingParams
from rollout.engine.sampler import RowParams, RowPlan
from rollout.engine.transfer import upload


def build_row_params(step: SampleRows, drafts: torch.Tensor, vocab_size: int,
                     bitmask: torch.Tensor | None, device: torch.device, input_ids: torch.Tensor) -> RowParams:
    """drafts: [D] int64 flattened draft tokens on the device; bitmask: `grammar_bitmask`'s;
    input_ids: [T] the step's token ids on the device, pending tokens filled in."""
    truncation: dict[int, tuple] = {}  # id(SamplingParams) -> its rows' (temperature, top_p, min_p, top_k)
    per_entry = []
    bias_r, bias_t, bias_v, ban_r, ban_t = [], [], [], [], []
    pen_entries = []
    all_greedy = True
    for e, seq in enumerate(step.entries):
        sp = seq.params
        values = truncation.get(id(sp))
        if values is None:
            values = truncation[id(sp)] = _truncation(sp, vocab_size)
            all_greedy = all_greedy and sp.greedy
        per_entry.append(values)
        if sp.logit_bias or sp.min_tokens > seq.num_output_tokens:
            rows = range(step.cu_rows[e], step.cu_rows[e + 1])
            for tok, b in sp.logit_bias.items():
                bias_r += rows
                bias_t += [tok] * len(rows)
                bias_v += [float(b)] * len(rows)
            for j, r in enumerate(rows):
                if seq.num_output_tokens + j < sp.min_tokens:
                    ban_r += [r] * len(seq.end_ids)
                    ban_t += seq.end_ids
        if sp.has_penalties:
            pen_entries.append(e)
    temp, top_p, min_p, top_k = zip(*per_entry)
    floats, top_k = upload([temp, top_p, min_p], torch.float32, device), upload(top_k, torch.int64, device)
    if step.cu_rows[-1] > step.num_entries:  # drafts: an entry's rows share its values
        floats, top_k = floats[:, step.row_entry], top_k[step.row_entry]
    as_f = lambda x: upload(x, torch.float32, device)  # noqa: E731
    as_i = lambda x: upload(x, torch.int64, device)  # noqa: E731
    params = RowParams(temperature=floats[0], top_k=top_k, top_p=floats[1], min_p=floats[2],
                       all_greedy=all_greedy, plan=None if all_greedy else _plan(step, per_entry, vocab_size))
    if bias_r:
        params.bias = (as_i(bias_r), as_i(bias_t), as_f(bias_v))
    if ban_r:
        params.banned = (as_i(ban_r), as_i(ban_t))
    if pen_entries:
        params.counts, params.penalties = _penalty_counts(step, pen_entries, drafts, vocab_size, device, input_ids)
    params.bitmask = bitmask
    return params


def _plan(step: SampleRows, per_entry: list[tuple], vocab_size: int) -> RowPlan:
    """Each row's truncation path, from its entry's (temperature, top_p, min_p, top_k) and mask
    request (a mask row needs the candidates' sorted support), on the host."""
    _, top_p, min_p, top_k = (np.asarray(x) for x in zip(*per_entry))
    masked = np.fromiter((bool(s.mask) for s in step.entries), bool, len(per_entry))
    rows = np.diff(step.cu_rows)  # [E] rows of each entry
    top_k, top_p, min_p, masked = (np.repeat(x, rows) for x in (top_k, top_p, min_p, masked))
    return RowPlan.of(top_k, top_p, min_p, vocab_size, masked)


def _truncation(sp: SamplingParams, vocab_size: int) -> tuple[float, float, float, int]:
    """(temperature, top_p, min_p, top_k) of a sample's rows; greedy rows are top-k 1."""
    if sp.greedy:
        return 1.0, 1.0, 0.0, 1
    return sp.temperature, sp.top_p, sp.min_p, sp.top_k if sp.top_k > 0 else vocab_size


def _penalty_counts(step: SampleRows, pen_entries: list[int], drafts: torch.Tensor, vocab_size: int,
                    device: torch.device, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """counts [R, V]: prompt + output tokens (a pending one from `input_ids` [T]) of the row's sample
    plus the drafts before the row; penalties [R, 3] (rows of samples without penalties stay
    neutral). Each sample's history is counted once and shared by its rows."""
    num_rows = step.cu_rows[-1]
    pen = [(1.0, 0.0, 0.0)] * num_rows
    hist_of, toks, rows, row_hist, draft_rows, draft_idx = [], [], [], [], [], []
    pending_hist, pending_row = [], []
    draft_base = step.first_draft
    for h, e in enumerate(pen_entries):
        seq, sp = step.entries[e], step.entries[e].params
        history = seq.prompt_token_ids + seq.output_token_ids
        hist_of += [h] * len(history)
        toks += history
        r0, r1 = step.cu_rows[e], step.cu_rows[e + 1]
        if seq.pending_entry >= 0:  # its last token, on the device only: the one its first row reads
            pending_hist.append(h)
            pending_row.append(r0)
        pen[r0:r1] = [(sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty)] * (r1 - r0)
        rows += range(r0, r1)
        row_hist += [h] * (r1 - r0)
        for r in range(r0 + 1, r1):  # drafts d_1 .. d_{r-r0} precede row r
            draft_rows += [r] * (r - r0)
            draft_idx += range(draft_base[e], draft_base[e] + r - r0)
    as_i = lambda x: upload(x, torch.int64, device)  # noqa: E731
    history_counts = torch.zeros(len(pen_entries), vocab_size, device=device)  # [P, V]
    history_counts.index_put_((as_i(hist_of), as_i(toks)), torch.ones(len(toks), device=device), accumulate=True)
    if pending_hist:
        pending = input_ids[step.logits_index[as_i(pending_row)]]  # [P]
        history_counts.index_put_((as_i(pending_hist), pending), torch.ones(len(pending_hist), device=device),
                                  accumulate=True)
    counts = torch.zeros(num_rows, vocab_size, device=device)
    counts[as_i(rows)] = history_counts[as_i(row_hist)]
    if draft_rows:
        counts.index_put_((as_i(draft_rows), drafts[as_i(draft_idx)]),
                          torch.ones(len(draft_rows), device=device), accumulate=True)
    return counts, upload(pen, torch.float32, device)


def grammar_bitmask(step: SampleRows, drafts: torch.Tensor, vocab_size: int,
                    device: torch.device) -> torch.Tensor | None:
    """The grammar processor's input: one bitmask row per verify row of grammar samples (the state
    after the earlier drafts), [R, ceil(V/32)] int32 on the device; None when no sample in the step
    has a grammar. When a grammar sample verifies drafts, the host-side matcher must walk them:
    `drafts` [D] are read back (the step's one wait besides its synchronisation,
    tests/test_host_syncs.py); without drafts nothing is read."""
    with_grammar = [e for e, s in enumerate(step.entries) if s.grammar is not None]
    if not with_grammar:
        return None
    drafted = any(step.num_draft[e] for e in with_grammar)
    draft_list = drafts.tolist() if drafted else []
    offsets = step.first_draft
    bitmask = allocate_bitmask(step.cu_rows[-1], vocab_size)
    for e in with_grammar:
        own = draft_list[offsets[e] : offsets[e] + step.num_draft[e]]
        step.entries[e].grammar.fill_verify_bitmask(own, bitmask, step.cu_rows[e])
    return upload_bitmask(bitmask, device)
