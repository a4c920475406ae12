"""Top-p rows without top-k (docs/sampling.md, step 3): the support is the shortest prefix of the
whole row, sorted by probability (desc, ties by id), whose mass reaches top_p. A trained model's row
reaches top_p 0.95 within tens to a few thousand tokens, so the row need not be sorted:

* candidates: each row's `width` most probable tokens (`top_candidates`: ties at the cutoff to the
  lowest ids, exactly the head of the row's stable sort), with the mass of the whole row (exp(z -
  max) / the row's sum). If their running mass reaches top_p (at the boundary exactly as the full
  sort's: the same sums in the same order), the support lies inside them and is the full sort's.
* escalation: rows whose candidates fall short try the next width of `STAGE_WIDTHS`; rows short at
  the last width sort (`top_p_by_sort`, with the same row max and sum, so its first columns' running
  sums are the candidates'). So do rows whose next width cannot reach top_p by the bound the current
  candidates give (their mass plus the next width's extra tokens, each at most as probable as the
  last candidate): a flat row (support ~100k tokens) sorts after the first width instead of taking
  the second too (on the H200 such rows cost 110.7 ms at 2,304 rows against 48.3 before candidates).

Rows that reach at the first width stay in the compact candidate layout (ids and log p, [n, W]),
which sampling and verification read as they read top-k rows; rows settled later are written into
z in vocabulary order (-inf outside the support), as a row without truncation is read.

Which rows fall short, and which of them may reach at the next width, is read on the host
(`_short_rows`), once per stage that runs on rows wider than the stage: a stated exception to one
synchronisation per step (tests/test_host_syncs.py), made only in steps that have top-p rows
without top-k. Why a read: the fallback's cost has to follow the rows that need it. Without a read
the work is launched for every top-p row, so a sync-free fallback (a sort, or an exact threshold
search on the device: one pass over [P, V] per bisection step, ~32) would cost every step what the
worst row costs, and a batch of peaked rows, the usual case, would pay it to save nothing. The read
costs the host's head start on the rest of the step (it waits for the forward pass before launching
the policy's last kernels, verification and capture).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rollout.engine.transfer import upload
from rollout.engine.truncation import (
    ELEMENTWISE_BYTES,
    NEG_INF,
    TOPK_BYTES,
    chunk_rows,
    top_candidates,
    top_p_by_sort,
    truncate_top_p,
)

STAGE_WIDTHS = (1024, 16384)  # candidates per row at each stage, before the sort


@dataclass
class TopPCandidates:
    """The top-p rows whose support lies in the first stage's candidates, in the candidate layout."""

    rows: np.ndarray  # [n] int64 host: their rows of z
    ids: Tensor  # [n, W] int64 by probability desc, ties by id
    logp: Tensor  # [n, W] float32, the support first, then -inf


def top_p_rows(z: Tensor, rows: np.ndarray, top_p: Tensor, min_p: Tensor) -> TopPCandidates:
    """Top-p (then min-p) on the host-known `rows` [P] of the tempered logits z [R, V] (top_p, min_p:
    [R]): the rows settled by the first stage are returned; the others are set to -inf in place
    outside their support."""
    index = upload(rows, torch.int64, z.device)  # [P]
    row_max, row_sum = _row_max_and_sum(z, index)  # [P] each
    pending = np.arange(len(rows))  # positions in `rows` not settled yet
    hopeless = []  # positions whose next candidates cannot reach top_p either: to the sort
    first = None
    for stage, width in enumerate(STAGE_WIDTHS):
        pos = upload(pending, torch.int64, z.device)
        later = STAGE_WIDTHS[stage + 1] if stage + 1 < len(STAGE_WIDTHS) else 0
        later = later if later < z.shape[1] else 0  # candidates of the whole row: the sort, cheaper
        ids, logp, reached, reachable = _candidates(z, index[pos], min(width, z.shape[1]), later, top_p, min_p,
                                                    row_max[pos], row_sum[pos])
        if width < z.shape[1]:
            short, next_stage = _short_rows(reached, reachable)
        else:
            short = next_stage = np.zeros(len(pending), dtype=bool)
        done = upload(np.flatnonzero(~short), torch.int64, z.device)
        if stage == 0:
            first = TopPCandidates(rows[pending[~short]], ids[done], logp[done])
        else:
            _write_supports(z, index[pos[done]], ids[done], logp[done])
        hopeless.append(pending[short & ~next_stage])
        pending = pending[short & next_stage]
        if not len(pending):
            break
    last = np.sort(np.concatenate([*hopeless, pending]))
    if len(last):
        at = upload(last, torch.int64, z.device)
        top_p_by_sort(z, rows[last], top_p, min_p, row_max[at], row_sum[at])
    return first


def _short_rows(reached: Tensor, reachable: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The host read, one copy of both [n] bool tensors: (short, worth the next stage) on the host,
    short where a row's candidates fall short of top_p."""
    reached_host, reachable_host = np.array(torch.stack([reached, reachable]).tolist(), dtype=bool)
    return ~reached_host, reachable_host


def _row_max_and_sum(z: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's largest logit and sum of exp(z - max), for the rows `index` [P] of z [R, V]:
    [P] each, in row chunks."""
    maxes, sums = [], []
    for part in _chunks(z, index, ELEMENTWISE_BYTES):
        row_max = part.amax(dim=1)  # [n]
        shift = row_max.clamp(min=torch.finfo(z.dtype).min)  # a row without any token: exp(-inf) = 0
        maxes.append(row_max)
        sums.append((part - shift[:, None]).exp_().sum(dim=1))
    return torch.cat(maxes), torch.cat(sums)


def _candidates(z: Tensor, index: Tensor, width: int, later: int, top_p: Tensor, min_p: Tensor, row_max: Tensor,
                row_sum: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The `width` candidates of the rows `index` [n] of z and their truncation: ids [n, W], log p
    [n, W], reached [n] bool (truncate_top_p), and reachable [n] bool: whether `later` candidates
    (0: none) could reach top_p, by the bound the W candidates give (their mass, plus later - W
    tokens at most as probable as the W-th). A row that fails it skips to the sort."""
    ids, logp, reached, reachable = [], [], [], []
    step = chunk_rows(z.shape[1], TOPK_BYTES + ELEMENTWISE_BYTES)
    for a, part in zip(range(0, len(index), step), _chunks(z, index, TOPK_BYTES + ELEMENTWISE_BYTES)):
        own, rows = slice(a, a + step), index[a:a + step]
        cand = top_candidates(part, width)  # [n, W]
        vals = part.gather(1, cand)  # [n, W]
        lp, ok = truncate_top_p(vals, top_p[rows], min_p[rows], row_max[own], row_sum[own])
        shift = row_max[own].clamp(min=torch.finfo(z.dtype).min)
        total = row_sum[own].clamp(min=torch.finfo(z.dtype).tiny)
        p = (vals - shift[:, None]).exp_().div_(total[:, None])  # [n, W] of the whole row
        bound = p.sum(dim=1) + (later - width) * p[:, -1]  # [n]
        ids.append(cand), logp.append(lp), reached.append(ok), reachable.append((bound >= top_p[rows]) & (later > 0))
    return torch.cat(ids), torch.cat(logp), torch.cat(reached), torch.cat(reachable)


def _write_supports(z: Tensor, index: Tensor, ids: Tensor, logp: Tensor) -> None:
    """-inf in place on the rows `index` [n] of z outside their support (ids [n, W] whose log p
    [n, W] is finite), in row chunks."""
    step = chunk_rows(z.shape[1], ELEMENTWISE_BYTES)
    for a in range(0, len(index), step):
        rows, kept = index[a:a + step], logp[a:a + step] > NEG_INF  # [n], [n, W]
        inside = torch.zeros(len(rows), z.shape[1], dtype=torch.bool, device=z.device)
        z[rows] = z[rows].masked_fill_(~inside.scatter_(1, ids[a:a + step], kept), NEG_INF)


def _chunks(z: Tensor, index: Tensor, bytes_per_logit: int):
    """The rows `index` [n] of z [R, V] in consecutive chunks whose temporaries, at bytes_per_logit,
    take about CHUNK_BYTES: copies [m, V], or views when `index` holds every row (the callers' row
    sets are ascending, so a set of R rows is 0..R-1)."""
    step = chunk_rows(z.shape[1], bytes_per_logit)
    every = len(index) == z.shape[0]
    for a in range(0, len(index), step):
        yield z[a:a + step] if every else z[index[a:a + step]]
