"""The mask packer against a straightforward per-row reference, plus the host-side unpack."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rollout.masks.pack import pack_supports, unpack_supports


def _sorted_policy(n: int, vocab: int, lens: list[int], seed: int = 0):
    """Rows sorted by prob desc (ties by id) with -inf beyond each row's support length."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g)
    logits[0, :4] = 1.5  # a tie, broken by id
    order = torch.stack(
        [torch.tensor(sorted(range(vocab), key=lambda t, r=r: (-logits[r, t].item(), t))) for r in range(n)]
    )  # [N, V]
    sorted_logits = logits.gather(1, order)
    keep = torch.arange(vocab)[None, :] < torch.tensor(lens)[:, None]
    sorted_logp = torch.log_softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    return order, sorted_logp


def _reference(sorted_ids, sorted_logp, width):
    ids, logp, lens = [], [], []
    for row_ids, row_logp in zip(sorted_ids.tolist(), sorted_logp.tolist()):
        support = [(t, lp) for t, lp in zip(row_ids, row_logp) if math.isfinite(lp)]
        lens.append(len(support))
        kept = support[:width] + [(-1, float("-inf"))] * (width - min(width, len(support)))
        ids.append([t for t, _ in kept])
        logp.append([lp for _, lp in kept])
    return ids, logp, lens


@pytest.mark.parametrize("width", [1, 3, 8, 40])
def test_pack_matches_reference(width):
    lens = [1, 3, 8, 5, 17, 2]
    sorted_ids, sorted_logp = _sorted_policy(len(lens), 32, lens)
    ids, logp, support_len = pack_supports(sorted_ids, sorted_logp, width)
    ref_ids, ref_logp, ref_lens = _reference(sorted_ids, sorted_logp, width)
    assert ids.dtype == torch.int32 and logp.dtype == torch.float32 and support_len.dtype == torch.int32
    assert ids.shape == (len(lens), width) == logp.shape
    assert ids.tolist() == ref_ids
    assert torch.equal(logp, torch.tensor(ref_logp))
    # exact up to width; longer supports are flagged as width + 1
    assert support_len.tolist() == [min(n, width + 1) for n in ref_lens]
    assert ((support_len > width).tolist()) == [n > width for n in ref_lens]


def test_pack_narrow_input_pads():
    """V smaller than width (the caller passed a top-k slice): rows are padded."""
    sorted_ids, sorted_logp = _sorted_policy(2, 4, [2, 4])
    ids, logp, support_len = pack_supports(sorted_ids, sorted_logp, 6)
    assert ids.shape == (2, 6)
    assert ids[0, 2:].tolist() == [-1] * 4 and ids[1, 4:].tolist() == [-1] * 2
    assert torch.isinf(logp[0, 2:]).all() and support_len.tolist() == [2, 4]


def test_greedy_singleton():
    sorted_ids = torch.tensor([[7, 1, 2, 3]])
    sorted_logp = torch.tensor([[0.0, float("-inf"), float("-inf"), float("-inf")]])
    ids, logp, support_len = pack_supports(sorted_ids, sorted_logp, 4)
    assert ids.tolist() == [[7, -1, -1, -1]] and logp[0, 0].item() == 0.0 and support_len.tolist() == [1]


def test_equal_logprobs_come_out_in_id_order():
    """Distinct logits can round to one float32 log-prob; unpacking orders those runs by id."""
    inf = float("-inf")
    sorted_ids = torch.tensor([[5, 9, 4, 7, 1, 0], [3, 2, 8, 0, 1, 4], [1, 2, 3, 4, 5, 6]])
    sorted_logp = torch.tensor(
        [
            [-0.5, -2.0, -2.0, -2.0, -3.0, inf],
            [-0.25, -0.25, -4.0, inf, inf, inf],
            [-1.0, -1.0, -2.0, inf, inf, inf],
        ]
    )
    ids, logp, support_len = pack_supports(sorted_ids, sorted_logp, 5)
    packed = ids.numpy().copy()
    sup_ids, sup_logp = unpack_supports(ids.numpy(), logp.numpy(), support_len.numpy(), with_logprobs=True)
    assert sup_ids == [[5, 4, 7, 9, 1], [2, 3, 8], [1, 2, 3]]
    assert sup_logp == [[-0.5, -2.0, -2.0, -2.0, -3.0], [-0.25, -0.25, -4.0], [-1.0, -1.0, -2.0]]
    assert np.array_equal(ids.numpy(), packed)  # the caller's host buffers are not reordered


def test_unpack_roundtrip_and_overflow():
    lens = [1, 3, 8, 5]
    sorted_ids, sorted_logp = _sorted_policy(len(lens), 16, lens, seed=3)
    width = 5
    ids, logp, support_len = pack_supports(sorted_ids, sorted_logp, width)
    sup_ids, sup_logp = unpack_supports(ids.numpy(), logp.numpy(), support_len.numpy(), with_logprobs=True)
    ref_ids, ref_logp, _ = _reference(sorted_ids, sorted_logp, width)
    for r, n in enumerate(lens):
        if n > width:
            assert sup_ids[r] == [] and sup_logp[r] == []  # overflow: never a valid mask
        else:
            assert sup_ids[r] == ref_ids[r][:n]
            np.testing.assert_allclose(sup_logp[r], ref_logp[r][:n], rtol=0, atol=0)
    sel_ids, sel_logp = unpack_supports(ids, logp, support_len, with_logprobs=False)
    assert sel_logp is None and sel_ids == sup_ids
    assert unpack_supports(ids[:0], logp[:0], support_len[:0], True) == ([], [])
