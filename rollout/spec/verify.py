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

from rollout.engine.sampler import PURPOSE_ACCEPT, PURPOSE_SAMPLE, Policy, sample_sorted, uniform


@dataclass
class VerifyResult:
    tokens: torch.Tensor  # [E, Kmax+1] int64 committed tokens, -1 past the end
    logprobs: torch.Tensor  # [E, Kmax+1] float32 log p_j(t_j) of each committed token
    num_accepted: torch.Tensor  # [E] int64 accepted drafts a_e (commits a_e + 1 tokens)
    final_rows: torch.Tensor  # [E] int64 row of the recovered / bonus token
    has_support: torch.Tensor  # [E] bool: False when constraints left the final row no token at all


def verify(pol: Policy, drafts: torch.Tensor, draft_q: torch.Tensor | None, num_draft: list[int],
           cu_rows: list[int], judge_row: torch.Tensor, draft_of_row: torch.Tensor,
           row_seed: torch.Tensor, row_position: torch.Tensor) -> VerifyResult:
    """pol: rows [R]; drafts: [D] flat draft tokens; draft_q: [D, V] or None (one-hot);
    judge_row / draft_of_row: [D'] pairs (row judging a draft, that draft's flat index);
    row_seed / row_position: [R] seed and predicted position of each row."""
    device = pol.sorted_ids.device
    num_e = len(num_draft)
    k_max = max(num_draft) if num_draft else 0
    d_tok = drafts[draft_of_row]  # [D'] draft judged by each judging row
    p_d = pol.logprob_of(judge_row, d_tok)  # [D'] log p_i(d_i)
    q_d = torch.ones_like(p_d) if draft_q is None else draft_q[draft_of_row].gather(1, d_tok[:, None])[:, 0]
    u = uniform(row_seed[judge_row], row_position[judge_row], PURPOSE_ACCEPT)
    ok = u * q_d < p_d.exp()  # [D']

    cu = torch.tensor(cu_rows[:-1], device=device)  # [E]
    entry_of = torch.repeat_interleave(torch.arange(num_e, device=device), torch.tensor(num_draft, device=device),
                                       output_size=len(judge_row))  # [D'], sized on the host: no sync
    slot = judge_row - cu[entry_of]  # position of each judged draft inside its block
    table = torch.zeros(num_e, k_max + 1, dtype=torch.bool, device=device)
    table[entry_of, slot] = ok
    num_accepted = table.int().cumprod(dim=1).sum(dim=1)  # [E]; column k_max is always False
    final_rows = cu + num_accepted

    final_tok, final_lp = _final_token(pol, final_rows, num_accepted, num_draft, drafts, draft_q,
                                       row_seed, row_position)
    tokens = torch.full((num_e, k_max + 1), -1, dtype=torch.int64, device=device)
    logprobs = torch.zeros(num_e, k_max + 1, dtype=torch.float32, device=device)
    keep = slot < num_accepted[entry_of]  # masked writes, not boolean indexing (which would sync)
    tokens[entry_of, slot] = torch.where(keep, d_tok, -1)
    logprobs[entry_of, slot] = torch.where(keep, p_d, 0.0)
    rows = torch.arange(num_e, device=device)
    tokens[rows, num_accepted] = final_tok
    logprobs[rows, num_accepted] = final_lp
    return VerifyResult(tokens, logprobs, num_accepted, final_rows, pol.support_len[final_rows] > 0)


def _final_token(pol: Policy, final_rows, num_accepted, num_draft, drafts, draft_q, row_seed, row_position):
    """The recovered token (after a rejection) or the bonus token, and its log p."""
    device = final_rows.device
    ids = pol.sorted_ids[final_rows]  # [E, V]
    logp = pol.sorted_logp[final_rows]
    p = logp.exp()
    first_draft = torch.tensor([0, *num_draft[:-1]], device=device).cumsum(0)
    rejected = num_accepted < torch.tensor(num_draft, device=device)  # [E]
    if bool(len(drafts)) and draft_q is None:
        d = drafts[(first_draft + num_accepted).clamp(max=max(len(drafts) - 1, 0))]  # [E]
        q = (ids == d[:, None]).float()
    elif bool(len(drafts)):
        q = draft_q[(first_draft + num_accepted).clamp(max=len(drafts) - 1)].gather(1, ids)
    else:
        q = torch.zeros_like(p)
    residual = torch.where(rejected[:, None], (p - q).clamp(min=0), p)
    empty = residual.sum(dim=1, keepdim=True) <= 0  # p == q up to rounding: fall back to p
    residual = torch.where(empty, p, residual)
    u = uniform(row_seed[final_rows], row_position[final_rows], PURPOSE_SAMPLE)
    idx = sample_sorted(residual, pol.support_len[final_rows], u)
    return ids.gather(1, idx[:, None])[:, 0], logp.gather(1, idx[:, None])[:, 0]
