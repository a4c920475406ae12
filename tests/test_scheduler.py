"""Unit tests of continuous batching (rollout.engine.scheduler) with Sequence objects and a real
BlockManager, no model: a tiny driver plays the committer (advance computed tokens, append a
token when an item samples, fork the samples of a prefilled prompt, finish at max_tokens).

Covers the token budget, chunked prefill, drafts room on decode items, admission by free
blocks and max_num_seqs, preemption of the newest sequence without deadlock or lost tokens,
block reservation for forks, and the admission pause of a weight update.
"""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest

from rollout.engine.block_manager import BlockManager
from rollout.engine.params import SamplingParams
from rollout.engine.scheduler import Scheduler
from rollout.engine.sequence import SeqStatus, Sequence

_ids = iter(range(1, 10**6))


def make_seq(prompt_len: int, max_tokens: int = 4, n: int = 1) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens)
    prompt = [(7 * i + prompt_len) % 50 for i in range(prompt_len)]
    group = [Sequence(seq_id=next(_ids), request_id="r", prompt_index=0, sample_index=s,
                      prompt_token_ids=prompt, params=params, seed=0) for s in range(n)]
    group[0].children = group[1:]
    return group[0]


def token_for(seq: Sequence, index: int) -> int:
    """The token a sample commits at output index `index`: fixed per (sample, index)."""
    return (seq.seq_id * 31 + index * 7) % 97


class Planned(NamedTuple):
    """A scheduled item as planned, before the step advanced the sequence."""

    seq: Sequence
    num_new_tokens: int
    num_draft: int
    samples: bool


class Driver:
    """Plays the committer for a scheduler: run `step()` until nothing is left."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.finished: list[Sequence] = []

    def step(self) -> list[Planned]:
        sched, bm = self.sched, self.sched.bm
        batch = [Planned(it.seq, it.num_new_tokens, it.num_draft, it.samples) for it in sched.schedule()]
        for item in batch:
            seq = item.seq
            end = seq.num_computed_tokens + item.num_new_tokens + item.num_draft
            assert len(seq.block_table) * bm.block_size >= end, "scheduled tokens without KV slots"
            seq.num_computed_tokens += item.num_new_tokens
        for item in batch:
            seq = item.seq
            if not item.samples:
                continue
            for child in seq.children:
                copy = sched.fork(seq, child)
                assert copy is None or copy[1] in child.block_table
                self._append(child)
            seq.children = []
            self._append(seq)
        return batch

    def _append(self, seq: Sequence) -> None:
        seq.output_token_ids.append(token_for(seq, seq.num_output_tokens))
        if seq.num_output_tokens >= seq.params.max_tokens:
            self.sched.finish(seq)
            self.finished.append(seq)
        else:
            self.sched.bm.truncate(seq, seq.num_tokens)

    def run(self, max_steps: int = 2000) -> int:
        steps = 0
        while self.sched.has_unfinished():
            self.step()
            steps += 1
            assert steps < max_steps, "scheduler made no progress (deadlock?)"
        return steps


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=256, budget=2048, num_spec=0) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget, num_spec)


def check_outputs(seqs: list[Sequence]) -> None:
    for s in seqs:
        assert s.status is SeqStatus.FINISHED
        assert s.output_token_ids == [token_for(s, j) for j in range(s.params.max_tokens)]


def test_chunked_prefill_follows_the_budget_then_decodes():
    sched = make_scheduler(budget=4)
    seq = make_seq(10, max_tokens=3)
    sched.add(seq)
    driver = Driver(sched)
    plan = [[(it.num_new_tokens, it.samples) for it in driver.step()] for _ in range(5)]
    assert plan == [[(4, False)], [(4, False)], [(2, True)], [(1, True)], [(1, True)]]
    assert not sched.has_unfinished() and driver.finished == [seq]
    assert sched.bm.num_free_blocks == sched.bm.num_blocks


def test_token_budget_and_max_num_seqs_hold_every_step():
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=256, block_size=4, max_num_seqs=4, budget=8)
    seqs = [make_seq(rng.randint(1, 20), max_tokens=rng.randint(1, 6)) for _ in range(12)]
    for s in seqs:
        sched.add(s)
    driver = Driver(sched)
    while sched.has_unfinished():
        batch = driver.step()
        assert batch, "a step with pending work scheduled nothing"
        assert sum(it.num_new_tokens + it.num_draft for it in batch) <= 8
        assert len(sched.running) <= 4
        assert len({id(it.seq) for it in batch}) == len(batch)
    check_outputs(seqs)
    assert sched.num_preemptions == 0
    assert sched.bm.num_free_blocks == sched.bm.num_blocks


def test_running_decodes_are_served_before_new_prefills():
    sched = make_scheduler(budget=6)
    a = make_seq(3, max_tokens=8)
    sched.add(a)
    driver = Driver(sched)
    driver.step()  # a's prompt
    b = make_seq(20)
    sched.add(b)
    batch = driver.step()
    assert [(it.seq, it.num_new_tokens) for it in batch] == [(a, 1), (b, 5)]


def test_decode_items_get_room_for_drafts():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=64, num_spec=4)
    long, short = make_seq(5, max_tokens=20), make_seq(6, max_tokens=3)
    sched.add(long)
    sched.add(short)
    driver = Driver(sched)
    assert [it.num_draft for it in driver.step()] == [0, 0]  # prefill items carry no drafts
    batch = driver.step()  # the driver checks that the drafts got KV slots too
    assert [(it.num_new_tokens, it.num_draft) for it in batch] == [(1, 4), (1, 1)]  # short: 2 left
    tight = make_scheduler(budget=3, num_spec=4)
    seq = make_seq(2, max_tokens=20)
    tight.add(seq)
    d = Driver(tight)
    d.step()
    assert [(it.num_new_tokens, it.num_draft) for it in d.step()] == [(1, 2)]  # budget 3 = 1 + 2


def test_a_draft_budget_caps_each_decode_item_and_leaves_the_token_budget_to_prefill():
    """The draft budget's hook (spec_budget.SpecBudget.caps): per-sample caps within the limits, samples
    it leaves out draft nothing, the tokens it saves go to a waiting prompt's chunk; without a budget
    the next step verifies full blocks again."""

    class Caps:
        def __init__(self):
            self.calls = []

        def caps(self, running, budget, waiting_tokens=0, states=None):
            assert states == [s.behind_and_remaining() for s in running]
            self.calls.append((len(running), waiting_tokens > 0, budget, waiting_tokens))  # (admits prefill)
            return {running[0]: 2, running[1]: 9}  # the third: not in the dict

    sched = make_scheduler(num_blocks=64, block_size=4, budget=12, num_spec=4)
    seqs = [make_seq(3, max_tokens=20) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    driver = Driver(sched)
    driver.step()
    sched.draft_budget = Caps()
    late = make_seq(20)
    sched.add(late)
    batch = driver.step()
    assert [(it.seq, it.num_new_tokens, it.num_draft) for it in batch] == [
        (seqs[0], 1, 2), (seqs[1], 1, 4), (seqs[2], 1, 0), (late, 3, 0)]  # 9 capped at num_spec 4
    assert sched.draft_budget.calls == [(3, True, 12, 12)]  # the late prompt's 20 tokens, up to the budget
    sched.draft_budget = None
    assert [it.num_draft for it in driver.step()[:2]] == [4, 4]  # (the token budget leaves the third 1)


def test_the_scheduler_counts_the_prompts_it_may_admit():
    """What `Scheduler._admissible_prompt_tokens` hands the draft budget: the waiting prompts' tokens
    up to the step's budget, only as many samples as max_num_seqs leaves room for, none while a
    weight update pauses admission."""
    sched = make_scheduler(max_num_seqs=3, budget=64, num_spec=7)
    for n in (10, 20, 30, 40):
        sched.waiting.append(make_seq(n))
    assert sched._admissible_prompt_tokens(100) == 60  # three samples fit max_num_seqs
    assert sched._admissible_prompt_tokens(25) == 25
    sched.running.append(make_seq(5))
    assert sched._admissible_prompt_tokens(100) == 30
    sched.admission_paused = True
    assert sched._admissible_prompt_tokens(100) == 0


def test_admission_waits_for_free_blocks():
    sched = make_scheduler(num_blocks=6, block_size=4)
    a, b = make_seq(13, max_tokens=2), make_seq(9, max_tokens=2)  # 4 and 3 blocks
    sched.add(a)
    sched.add(b)
    driver = Driver(sched)
    assert [it.seq for it in driver.step()] == [a]
    assert list(sched.waiting) == [b] and b.block_table == []
    driver.run()
    check_outputs([a, b])
    assert sched.num_preemptions == 0


def test_preemption_takes_the_newest_sequence_and_frees_its_blocks():
    sched = make_scheduler(num_blocks=4, block_size=2)
    a, b = make_seq(3, max_tokens=4), make_seq(3, max_tokens=4)
    sched.add(a)
    sched.add(b)
    driver = Driver(sched)
    driver.step()  # both prompts: 2 blocks each, every block taken
    assert sched.bm.num_free_blocks == 0 and sched.running == [a, b]
    batch = driver.step()  # both have 4 tokens now and fit; the next token needs a third block
    assert [it.seq for it in batch] == [a, b]
    batch = driver.step()
    assert [it.seq for it in batch] == [a]
    assert sched.num_preemptions == 1
    assert list(sched.waiting) == [b] and b.status is SeqStatus.WAITING
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert b.output_token_ids == [token_for(b, 0), token_for(b, 1)]  # committed tokens are kept
    driver.run()
    check_outputs([a, b])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_heavy_preemption_finishes_everything_with_every_token(seed):
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=8, block_size=2, budget=rng.choice([3, 5, 16]))
    seqs = [make_seq(rng.randint(1, 6), max_tokens=rng.randint(2, 8)) for _ in range(10)]
    for s in seqs:
        sched.add(s)
    Driver(sched).run()
    check_outputs(seqs)
    assert sched.num_preemptions > 0
    assert sched.bm.num_free_blocks == sched.bm.num_blocks
    assert sched.bm.ref_counts == [0] * 8


def test_a_sampling_parent_keeps_blocks_for_its_forks():
    """The n samples of a prompt are forked after the step, each copying the partial last
    block: other admissions in the same step must not take those blocks."""
    sched = make_scheduler(num_blocks=6, block_size=2)
    parent = make_seq(3, max_tokens=3, n=3)  # 2 blocks + 2 copies at the fork
    other = make_seq(7, max_tokens=3)  # 4 blocks
    sched.add(parent)
    sched.add(other)
    batch = sched.schedule()
    forks = sum(len(it.seq.children) for it in batch if it.samples)
    assert forks == 2
    assert sched.bm.num_free_blocks >= forks


def test_forked_groups_under_block_pressure_all_finish():
    rng = random.Random(3)
    sched = make_scheduler(num_blocks=12, block_size=2, budget=8)
    groups = [make_seq(rng.randint(1, 5), rng.randint(2, 5), n=rng.randint(1, 3)) for _ in range(6)]
    for g in groups:
        sched.add(g)
    all_samples = [s for g in groups for s in [g, *g.children]]
    Driver(sched).run()
    check_outputs(all_samples)
    assert sched.bm.num_free_blocks == 12


def test_forks_respect_max_num_seqs():
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=3)
    group = make_seq(6, max_tokens=4, n=5)
    sched.add(group)
    samples = [group, *group.children]
    driver = Driver(sched)
    while sched.has_unfinished():
        driver.step()
        assert len(sched.running) <= 3
    check_outputs(samples)
    assert sched.bm.num_free_blocks == 64


def test_admission_pause_lets_started_samples_continue():
    sched = make_scheduler(num_blocks=4, block_size=2)
    a, b = make_seq(3, max_tokens=4), make_seq(3, max_tokens=4)
    sched.add(a)
    sched.add(b)
    driver = Driver(sched)
    for _ in range(3):
        driver.step()  # b is preempted at the third step (see above)
    assert b in sched.waiting and b.started
    fresh = make_seq(2, max_tokens=2)
    sched.add(fresh)
    sched.admission_paused = True
    assert sched.has_started_work()
    while sched.has_started_work():
        batch = driver.step()
        assert fresh not in [it.seq for it in batch]
    check_outputs([a, b])
    assert list(sched.waiting) == [fresh] and not fresh.started
    assert sched.schedule() == []  # paused: nothing new starts
    sched.admission_paused = False
    driver.run()
    check_outputs([fresh])


def test_finish_frees_a_waiting_or_running_sequence_at_once():
    sched = make_scheduler(num_blocks=8, block_size=2)
    a, b = make_seq(5), make_seq(3)
    sched.add(a)
    sched.add(b)
    Driver(sched).step()
    waiting = make_seq(4)
    sched.add(waiting)
    sched.finish(a)
    sched.finish(waiting)
    assert sched.running == [b] and not sched.waiting
    assert a.block_table == [] and sched.bm.num_free_blocks == 8 - len(b.block_table)


def test_forks_without_a_free_block_wait_and_recompute():
    sched = make_scheduler(num_blocks=3, block_size=2)
    parent = make_seq(3, max_tokens=2, n=4)  # 2 blocks, partial last: each fork copies one block
    children = list(parent.children)
    sched.add(parent)
    driver = Driver(sched)
    driver.step()
    assert sched.running == [parent, children[0]]  # the one spare block went to the first fork
    assert [c.status for c in children[1:]] == [SeqStatus.WAITING] * 2
    assert all(c.started and c.block_table == [] and c.num_output_tokens == 1 for c in children[1:])
    assert sched.bm.num_free_blocks == 0
    driver.run()
    check_outputs([parent, *children])
    assert sched.bm.num_free_blocks == 3


def test_a_step_has_at_most_max_rows_logits_rows():
    """max_rows = min(budget, max_num_seqs x (num_spec + 1)) bounds the logits rows the engine's
    memory plan reserves for: a prompt's forked samples read its last row too, and those past the
    bound start later as sequences of their own, then finish like the others."""
    sched = make_scheduler(max_num_seqs=3, budget=64, num_spec=1)
    assert sched.max_rows == 6
    groups = [make_seq(5, max_tokens=3, n=9), make_seq(2, max_tokens=2, n=4)]
    samples = [s for g in groups for s in [g, *g.children]]
    for g in groups:
        sched.add(g)
    real, rows = sched.schedule, []

    def schedule():
        batch = real()
        rows.append(sum(1 + it.num_draft + (len(it.seq.children) if not it.seq.num_output_tokens else 0)
                        for it in batch if it.samples))
        return batch

    sched.schedule = schedule
    Driver(sched).run()
    check_outputs(samples)
    assert max(rows) == 6 and rows[0] == 6  # the first step forks 4 of 13 samples: 2 prompts' rows + 4
    assert sched.bm.num_free_blocks == sched.bm.num_blocks
