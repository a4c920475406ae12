"""Contract 1, the sampling distribution: the one definition used by sampling,
speculative verification and mask capture (DESIGN.md).

`policy(logits, rows)` applies the logit processors (bias, penalties, grammar bitmask,
min_tokens) and the truncation (temperature, top-k, top-p, min-p) to raw float32 logits and
returns the distribution in *sorted* layout: token ids by probability (desc, ties by id)
with log-probabilities, -inf outside the support. Greedy rows are top-k 1, which picks the
lowest-id argmax. Random draws come from a counter-based hash of (seed, position,
purpose), so a seeded sample never depends on what else is in the batch, or on preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.spec.grammar import apply_bitmask

PURPOSE_SAMPLE = 1  # the token drawn from p (or from the residual after a rejection)
PURPOSE_ACCEPT = 2  # the acceptance test of a draft token
PURPOSE_DRAFT = 3  # a drafter sampling its own proposal from q

_M32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding 32-bit values."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def uniform(seeds: torch.Tensor, positions: torch.Tensor, purpose: int) -> torch.Tensor:
    """Uniforms in (0, 1), a pure function of (seed, position, purpose).

    seeds: [N] int64 (any 63-bit value), positions: [N] int64 -> [N] float32
    """
    return uniform_of_keys(uniform_keys(seeds, positions), purpose)


def uniform_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The (seed, position) part of `uniform`'s hash, to share between purposes (each hash
    round is ten small kernels): `uniform_of_keys(uniform_keys(s, p), purpose) == uniform(s, p,
    purpose)`. seeds, positions: [N] int64 -> [N] int64."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    h = _fmix32(lo ^ 0x9E3779B9)
    h = _fmix32(h ^ hi)
    return _fmix32(h ^ ((positions * 0x27D4EB2F) & _M32))


def uniform_of_keys(keys: torch.Tensor, purpose: int) -> torch.Tensor:
    """[N] int64 keys of `uniform_keys` -> [N] float32 uniforms in (0, 1) for `purpose`."""
    h = _fmix32(keys ^ (purpose * 0x165667B1))
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))  # 23 bits: k + 0.5 is exact in float32


@dataclass
class RowParams:
    """Per-row sampling parameters on the device (one row per logits row).

    Processor inputs are None when no row of the batch needs them, so requests that do not
    use a processor cost nothing.
    """

    temperature: torch.Tensor  # [N] float32, 1.0 on greedy rows
    top_k: torch.Tensor  # [N] int64, 1 on greedy rows, V when off
    top_p: torch.Tensor  # [N] float32
    min_p: torch.Tensor  # [N] float32
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, token ids, values
    counts: torch.Tensor | None = None  # [N, V] float32 token counts of prompt + output (+ earlier drafts)
    penalties: torch.Tensor | None = None  # [N, 3] repetition, frequency, presence
    bitmask: torch.Tensor | None = None  # [N, ceil(V/32)] int32 grammar bitmask, -1 = all allowed
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, token ids: min_tokens EOS / stop ids
    all_greedy: bool = False  # host flag: every row is greedy, so p is the argmax alone


@dataclass
class Policy:
    """p_j for every row, in sorted layout. The first `support_len` columns are the support; a
    batch of greedy rows only carries that one column (V' = 1), any other batch all V."""

    sorted_ids: torch.Tensor  # [N, V'] int64, by probability desc, ties by id
    sorted_logp: torch.Tensor  # [N, V'] float32, -inf outside the support
    support_len: torch.Tensor  # [N] int64, the support is the first support_len entries
    vocab_size: int

    def probs(self) -> torch.Tensor:
        """p in vocabulary layout: [N, V] float32."""
        out = self.sorted_logp.new_zeros(self.sorted_logp.shape[0], self.vocab_size)
        return out.scatter_(1, self.sorted_ids, self.sorted_logp.exp())

    def logprob_of(self, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """log p_row(token): rows, tokens [M] -> [M] float32 (-inf outside the support)."""
        hit = self.sorted_ids[rows] == tokens[:, None]  # [M, V']
        return torch.where(hit, self.sorted_logp[rows], float("-inf")).amax(dim=1)


def apply_processors(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """Contract 1 step 1, in order: logit bias, penalties, grammar bitmask, min_tokens.
    logits: [N, V] float32, modified in place and returned."""
    if rows.bias is not None:
        r, t, v = rows.bias
        logits.index_put_((r, t), v, accumulate=True)
    if rows.counts is not None:
        rep, freq, pres = rows.penalties.unbind(dim=1)  # each [N]
        seen = rows.counts > 0
        scaled = torch.where(logits > 0, logits / rep[:, None], logits * rep[:, None])
        logits = torch.where(seen, scaled, logits)
        logits -= freq[:, None] * rows.counts + pres[:, None] * seen
    if rows.bitmask is not None:
        apply_bitmask(logits, rows.bitmask)
    if rows.banned is not None:
        logits.index_put_(rows.banned, logits.new_full((), float("-inf")))
    return logits


def policy(logits: torch.Tensor, rows: RowParams) -> Policy:
    """Contract 1: raw logits [N, V] float32 -> p_j in sorted layout."""
    z = apply_processors(logits.float().clone(), rows)
    if rows.all_greedy:  # {argmax z} with probability 1; argmax takes the lowest id among ties
        ids = z.argmax(dim=1, keepdim=True)  # [N, 1]
        allowed = z.gather(1, ids) > float("-inf")  # [N, 1]; False: the processors left no token
        logp = torch.zeros(ids.shape, device=z.device).masked_fill_(~allowed, float("-inf"))
        return Policy(ids, logp, allowed[:, 0].long(), z.shape[1])
    z = z / rows.temperature[:, None]
    sorted_z, sorted_ids = torch.sort(z, dim=1, descending=True, stable=True)
    rank = torch.arange(z.shape[1], device=z.device)
    keep = (rank[None, :] < rows.top_k[:, None]) & (sorted_z > float("-inf"))
    probs = torch.softmax(sorted_z.masked_fill(~keep, float("-inf")), dim=1)
    # top_p == 1 is off: a float32 cumsum reaches 1 before the tail, which must stay
    keep &= ((probs.cumsum(dim=1) - probs) < rows.top_p[:, None]) | (rows.top_p[:, None] >= 1.0)
    keep &= probs >= rows.min_p[:, None] * probs[:, :1]
    sorted_logp = torch.log_softmax(sorted_z.masked_fill(~keep, float("-inf")), dim=1)
    return Policy(sorted_ids, sorted_logp, keep.sum(dim=1), z.shape[1])


def sample_sorted(sorted_probs: torch.Tensor, support_len: torch.Tensor | int, u: torch.Tensor) -> torch.Tensor:
    """The one inverse-CDF draw: [..., V] probs (need not be normalised), u [...] -> index [...]
    into the last dimension, always inside the first support_len entries ([...] int64, or one int
    for every row). Policy rows are in sorted layout; a drafter draws its q in vocabulary order."""
    cdf = sorted_probs.cumsum(dim=-1)  # [..., V]
    target = (u * cdf[..., -1])[..., None]
    idx = (cdf <= target).sum(dim=-1)
    if isinstance(support_len, int):
        return idx.clamp(max=support_len - 1)
    return torch.minimum(idx, (support_len - 1).clamp(min=0))
