"""Unit tests of the paged-KV bookkeeping (rollout.engine.block_manager), no model, no torch.

Allocation and reference counts, forks that share full blocks and copy the partial last one,
truncation (KV rollback), and hash-based prefix reuse: a hit only after `register_computed`,
chained hashes, reuse of freed blocks that still hold their hash, and `reset_prefix_cache`.
"""

from __future__ import annotations

import pytest

from rollout.engine.block_manager import BlockManager
from rollout.engine.params import SamplingParams
from rollout.engine.sequence import Sequence

_ids = iter(range(1, 10**6))


def make_seq(prompt: list[int], outputs: list[int] | None = None) -> Sequence:
    seq = Sequence(seq_id=next(_ids), request_id="r", prompt_index=0, sample_index=0,
                   prompt_token_ids=list(prompt), params=SamplingParams(), seed=0)
    seq.output_token_ids = list(outputs or [])
    return seq


def computed(bm: BlockManager, seq: Sequence, num_tokens: int) -> Sequence:
    """Give seq slots for its first num_tokens positions and mark them computed (registering
    the prompt blocks that became full, as the committer does after a step)."""
    assert bm.ensure_slots(seq, num_tokens)
    old = seq.num_computed_tokens
    seq.num_computed_tokens = num_tokens
    bm.register_computed(seq, old)
    return seq


def check_invariants(bm: BlockManager, seqs: list[Sequence]) -> None:
    """Ref counts equal the number of block tables holding each block; free == unreferenced."""
    held = [0] * bm.num_blocks
    for s in seqs:
        for b in s.block_table:
            held[b] += 1
    assert bm.ref_counts == held
    assert set(bm.free_blocks) == {b for b in range(bm.num_blocks) if held[b] == 0}


def test_ensure_slots_allocates_distinct_blocks_and_free_returns_them():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(range(5)), make_seq(range(9))
    assert bm.blocks_needed(a, 5) == 2
    assert bm.ensure_slots(a, 5) and len(a.block_table) == 2
    assert bm.ensure_slots(b, 9) and len(b.block_table) == 3
    assert not set(a.block_table) & set(b.block_table)
    assert bm.num_free_blocks == 3
    check_invariants(bm, [a, b])
    assert bm.ensure_slots(a, 8) and len(a.block_table) == 2  # still inside block 2: nothing new
    assert bm.blocks_needed(a, 9) == 1
    bm.free(a)
    assert a.block_table == [] and a.num_computed_tokens == 0
    assert bm.num_free_blocks == 5
    check_invariants(bm, [b])
    bm.free(b)
    assert bm.num_free_blocks == 8 and bm.ref_counts == [0] * 8


def test_ensure_slots_refuses_without_change_when_blocks_run_out():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq(range(5))
    assert bm.ensure_slots(a, 5)  # 3 blocks
    table = list(a.block_table)
    assert not bm.ensure_slots(a, 9)  # would need 2 more, 1 free
    assert a.block_table == table and bm.num_free_blocks == 1
    assert bm.ensure_slots(a, 7) and bm.num_free_blocks == 0


def test_slot_maps_positions_through_the_block_table():
    bm = BlockManager(num_blocks=8, block_size=4)
    filler, seq = make_seq(range(8)), make_seq(range(6))
    bm.ensure_slots(filler, 8)
    bm.ensure_slots(seq, 6)
    b0, b1 = seq.block_table
    want = [b0 * 4, b0 * 4 + 1, b0 * 4 + 2, b0 * 4 + 3, b1 * 4, b1 * 4 + 1]
    assert [bm.slot(seq, p) for p in range(6)] == want


def test_fork_shares_full_blocks_and_copies_the_partial_last_block():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    parent = computed(bm, make_seq(range(10)), 10)  # blocks: full, full, partial (2 of 4)
    children = [make_seq(range(10)) for _ in range(3)]
    copies = [bm.fork(parent, c) for c in children]
    full = parent.block_table[:2]
    for c, copy in zip(children, copies):
        assert c.block_table[:2] == full
        assert c.num_computed_tokens == 10
        src, dst = copy
        assert src == parent.block_table[2] and dst == c.block_table[2]
        assert dst not in parent.block_table
    assert len({c.block_table[2] for c in children}) == 3
    assert [bm.ref_counts[b] for b in full] == [4, 4]
    assert bm.ref_counts[parent.block_table[2]] == 1
    assert bm.num_free_blocks == 16 - 2 - 4
    check_invariants(bm, [parent, *children])
    bm.free(parent)  # shared blocks stay with the children
    assert [bm.ref_counts[b] for b in full] == [3, 3]
    check_invariants(bm, children)
    for c in children:
        bm.free(c)
    assert bm.num_free_blocks == 16


def test_fork_at_a_block_boundary_copies_nothing():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = computed(bm, make_seq(range(8)), 8)
    child = make_seq(range(8))
    assert bm.fork(parent, child) is None
    assert child.block_table == parent.block_table
    assert [bm.ref_counts[b] for b in parent.block_table] == [2, 2]
    assert bm.num_free_blocks == 6


def test_truncate_rolls_back_blocks_past_the_kept_positions():
    bm = BlockManager(num_blocks=8, block_size=2)
    seq = make_seq(range(3))
    bm.ensure_slots(seq, 9)  # 5 blocks, e.g. room for drafts
    first_two = seq.block_table[:2]
    bm.truncate(seq, 4)
    assert seq.block_table == first_two and bm.num_free_blocks == 6
    bm.truncate(seq, 3)
    assert seq.block_table == first_two  # position 3 still lives in block 1
    bm.truncate(seq, 2)
    assert len(seq.block_table) == 1 and bm.num_free_blocks == 7
    check_invariants(bm, [seq])


def test_truncate_of_a_shared_block_only_drops_a_reference():
    bm = BlockManager(num_blocks=8, block_size=2)
    parent = computed(bm, make_seq(range(4)), 4)
    child = make_seq(range(4))
    bm.fork(parent, child)
    bm.truncate(child, 2)
    assert child.block_table == parent.block_table[:1]
    assert bm.ref_counts[parent.block_table[1]] == 1
    check_invariants(bm, [parent, child])


def test_prefix_hit_only_after_register_computed():
    bm = BlockManager(num_blocks=16, block_size=2)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    a = make_seq(prompt)
    assert bm.allocate_prompt(a) == 0
    bm.ensure_slots(a, 7)
    b = make_seq(prompt)
    assert bm.allocate_prompt(b) == 0  # a's KV is not computed yet: nothing to reuse
    bm.free(b)
    a.num_computed_tokens = 7
    bm.register_computed(a, 0)
    c = make_seq(prompt)
    assert bm.allocate_prompt(c) == 6  # three full blocks; the 7th token is recomputed
    assert c.block_table == a.block_table[:3]
    assert [bm.ref_counts[x] for x in a.block_table] == [2, 2, 2, 1]
    check_invariants(bm, [a, c])


def test_prefix_reuse_always_leaves_the_last_prompt_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=2)
    a = computed(bm, make_seq([1, 2, 3, 4, 5, 6]), 6)
    b = make_seq([1, 2, 3, 4, 5, 6])
    assert bm.allocate_prompt(b) == 4  # not 6: the last token must run to give logits
    assert b.block_table == a.block_table[:2]


def test_chunked_registration_covers_only_blocks_that_became_full():
    bm = BlockManager(num_blocks=16, block_size=2)
    prompt = list(range(20, 29))
    a = computed(bm, make_seq(prompt), 3)  # one full block so far
    assert bm.allocate_prompt(b := make_seq(prompt)) == 2
    bm.free(b)
    computed(bm, a, 7)
    assert bm.allocate_prompt(c := make_seq(prompt)) == 6
    assert c.block_table == a.block_table[:3]


def test_prefix_hashes_are_chained_and_stop_at_the_first_difference():
    bm = BlockManager(num_blocks=16, block_size=2)
    a = computed(bm, make_seq([1, 2, 3, 4, 5, 6, 7]), 7)
    same_second_block = make_seq([9, 9, 3, 4, 5, 6, 7])
    assert bm.allocate_prompt(same_second_block) == 0  # block 1's hash includes block 0
    diverging = make_seq([1, 2, 3, 4, 0, 6, 7])
    assert bm.allocate_prompt(diverging) == 4
    assert diverging.block_table == a.block_table[:2]


def test_cached_blocks_survive_a_finish_until_reused():
    bm = BlockManager(num_blocks=6, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    a = computed(bm, make_seq(prompt), 5)
    cached = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 6  # freed blocks count as free ...
    b = make_seq(prompt)
    assert bm.allocate_prompt(b) == 4  # ... yet still give a hit
    assert b.block_table == cached and bm.num_free_blocks == 4
    bm.free(b)
    filler = make_seq(range(40, 52))
    assert bm.ensure_slots(filler, 12)  # takes every block, overwriting the cached ones
    bm.free(filler)
    assert bm.allocate_prompt(make_seq(prompt)) == 0


def test_least_recently_freed_blocks_are_handed_out_first():
    """Blocks return to the back of the free list, so cached prefixes live as long as possible."""
    bm = BlockManager(num_blocks=6, block_size=2)
    a = computed(bm, make_seq([1, 2, 3, 4, 5]), 5)
    used = set(a.block_table)
    bm.free(a)
    other = make_seq(range(40, 46))
    assert bm.ensure_slots(other, 6)  # 3 blocks: the never-used ones first
    assert not set(other.block_table) & used
    assert bm.allocate_prompt(make_seq([1, 2, 3, 4, 5])) == 4


def test_reset_prefix_cache_forgets_every_prefix():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = computed(bm, make_seq([1, 2, 3, 4, 5]), 5)
    bm.reset_prefix_cache()
    b = make_seq([1, 2, 3, 4, 5])
    assert bm.allocate_prompt(b) == 0 and b.block_table == []
    computed(bm, b, 5)  # recomputed under the new weights: registered afresh
    assert bm.allocate_prompt(c := make_seq([1, 2, 3, 4, 5])) == 4
    assert c.block_table == b.block_table[:2]
    check_invariants(bm, [a, b, c])


def test_prefix_caching_off_never_reuses():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    computed(bm, make_seq([1, 2, 3, 4, 5]), 5)
    assert bm.allocate_prompt(make_seq([1, 2, 3, 4, 5])) == 0


def test_a_second_copy_of_a_prefix_does_not_steal_the_registration():
    bm = BlockManager(num_blocks=16, block_size=2)
    a = computed(bm, make_seq([1, 2, 3, 4, 5]), 5)
    b = computed(bm, make_seq([1, 2, 3, 4, 5]), 5)  # computed concurrently, own blocks
    bm.free(b)
    c = make_seq([1, 2, 3, 4, 5])
    bm.allocate_prompt(c)
    assert c.block_table == a.block_table[:2]


def test_freeing_twice_is_caught():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3])
    bm.ensure_slots(a, 3)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(AssertionError):
        bm.free(a)


def test_decode_steps_do_not_rehash_the_prompt(monkeypatch):
    """register_computed runs for every sequence every step: once the prompt is registered it
    must cost nothing (hashing a long prompt per decode step is host time on the hot path)."""
    bm = BlockManager(num_blocks=64, block_size=4)
    seq = computed(bm, make_seq(range(100)), 100)
    calls = []
    real = BlockManager._hash
    counted = staticmethod(lambda prev, toks: calls.append(1) or real(prev, toks))
    monkeypatch.setattr(BlockManager, "_hash", counted)
    seq.output_token_ids = [1]
    computed(bm, seq, 101)
    computed(bm, seq, 102)
    assert calls == []
    chunked = computed(bm, make_seq(range(200, 220)), 6)
    calls.clear()
    computed(bm, chunked, 9)  # block 1 became full: hashing is needed again
    assert calls and bm.allocate_prompt(make_seq(range(200, 220))) == 8
