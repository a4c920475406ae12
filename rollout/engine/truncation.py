"""Contract 1 step 3, the truncation, on the paths `rollout.engine.sampler.policy` picks per row.

* `top_candidates`: the k most probable tokens of each row without sorting the vocabulary: one
  `topk` on an int64 key made of the logit's order-preserving bits and the token id, so ties at
  the k-th value go to the lowest ids exactly as a stable sort would (`torch.topk` alone picks
  among ties as it likes).
* `truncate_sorted`: the one statement of top-k / top-p / min-p on rows sorted by probability
  (desc, ties by id): candidate columns, or whole sorted rows.
* `top_p_by_sort`: top-p rows without top-k, which sort their rows (see there for why).
* `min_p_in_vocab_order`: min-p without top-p needs no order at all.

Rows are worked in chunks of about `CHUNK_ELEMENTS` logits, so the temporaries of these paths stay
bounded whatever the batch (a speculative step at 256 sequences x 9 rows is 2304 rows).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from rollout.engine.transfer import upload

CHUNK_ELEMENTS = 1 << 24  # logits per chunk: 64 MiB of float32; the top-k key takes 256 MiB, a sort ~550 MiB
NEG_INF = float("-inf")


def min_p_keeps(z: Tensor, min_p: Tensor) -> Tensor:
    """Min-p on tempered logits z [N, W]: p >= min_p * p_max <=> z - z_max >= log(min_p) (the
    difference of two close logits is exact in float32, their sum with log(min_p) would round).
    min_p: [N] (0 keeps everything). Returns [N, W] bool."""
    return (z - z.amax(dim=1, keepdim=True)) >= min_p.log()[:, None]


def truncate_sorted(vals: Tensor, top_k: Tensor | None, top_p: Tensor, min_p: Tensor) -> Tensor:
    """Top-k, then top-p (the shortest prefix whose mass reaches top_p; 1 = off), then min-p, then
    renormalise, on tempered logits sorted by value desc, ties by id (so by probability).

    vals: [N, W] float32 (-inf: excluded); top_k: [N] int64 or None (every column); top_p,
    min_p: [N] float32. Returns log p [N, W] float32, -inf outside the support (a prefix).
    """
    keep = vals > NEG_INF  # [N, W]
    if top_k is not None:
        keep &= torch.arange(vals.shape[1], device=vals.device) < top_k[:, None]
    masked = vals.masked_fill(~keep, NEG_INF)
    mass = torch.softmax(masked, dim=1).cumsum_(dim=1)  # [N, W] float32 running sums
    # a token stays while the running sum before it is short of top_p: the prefix ends at the
    # first token whose running sum reaches top_p (the sum compared is exactly the one the
    # prefix reaches). top_p == 1 is off: a float32 sum reaches 1 before the tail, which stays.
    keep[:, 1:] &= (mass[:, :-1] < top_p[:, None]) | (top_p[:, None] >= 1.0)
    del mass
    keep &= min_p_keeps(vals, min_p)
    masked.masked_fill_(~keep, NEG_INF)
    lse = torch.logsumexp(masked, dim=1, keepdim=True)  # [N, 1]; -inf: no token left, log p stays -inf
    return masked.sub_(lse.masked_fill_(lse == NEG_INF, 0.0))


def top_candidates(z: Tensor, width: int) -> Tensor:
    """The `width` largest logits of each row, by value desc, ties by lowest id.
    z: [N, V] float32 -> ids [N, width] int64."""
    low = (2**32 - 1) - torch.arange(z.shape[1], device=z.device)  # [V]: equal values, lower id ranks higher
    chunks = [_order_key(part, low).topk(width, dim=1).indices for part in _row_chunks(z)]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def _order_key(z: Tensor, low: Tensor) -> Tensor:
    """[n, V] float32 -> [n, V] int64 keys ordered as (value, -id): the float's sign-magnitude bits
    as a signed integer (monotone in the value, -0.0 == +0.0), shifted up, plus `low`."""
    key = z.view(torch.int32).to(torch.int64)  # sign-extended bits
    sign = key >> 63  # [n, V] -1 for negative floats, else 0
    key.bitwise_and_(0x7FFFFFFF).bitwise_xor_(sign).sub_(sign)  # +-magnitude
    del sign
    return key.bitwise_left_shift_(32).add_(low)


def top_p_by_sort(z: Tensor, rows: np.ndarray, top_p: Tensor, min_p: Tensor) -> None:
    """Top-p (and min-p) rows without top-k: -inf in place on z [R, V] outside each support, for the
    host-known `rows` [P]. These rows sort: the support is the shortest prefix reaching top_p, and
    finding its end exactly takes the order of the whole row. A preselection of candidates with a
    fallback for the rows it does not cover would need to know, on the host, which rows those are
    (a device read mid-step), or a kernel that skips the covered rows; without either, the
    fallback's cost is paid for every row, so it would only add the preselection's."""
    every = len(rows) == z.shape[0]
    index = None if every else upload(rows, torch.int64, z.device)  # [P]
    step = _chunk_rows(z.shape[1])
    for a in range(0, len(rows), step):
        pick = slice(a, a + step) if every else index[a:a + step]
        part = z[pick]  # a view when every row sorts, else a copy written back below
        sorted_z, order = part.sort(dim=1, descending=True, stable=True)
        kept = truncate_sorted(sorted_z, None, top_p[pick], min_p[pick]) > NEG_INF
        del sorted_z
        part.masked_fill_(~torch.empty_like(kept).scatter_(1, order, kept), NEG_INF)
        if not every:
            z[pick] = part


def min_p_in_vocab_order(z: Tensor, min_p: Tensor) -> None:
    """Min-p in place on z [R, V] (rows with min_p 0 keep everything), in vocabulary order."""
    for a, part in zip(range(0, z.shape[0], _chunk_rows(z.shape[1])), _row_chunks(z)):
        part.masked_fill_(~min_p_keeps(part, min_p[a:a + part.shape[0]]), NEG_INF)


def _chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab)


def _row_chunks(z: Tensor) -> list[Tensor]:
    """z [N, V] as views of consecutive row chunks."""
    return list(z.split(_chunk_rows(z.shape[1])))
