"""The sampling distribution (docs/sampling.md): the one definition used by sampling,
speculative verification and mask capture.

`policy(logits, rows)` applies the logit processors (bias, penalties, grammar bitmask,
min_tokens) and the truncation (temperature, top-k, top-p, min-p) to raw float32 logits and
returns p_j of every row in the layout its truncation needs, so that a row costs what its
request asks for. Which path a row takes is known on the host from the request parameters
(`RowPlan`), without reading the device, except for top-p rows without top-k (below):

* cand layout, rows with a top-k (greedy rows are top-1; mask rows always have one): the k most
  probable tokens, found without sorting the vocabulary (ties at the k-th value to the lowest
  ids, as a stable sort would), sorted by probability desc, ties by id, with top-p and min-p
  applied inside them: [R, C] ids and log-probs, C the batch's largest top_k (or the top-p rows'
  first width, when wider; a row's columns past its own are filler). Mask capture reads these
  columns as they are.
* top-p rows without top-k (rollout.engine.top_p): their most probable tokens first; a row whose
  first candidates reach top_p is in the cand layout too, a row that needs more (more candidates, or
  its whole row sorted) ends in the vocab layout. Which rows fall short is read on the host (the
  one read of the device here, only in steps with such rows).
* vocab layout, every other row: log p over the vocabulary in vocabulary order, -inf outside the
  support. No truncation (the RL default) or min-p only: no sort at all.

Draws are inverse-CDF draws in the layout's own order (any fixed order gives an exact draw):
`Policy.draw` for plain sampling and for the verifier's residual / bonus, `Policy.logprob_of`
for p(draft). Random draws come from a counter-based hash of (seed, position, purpose), so a
seeded sample never depends on what else is in the batch, or on preemption.

Memory, in [R, V] float32-sized tensors alive above the step's logits (R rows, E <= R sampling
entries, D drafts; "chunk": a row chunk's temporaries, <= CHUNK_BYTES = 1 GiB, whatever R),
with the engine's `overwrite` (compute_logits' float32 logits become z and then log p):
* vocab rows (no truncation, min-p): 0 + a chunk (logsumexp, min-p). Plain sampling (E = R)
  then copies the rows to exponentiate and sum them: 1.25. With drafts, only the E final rows
  are read: ~4.25 x [E, V] (p, the rejected draft's q row, the residual, its fallback pick).
* cand rows (top-k): 0 + a chunk (the tie mask and its running count) + topk's own; then
  [R, C]. Draws and verification read [E, C].
* top-p rows without top-k: 0 + a chunk (candidates) + [P, W] candidates; a chunk of sort
  temporaries for the rows that sort.
* a batch mixing top-k rows with other rows adds a copy of the top-k rows' logits ([Rc, V]).
Without `overwrite` add 1 (the copy). The drafter keeps no q beside its logits (`Proposal`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rollout.engine.grammar import apply_bitmask
from rollout.engine.top_p import TopPCandidates, top_p_rows
from rollout.engine.transfer import upload
from rollout.engine.truncation import NEG_INF, logsumexp_rows, min_p_in_vocab_order, top_candidates, truncate_sorted

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


CAND, TOP_P, VOCAB = 0, 1, 2  # RowPlan.kind: top-k candidates; top-p without top-k; vocabulary order


@dataclass(frozen=True)
class RowPlan:
    """Host side: the truncation path of every row, from the request parameters (no device read)."""

    kind: np.ndarray  # [R] int8: CAND (top-k, greedy, or a mask row), TOP_P (top-p, no top-k), VOCAB (the rest)
    width: int  # C: the largest top_k among CAND rows (0 without any)
    min_p: bool  # some VOCAB row has min_p > 0

    @classmethod
    def of(cls, top_k, top_p, min_p, vocab_size: int, masked=None) -> RowPlan:
        """top_k [R] (>= vocab_size: off), top_p, min_p [R], masked [R] bool or None: host arrays."""
        top_k, top_p, min_p = np.asarray(top_k), np.asarray(top_p), np.asarray(min_p)
        cand = top_k < vocab_size
        if masked is not None:
            cand |= np.asarray(masked, dtype=bool)
        kind = np.where(cand, CAND, np.where(top_p < 1.0, TOP_P, VOCAB)).astype(np.int8)
        width = int(np.minimum(top_k[cand], vocab_size).max()) if cand.any() else 0
        return cls(kind, width, bool((min_p[kind == VOCAB] > 0).any()))


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
    plan: RowPlan | None = None  # host: each row's path; None = read from the tensors (a device read:
    # for tests and tools only; the engine builds it from the requests, rollout.engine.rows)


@dataclass
class Policy:
    """p_j for every row [R] (module docstring): rows of the cand layout read `cand_ids` /
    `cand_logp`, the others `vocab_logp`; a layout no row uses is None."""

    cand_ids: Tensor | None  # [R, C] int64 by probability desc, ties by id (vocab rows: unused)
    cand_logp: Tensor | None  # [R, C] float32, the support first, then -inf
    vocab_logp: Tensor | None  # [R, V] float32 in vocabulary order, -inf outside the support (cand rows: unused)
    in_cand: Tensor | None  # [R] bool: the row is in the cand layout; only when both layouts are used
    has_support: Tensor  # [R] bool: False when the processors left the row no token at all
    vocab_size: int

    @property
    def all_greedy(self) -> bool:
        """Every row is one column (greedy, top-1): p is 1 on it."""
        return self.vocab_logp is None and self.cand_ids.shape[1] == 1

    def logprob_of(self, rows: Tensor, tokens: Tensor) -> Tensor:
        """log p_row(token): rows, tokens [M] -> [M] float32 (-inf outside the support)."""
        def cand():
            hit = self.cand_ids[rows] == tokens[:, None]  # [M, C]
            return (torch.where(hit, self.cand_logp[rows], NEG_INF).amax(dim=1),)
        return self._either(rows, cand, lambda: (self.vocab_logp[rows, tokens],))[0]

    def draw(self, rows: Tensor, u: Tensor, minus: Callable[[Tensor | None], Tensor] | None = None):
        """A token from p_row by inverse CDF with uniforms u, or with `minus` from
        normalise(max(p_row - q, 0)) (p_row where that is empty), q = minus(ids): q at the cand
        ids [M, C], or minus(None): over the vocabulary [M, V]. rows, u: [M] ->
        (tokens [M] int64, log p_row(token) [M] float32)."""
        def cand():
            ids, logp = self.cand_ids[rows], self.cand_logp[rows]  # [M, C]
            weights = logp.exp()
            if minus is not None:
                weights = _residual(weights, minus(ids))
            idx = draw_index(weights, u)[:, None]
            return ids.gather(1, idx)[:, 0], logp.gather(1, idx)[:, 0]

        def vocab():
            weights = self.vocab_logp[rows].exp_()  # [M, V]: the one copy, exponentiated in place
            if minus is not None:
                weights = _residual(weights, minus(None))
            tokens = draw_index(weights, u)
            return tokens, self.vocab_logp[rows, tokens]

        return self._either(rows, cand, vocab)

    def probs(self) -> Tensor:
        """p in vocabulary layout: [R, V] float32."""
        out = self.vocab_logp.exp() if self.vocab_logp is not None else None
        if self.cand_ids is not None:
            cand = torch.zeros(self.has_support.shape[0], self.vocab_size, device=self.has_support.device)
            cand.scatter_add_(1, self.cand_ids, self.cand_logp.exp())  # filler columns add 0 (their ids repeat)
            out = cand if out is None else torch.where(self.in_cand[:, None], cand, out)
        return out

    def _either(self, rows: Tensor, cand: Callable[[], tuple], vocab: Callable[[], tuple]) -> tuple:
        """Results per row [M] from the layout of each row: cand() and vocab() each return a tuple
        of [M] tensors; a batch with both layouts computes both (over its M rows) and picks."""
        if self.vocab_logp is None:
            return cand()
        if self.cand_ids is None:
            return vocab()
        pick = self.in_cand[rows]
        return tuple(torch.where(pick, a, b) for a, b in zip(cand(), vocab()))


def _residual(p: Tensor, q: Tensor) -> Tensor:
    """max(p - q, 0), or p where that is all zero (p == q up to rounding). [M, W] -> [M, W]."""
    residual = (p - q).clamp_(min=0)
    return torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p)


def draw_index(weights: Tensor, u: Tensor) -> Tensor:
    """The one inverse-CDF draw: weights [..., W] >= 0 (need not be normalised; overwritten with
    their running sums), u [...] in (0, 1) -> [...] int64 index of a positive weight (W - 1 when
    all are 0). Exact in any fixed order of the columns: probability order (cand rows) or
    vocabulary order (vocab rows, a drafter's q)."""
    cdf = weights.cumsum_(dim=-1)
    total = cdf[..., -1:]
    target = torch.minimum(u[..., None] * total, total.nextafter(torch.zeros_like(total)))  # < total
    return (cdf <= target).sum(dim=-1).clamp_(max=cdf.shape[-1] - 1)


def apply_processors(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """The processors (docs/sampling.md, step 1), in order: logit bias, penalties, grammar bitmask, min_tokens.
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


def policy(logits: Tensor, rows: RowParams, overwrite: bool = False) -> Policy:
    """The sampling distribution: raw logits [R, V] -> p_j of every row (module docstring). `overwrite`: the
    caller does not read float32 `logits` again, so they are worked on in place."""
    z = logits.float()
    if z is logits and not overwrite:
        z = z.clone()
    z = apply_processors(z, rows)
    if rows.all_greedy:  # {argmax z} with probability 1
        ids, logp = _argmax(z)
        return Policy(ids, logp, None, None, logp[:, 0] == 0, z.shape[1])
    z.div_(rows.temperature[:, None])
    plan = rows.plan if rows.plan is not None else RowPlan.of(
        rows.top_k.tolist(), rows.top_p.tolist(), rows.min_p.tolist(), z.shape[1])
    top_p = np.flatnonzero(plan.kind == TOP_P)
    found = top_p_rows(z, top_p, rows.top_p, rows.min_p) if len(top_p) else None  # z: the other top-p rows
    in_cand = plan.kind == CAND  # [R] host
    if found is not None:
        in_cand[found.rows] = True
    cand = _cand_layout(z, rows, plan, found) if in_cand.any() else None  # (ids, log p), [R, C] each
    vocab = _vocab_layout(z, rows, plan) if not in_cand.all() else None  # (log p [R, V], support [R])
    if vocab is None:
        return Policy(*cand, None, None, cand[1][:, 0] > NEG_INF, z.shape[1])
    if cand is None:
        return Policy(None, None, *vocab[:1], None, vocab[1], z.shape[1])
    in_cand = upload(in_cand, torch.bool, z.device)  # [R]
    has_support = torch.where(in_cand, cand[1][:, 0] > NEG_INF, vocab[1])
    return Policy(*cand, vocab[0], in_cand, has_support, z.shape[1])


def _argmax(z: Tensor) -> tuple[Tensor, Tensor]:
    """The one-column policy: ids [R, 1] (argmax takes the lowest id among ties), log p [R, 1]:
    0, or -inf where the processors left the row no token."""
    ids = z.argmax(dim=1, keepdim=True)
    logp = torch.zeros(ids.shape, device=z.device)
    return ids, logp.masked_fill_(z.gather(1, ids) == NEG_INF, NEG_INF)


def _cand_layout(z: Tensor, rows: RowParams, plan: RowPlan, found: TopPCandidates | None) -> tuple[Tensor, Tensor]:
    """The CAND rows' top-k candidates and the `found` top-p rows' candidates, with their truncated
    log p: [R, C] ids and log-probs, C the widest (rows of other kinds, and columns past a row's
    own width, hold filler: id 0, log p -inf)."""
    parts = [_top_k_rows(z, rows, plan)] if plan.width else []  # (rows [n] or None: every row, ids, log p)
    if found is not None and len(found.rows):
        parts.append((upload(found.rows, torch.int64, z.device), found.ids, found.logp))
    if len(parts) == 1 and parts[0][0] is None:
        return parts[0][1:]
    width = max(ids.shape[1] for _, ids, _ in parts)
    full_ids = torch.zeros(z.shape[0], width, dtype=torch.int64, device=z.device)
    full_logp = torch.full((z.shape[0], width), NEG_INF, device=z.device)
    for index, ids, logp in parts:  # the parts' rows are disjoint, apart from filler rows of `None`
        at = slice(None) if index is None else index
        full_ids[at, :ids.shape[1]] = ids
        full_logp[at, :ids.shape[1]] = logp
    return full_ids, full_logp


def _top_k_rows(z: Tensor, rows: RowParams, plan: RowPlan) -> tuple[Tensor | None, Tensor, Tensor]:
    """The CAND rows' candidates: (their rows [Rc], or None when computed for every row), ids and
    log p [Rc or R, plan.width]."""
    if plan.width == 1:  # greedy / top-1 rows only: every row's argmax costs less than a gather
        return None, *_argmax(z)
    idx = np.flatnonzero(plan.kind == CAND)
    if len(idx) == z.shape[0]:
        ids = top_candidates(z, plan.width)  # [R, C]
        return None, ids, truncate_sorted(z.gather(1, ids), rows.top_k, rows.top_p, rows.min_p)
    index = upload(idx, torch.int64, z.device)  # [Rc]
    sub = z[index]  # [Rc, V]
    ids = top_candidates(sub, plan.width)
    logp = truncate_sorted(sub.gather(1, ids), rows.top_k[index], rows.top_p[index], rows.min_p[index])
    return index, ids, logp


def _vocab_layout(z: Tensor, rows: RowParams, plan: RowPlan) -> tuple[Tensor, Tensor]:
    """log p in vocabulary order, in place on the tempered logits z [R, V] (rows of the cand layout:
    filler), and which rows have a token at all ([R] bool). Top-p rows not in the cand layout are
    already -inf outside their support (rollout.engine.top_p)."""
    if plan.min_p:
        min_p_in_vocab_order(z, rows.min_p)
    lse = logsumexp_rows(z)  # [R, 1]
    has_support = lse[:, 0] > NEG_INF
    return z.sub_(lse.masked_fill_(~has_support[:, None], 0.0)), has_support
