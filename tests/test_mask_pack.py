"""The mask packer against a straightforward per-row reference, plus the host side: the packed
rows, their flatten and a sample's assembly from several steps."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rollout.masks.pack import PackedRows, Supports, assemble_supports, flatten_supports, pack_supports


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


def unpack_supports(ids, logp, lens, with_logprobs: bool):
    """`flatten_supports` as one list per row."""
    flat_ids, flat_logp, lens = flatten_supports(ids, logp, lens)
    sup = Supports(flat_ids, lens, flat_logp if with_logprobs else None)
    return sup.id_lists(), sup.logprob_lists()


def _packed(sorted_ids, sorted_logp, width) -> PackedRows:
    """Through the device packer and the host reader, as the engine runs them."""
    packed = pack_supports(sorted_ids, sorted_logp, width)
    assert packed.dtype == torch.int32 and packed.is_contiguous()
    return PackedRows(packed.numpy(), width)


@pytest.mark.parametrize("width", [1, 3, 8, 40])
def test_pack_matches_reference(width):
    lens = [1, 3, 8, 5, 17, 2]
    vocab = 32
    sorted_ids, sorted_logp = _sorted_policy(len(lens), vocab, lens)
    rows = _packed(sorted_ids, sorted_logp, width)
    ref_ids, ref_logp, ref_lens = _reference(sorted_ids, sorted_logp, width)
    assert rows.ids.dtype == np.int32 and rows.logp.dtype == np.float32 and rows.lens().dtype == np.int32
    assert rows.ids.shape == (len(lens), min(vocab, width))
    assert rows.logp.shape == (len(lens), min(vocab, width + 1))
    for r, n in enumerate(ref_lens):
        k = min(n, width)
        assert rows.ids[r, :k].tolist() == ref_ids[r][:k]
        assert rows.logp[r, :k].tolist() == ref_logp[r][:k]  # bit-exact through the int32 packing
    # exact up to width; longer supports read width + 1
    assert rows.lens().tolist() == [min(n, width + 1) for n in ref_lens]
    assert rows.overflowed().tolist() == [n > width for n in ref_lens]


def test_pack_narrow_input():
    """V not above width (the caller passed a top-k slice, or a tiny vocabulary): every column
    travels, lengths are exact and nothing can overflow."""
    sorted_ids, sorted_logp = _sorted_policy(2, 4, [2, 4])
    rows = _packed(sorted_ids, sorted_logp, 6)
    assert rows.ids.shape == (2, 4) == rows.logp.shape
    assert rows.lens().tolist() == [2, 4] and not rows.overflowed().any()
    assert rows.ids.tolist() == sorted_ids.tolist()
    rows = _packed(sorted_ids, sorted_logp, 3)  # V = width + 1: the extra column is the last id's
    assert rows.ids.shape == (2, 3) and rows.logp.shape == (2, 4)
    assert rows.lens().tolist() == [2, 4] and rows.overflowed().tolist() == [False, True]


def test_greedy_singleton():
    sorted_ids = torch.tensor([[7, 1, 2, 3]])
    sorted_logp = torch.tensor([[0.0, float("-inf"), float("-inf"), float("-inf")]])
    rows = _packed(sorted_ids, sorted_logp, 1)
    assert rows.ids.tolist() == [[7]] and rows.logp[0, 0] == 0.0 and rows.lens().tolist() == [1]
    sup = assemble_supports([(rows, 0, 1)], with_logprobs=True)
    assert sup.id_lists() == [[7]] and sup.logprob_lists() == [[0.0]]


def test_equal_logprobs_come_out_in_id_order():
    """Distinct logits can round to one float32 log-prob; flattening orders those runs by id."""
    inf = float("-inf")
    sorted_ids = torch.tensor([[5, 9, 4, 7, 1, 0], [3, 2, 8, 0, 1, 4], [1, 2, 3, 4, 5, 6]])
    sorted_logp = torch.tensor(
        [
            [-0.5, -2.0, -2.0, -2.0, -3.0, inf],
            [-0.25, -0.25, -4.0, inf, inf, inf],
            [-1.0, -1.0, -2.0, inf, inf, inf],
        ]
    )
    rows = _packed(sorted_ids, sorted_logp, 5)
    packed = rows.ids.copy()
    sup = assemble_supports([(rows, 0, 3)], with_logprobs=True)
    assert sup.id_lists() == [[5, 4, 7, 9, 1], [2, 3, 8], [1, 2, 3]]
    assert sup.logprob_lists() == [[-0.5, -2.0, -2.0, -2.0, -3.0], [-0.25, -0.25, -4.0], [-1.0, -1.0, -2.0]]
    assert np.array_equal(rows.ids, packed)  # the step's host rows are not reordered


def test_unpack_roundtrip_and_overflow():
    lens = [1, 3, 8, 5]
    sorted_ids, sorted_logp = _sorted_policy(len(lens), 16, lens, seed=3)
    width = 5
    rows = _packed(sorted_ids, sorted_logp, width)
    sup_ids, sup_logp = unpack_supports(rows.ids, rows.logp[:, :width], rows.lens(), with_logprobs=True)
    ref_ids, ref_logp, _ = _reference(sorted_ids, sorted_logp, width)
    for r, n in enumerate(lens):
        if n > width:
            assert sup_ids[r] == [] and sup_logp[r] == []  # overflow: never a valid mask
        else:
            assert sup_ids[r] == ref_ids[r][:n]
            np.testing.assert_allclose(sup_logp[r], ref_logp[r][:n], rtol=0, atol=0)
    sel_ids, sel_logp = unpack_supports(rows.ids, rows.logp[:, :width], rows.lens(), with_logprobs=False)
    assert sel_logp is None and sel_ids == sup_ids
    assert unpack_supports(rows.ids[:0], rows.logp[:0, :width], rows.lens()[:0], True) == ([], [])


def test_assemble_across_steps_of_different_widths():
    """A sample's masks come from several steps' rows, whose packed widths differ when the batch's
    largest top_k changed: the result is the per-token supports in order, whatever the grouping."""
    first_ids, first_logp = _sorted_policy(4, 32, [2, 3, 1, 4], seed=1)
    second_ids, second_logp = _sorted_policy(3, 32, [5, 2, 6], seed=2)
    narrow, wide = _packed(first_ids, first_logp, 4), _packed(second_ids, second_logp, 8)
    parts = [(narrow, 1, 2), (wide, 0, 3), (narrow, 3, 1)]  # rows 1-2, then the wide step, then row 3
    sup = assemble_supports(parts, with_logprobs=True)
    expect = []
    for ids, logp, rows in ((first_ids, first_logp, [1, 2]), (second_ids, second_logp, [0, 1, 2]),
                            (first_ids, first_logp, [3])):
        ref_ids, ref_logp, ref_lens = _reference(ids, logp, 8)
        expect += [(ref_ids[r][:ref_lens[r]], ref_logp[r][:ref_lens[r]]) for r in rows]
    assert sup.id_lists() == [i for i, _ in expect]
    assert sup.logprob_lists() == [lp for _, lp in expect]
    assert assemble_supports(parts, with_logprobs=False).logprobs is None
    empty = assemble_supports([], with_logprobs=True)
    assert len(empty) == 0 and empty.logprobs is not None


def test_mask_capture_host_buffers_alternate_so_a_step_survives_the_next_copy():
    """A step's packed rows are read during the next step (rollout.engine.commit): the next copy
    must land in the other buffer, and a grown buffer must not move the previous step's rows."""
    from rollout.engine.capture import Captured, MaskCapture

    capture = MaskCapture()
    first = torch.arange(12, dtype=torch.int32).view(3, 4)
    second = torch.full((5, 4), -7, dtype=torch.int32)  # larger: its buffer grows
    third = torch.full((2, 4), 9, dtype=torch.int32)
    a = capture.to_host(Captured(first, [0, 3], 2))
    b = capture.to_host(Captured(second, [0, 5], 2))
    assert a.tolist() == first.tolist() and b.tolist() == second.tolist()
    c = capture.to_host(Captured(third, [0, 2], 2))  # reuses the first buffer: `a` is done with
    assert b.tolist() == second.tolist() and c.tolist() == third.tolist()
    assert not np.shares_memory(b, c) and np.shares_memory(a, c)


def test_committed_rows_of_a_mixed_step_with_drafts_and_an_overflow():
    """Entries 0, 2, 3 ask for masks, entry 1 does not; rows per entry 2, 3, 1, 3 (drafts). Only the
    committed rows are kept, each entry's first kept row follows `counts`' order, and an overflow
    fails its entry only when the overflowing row was committed."""
    from rollout.engine.capture import Captured, _mask_rows, committed_masks

    first_row, rows = _mask_rows(np.array([0, 2, 5, 6, 9]), np.array([True, False, True, True]))
    assert first_row.tolist() == [0, -1, 2, 3] and rows.tolist() == [0, 1, 5, 6, 7, 8]
    lens = [1, 2, 1, 2, 3, 1]  # packed row 4 (entry 3's second row) holds 3 tokens: over the bound of 2
    ids, logp = _sorted_policy(6, 16, lens, seed=3)
    packed = pack_supports(ids, logp, 2).numpy()
    cap = Captured(torch.from_numpy(packed), first_row, 2)
    kept = committed_masks(cap, packed, {0: 2, 2: 1, 3: 2})
    assert kept.rows.packed.tolist() == packed[:5].tolist() and kept.first == [0, 2, 3] and kept.failed == {3}
    assert not np.shares_memory(kept.rows.packed, packed)  # the host buffer is reused two steps later
    kept = committed_masks(cap, packed, {3: 1, 0: 1})  # one token each; the overflowing row is rejected
    assert kept.rows.packed.tolist() == packed[[3, 0]].tolist() and kept.first == [0, 1] and not kept.failed
