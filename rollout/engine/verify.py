"""Lossless verification of draft tokens (docs/verification.md), batched and ragged.

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

Everything reads the policy through `Policy.logprob_of` (p of each draft) and `Policy.draw` (the
recovered and bonus tokens), in the policy's own layout: top-k rows over their candidates, other
rows over the vocabulary in vocabulary order; nothing here sorts or copies [rows, V] tensors, only
the E final rows (and, for sampled drafts, the E rejected drafts' q rows) when they are vocab rows.
Sampled drafts' q arrive as a `Proposal` (the drafter's tempered logits): a q row exists only
for the at most E rejected drafts that need one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.engine.sampler import PURPOSE_ACCEPT, PURPOSE_SAMPLE, Policy, uniform, uniform_keys, uniform_of_keys


@dataclass
class Proposal:
    """The distributions q_i sampled drafts were drawn from, one row per flat draft [D], kept as the
    drafter's tempered logits (q = softmax(z)): no [D, V] probability tensor is made. A row drafted
    greedily (a greedy sample in a batch that also samples) is one-hot at its draft."""

    z: torch.Tensor  # [D, V] float32 tempered logits
    lse: torch.Tensor  # [D] float32 logsumexp of each row of z
    one_hot: torch.Tensor  # [D] bool
    tokens: torch.Tensor  # [D] int64 the drafts

    def select(self, index: torch.Tensor) -> Proposal:
        """The rows `index` [D'] of this proposal."""
        return Proposal(self.z[index], self.lse[index], self.one_hot[index], self.tokens[index])

    def prob_of(self, idx: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """q_idx(token): idx, tokens [M] -> [M] float32."""
        soft = (self.z[idx, tokens] - self.lse[idx]).exp()
        return torch.where(self.one_hot[idx], tokens == self.tokens[idx], soft)

    def probs(self, idx: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
        """q_idx at `ids` [M, C], or over the vocabulary when ids is None: [M, C] or [M, V]."""
        z = self.z[idx] if ids is None else self.z[idx[:, None], ids]  # a copy: [M, C] or [M, V]
        soft = z.sub_(self.lse[idx][:, None]).exp_()
        return torch.where(self.one_hot[idx][:, None], _one_hot_at(self.tokens[idx], ids, z.shape[1]), soft)


def _one_hot_at(tokens: torch.Tensor, ids: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """Where ids [M, C] (or every id, [M, V] when None) equals tokens [M]: [M, C] or [M, V] bool."""
    ids = torch.arange(vocab, device=tokens.device) if ids is None else ids
    return ids == tokens[:, None]


@dataclass
class VerifyResult:
    tokens: torch.Tensor  # [E, Kmax+1] int64 committed tokens, -1 past the end
    logprobs: torch.Tensor  # [E, Kmax+1] float32 log p_j(t_j) of each committed token
    num_accepted: torch.Tensor  # [E] int64 accepted drafts a_e (commits a_e + 1 tokens)
    final_rows: torch.Tensor  # [E] int64 row of the recovered / bonus token
    has_support: torch.Tensor  # [E] bool: False when constraints left the final row no token at all


def verify(pol: Policy, drafts: torch.Tensor, draft_q: Proposal | None, step) -> VerifyResult:
    """pol: rows [R]; drafts: [D] flat draft tokens; draft_q: their q, or None (all one-hot). `step`
    (the step's row view, rollout.engine.batch.SampleRows) lays the rows out: num_draft [E]
    (host), judge_row / draft_of_row [D'] (row judging a draft, that draft's flat index),
    row_seed / row_position [R] (seed and predicted position of each row), entry_first_row /
    entry_num_draft / entry_first_draft [E]."""
    num_draft, judge_row, draft_of_row = step.num_draft, step.judge_row, step.draft_of_row
    row_seed, row_position = step.row_seed, step.row_position
    if not any(num_draft):
        return _sample(pol, row_seed, row_position)
    device = drafts.device
    num_e = len(num_draft)
    k_max = max(num_draft)
    # greedy rows (one policy column) with one-hot q: p(d) is 1 or 0, so the test u < p(d) and the
    # draw after it are decided without a uniform
    greedy = pol.all_greedy and draft_q is None
    keys = None if greedy else uniform_keys(row_seed, row_position)  # [R], shared by both purposes
    d_tok = drafts[draft_of_row]  # [D'] draft judged by each judging row
    p_d = pol.logprob_of(judge_row, d_tok)  # [D'] log p_i(d_i)
    if greedy:
        ok = p_d > float("-inf")
    else:
        q_d = torch.ones_like(p_d) if draft_q is None else draft_q.prob_of(draft_of_row, d_tok)
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
        final_tok, final_lp = pol.cand_ids[final_rows, 0], pol.cand_logp[final_rows, 0]
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
    return VerifyResult(tokens, logprobs, num_accepted, final_rows, pol.has_support[final_rows])


def _sample(pol: Policy, row_seed: torch.Tensor, row_position: torch.Tensor) -> VerifyResult:
    """No drafts in the step: entry e is row e, and commits one token drawn from p."""
    num_e = pol.has_support.shape[0]
    device = pol.has_support.device
    if pol.all_greedy:  # the one column
        tokens, logprobs = pol.cand_ids, pol.cand_logp  # [E, 1]
    else:
        rows = torch.arange(num_e, device=device)
        tokens, logprobs = pol.draw(rows, uniform(row_seed, row_position, PURPOSE_SAMPLE))
        tokens, logprobs = tokens[:, None], logprobs[:, None]
    return VerifyResult(tokens, logprobs, torch.zeros(num_e, dtype=torch.int64, device=device),
                        torch.arange(num_e, device=device), pol.has_support)


def _final_token(pol: Policy, final_rows, num_accepted, num_draft, first_draft, drafts, draft_q, keys):
    """The recovered token (after a rejection: from max(p - q, 0) of the rejected draft's q) or
    the bonus token (from p), and its log p."""
    rejected = (num_accepted < num_draft).float()[:, None]  # [E, 1]
    at = (first_draft + num_accepted).clamp(max=len(drafts) - 1)  # [E] the rejected draft, if any

    def minus(ids: torch.Tensor | None) -> torch.Tensor:  # q at ids [E, C] (None: [E, V]); 0 for a bonus
        if draft_q is None:
            return _one_hot_at(drafts[at], ids, pol.vocab_size) * rejected
        return draft_q.probs(at, ids).mul_(rejected)

    return pol.draw(final_rows, uniform_of_keys(keys[final_rows], PURPOSE_SAMPLE), minus)
