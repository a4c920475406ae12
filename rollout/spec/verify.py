"""Lossless verification of draft tokens (DESIGN.md Contract 2), batched and ragged.

Terms. Sample e drafted `d_1..d_K` (K = num_draft[e], possibly 0) from distributions `q_i`
(one-hot for deterministic drafts). Its logits rows `cu_rows[e] + i`, i = 0..K, carry the
policy `p_{i+1}` conditioned on the committed prefix and `d_1..d_i`.
* accepted: the leading drafts that pass `u_i * q_i(d_i) < p_i(d_i)`, u_i ~ U(0, 1);
* recovered: at the first rejection, a token drawn from normalise(max(p_i - q_i, 0));
* bonus: when all K pass, a token drawn from p_{K+1}.
Each sample commits its accepted drafts plus one recovered-or-bonus token. With K = 0 this
is plain sampling from p, so non-speculative decoding runs the same code. Drafts are
flattened over samples ([D]); no padding to the longest block except the tiny [E, Kmax]
table that finds the first rejection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.engine.sampler import (
    PURPOSE_ACCEPT,
    PURPOSE_SAMPLE,
    Policy,
    sample_sorted,
    uniform,
    uniform_keys,
    uniform_of_keys,
)


@dataclass
class VerifyResult:
    tokens: torch.Tensor  # [E, Kmax+1] int64 committed tokens, -1 past the end
    logprobs: torch.Tensor  # [E, Kmax+1] float32 log p_j(t_j) of each committed token
    num_accepted: torch.Tensor  # [E] int64 accepted drafts a_e (commits a_e + 1 tokens)
    final_rows: torch.Tensor  # [E] int64 row of the recovered / bonus token
    has_support: torch.Tensor  # [E] bool: False when constraints left the final row no token at all


def verify(pol: Policy, drafts: torch.Tensor, draft_q: torch.Tensor | None, step) -> VerifyResult:
    """pol: rows [R]; drafts: [D] flat draft tokens; draft_q: [D, V] or None (one-hot). `step`
    (a StepBatch) lays the rows out: num_draft [E] (host), judge_row / draft_of_row [D'] (row
    judging a draft, that draft's flat index), row_seed / row_position [R] (seed and predicted
    position of each row), entry_first_row / entry_num_draft / entry_first_draft [E]."""
    num_draft, judge_row, draft_of_row = step.num_draft, step.judge_row, step.draft_of_row
    row_seed, row_position = step.row_seed, step.row_position
    if not any(num_draft):
        return _sample(pol, row_seed, row_position)
    device = pol.sorted_ids.device
    num_e = len(num_draft)
    k_max = max(num_draft)
    # greedy rows (one policy column) with one-hot q: p(d) is 1 or 0, so the test u < p(d) and the
    # draw after it are decided without a uniform
    greedy = pol.sorted_ids.shape[1] == 1 and draft_q is None
    keys = None if greedy else uniform_keys(row_seed, row_position)  # [R], shared by both purposes
    d_tok = drafts[draft_of_row]  # [D'] draft judged by each judging row
    p_d = pol.logprob_of(judge_row, d_tok)  # [D'] log p_i(d_i)
    if greedy:
        ok = p_d > float("-inf")
    else:
        q_d = torch.ones_like(p_d) if draft_q is None else draft_q[draft_of_row].gather(1, d_tok[:, None])[:, 0]
        ok = uniform_of_keys(keys[judge_row], PURPOSE_ACCEPT) * q_d < p_d.exp()  # [D']

    cu, n_draft, first_draft = step.entry_first_row, step.entry_num_draft, step.entry_first_draft  # each [E]
    entry_of = torch.repeat_interleave(torch.arange(num_e, device=device), n_draft,
                                       output_size=len(judge_row))  # [D'], sized on the host: no sync
    slot = judge_row - cu[entry_of]  # position of each judged draft inside its block
    table = torch.zeros(num_e, k_max + 1, dtype=torch.bool, device=device)
    table[entry_of, slot] = ok
    num_accepted = table.int().cumprod(dim=1).sum(dim=1)  # [E]; column k_max is always False
    final_rows = cu + num_accepted

    if greedy:  # one column: every draw picks it
        final_tok, final_lp = pol.sorted_ids[final_rows, 0], pol.sorted_logp[final_rows, 0]
    else:
        final_tok, final_lp = _final_token(pol, final_rows, num_accepted, n_draft, first_draft, drafts, draft_q,
                                           keys)
    tokens = torch.full((num_e, k_max + 1), -1, dtype=torch.int64, device=device)
    logprobs = torch.zeros(num_e, k_max + 1, dtype=torch.float32, device=device)
    keep = slot < num_accepted[entry_of]  # masked writes, not boolean indexing (which would sync)
    tokens[entry_of, slot] = torch.where(keep, d_tok, -1)
    logprobs[entry_of, slot] = torch.where(keep, p_d, 0.0)
    rows = torch.arange(num_e, device=device)
    tokens[rows, num_accepted] = final_tok
    logprobs[rows, num_accepted] = final_lp
    return VerifyResult(tokens, logprobs, num_accepted, final_rows, pol.support_len[final_rows] > 0)


def _sample(pol: Policy, row_seed: torch.Tensor, row_position: torch.Tensor) -> VerifyResult:
    """No drafts in the step: entry e is row e, and commits one token drawn from p."""
    num_e = pol.sorted_ids.shape[0]
    if pol.sorted_ids.shape[1] == 1:  # greedy: the one column
        tokens, logprobs = pol.sorted_ids, pol.sorted_logp  # [E, 1]
    else:
        u = uniform(row_seed, row_position, PURPOSE_SAMPLE)
        idx = sample_sorted(pol.sorted_logp.exp(), pol.support_len, u)[:, None]
        tokens, logprobs = pol.sorted_ids.gather(1, idx), pol.sorted_logp.gather(1, idx)
    device = tokens.device
    return VerifyResult(tokens, logprobs, torch.zeros(num_e, dtype=torch.int64, device=device),
                        torch.arange(num_e, device=device), pol.support_len > 0)


def _final_token(pol: Policy, final_rows, num_accepted, num_draft, first_draft, drafts, draft_q, keys):
    """The recovered token (after a rejection) or the bonus token, and its log p."""
    ids = pol.sorted_ids[final_rows]  # [E, V]
    logp = pol.sorted_logp[final_rows]
    p = logp.exp()
    rejected = num_accepted < num_draft  # [E]
    if draft_q is None:
        d = drafts[(first_draft + num_accepted).clamp(max=len(drafts) - 1)]  # [E]
        q = (ids == d[:, None]).float()
    else:
        q = draft_q[(first_draft + num_accepted).clamp(max=len(drafts) - 1)].gather(1, ids)
    residual = torch.where(rejected[:, None], (p - q).clamp(min=0), p)
    empty = residual.sum(dim=1, keepdim=True) <= 0  # p == q up to rounding: fall back to p
    residual = torch.where(empty, p, residual)
    u = uniform_of_keys(keys[final_rows], PURPOSE_SAMPLE)
    idx = sample_sorted(residual, pol.support_len[final_rows], u)
    return ids.gather(1, idx[:, None])[:, 0], logp.gather(1, idx[:, None])[:, 0]
