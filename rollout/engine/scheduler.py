"""Continuous batching under a token budget. Pure Python, no torch.

The scheduler allocates *tokens*, not modes: every running sequence has `num_tokens`
tokens of which `num_computed_tokens` have KV in the cache, and a step lets it catch up by
a chunk (prefill, chunked under the step's token budget; recompute after preemption) or,
once caught up but for its last token, by that token plus up to `num_spec` draft tokens
(a decode / verify step). Admission needs free KV blocks; when blocks run out the most
recently admitted sequence is preempted (blocks freed, recomputed later), so the oldest
work always progresses and nothing deadlocks.

A step also has at most `max_rows` logits rows (min(max_num_batched_tokens, max_num_seqs x
(num_spec + 1)): what its sequences' own rows can reach), the bound the engine's memory plan
reserves for. The samples forked from a prompt read its last row too; those that do not fit
start later as sequences of their own (their prompt's full blocks come from the prefix cache).

Under overlapped scheduling (rollout.engine.overlap) a sequence's last token may be pending (drawn
by the step in flight, its id on the device only): it counts in `num_tokens` like any other, so the
next step plans it as the anchor and reserves its KV slot. When the step in flight verifies drafts of
the sequence (`pending_drafts` of them), it may commit that many more tokens before the pending one:
the next step reserves slots for them too, and a sequence preempted meanwhile waits for that step's
commit before it is admitted again (its tokens are not known until then). A sequence whose next step
would depend on how many it accepts sits that step out (`waits_commit`).

How many drafts a decode step verifies is the draft budget's (`draft_budget`, spec_budget.py:
per-sample caps chosen once per step from measured acceptance and step costs, within the token
room that the prompts waiting for admission leave); without one, full blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from rollout.engine.block_manager import BlockManager
from rollout.engine.sequence import SeqStatus, Sequence


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step: compute tokens [num_computed, num_computed +
    num_new_tokens); `num_draft` > 0 only for decode steps (room for that many drafts)."""

    seq: Sequence
    num_new_tokens: int
    num_draft: int = 0

    @property
    def samples(self) -> bool:
        """True when this step reaches the sequence's last token, so it samples."""
        return self.seq.num_computed_tokens + self.num_new_tokens >= self.seq.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 num_spec: int = 0, draft_budget=None):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_spec = num_spec
        self.max_rows = min(max_num_batched_tokens, max_num_seqs * (num_spec + 1))
        self.draft_budget = draft_budget  # a SpecBudget, or None: full blocks
        self._draft_caps: dict[Sequence, int] | None = None  # this step's, from draft_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.admission_paused = False
        self.num_preemptions = 0
        self._fork_blocks = 0  # free blocks promised to this step's forks (copies of partial blocks)
        self._forking = False

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_started_work(self) -> bool:
        """True while any sample that began under the current weights is unfinished."""
        return bool(self.running) or any(s.started for s in self.waiting)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        self._fork_blocks = 0
        self._forking = False  # some item forks samples this step (their rows are capped)
        states = [seq.behind_and_remaining() for seq in self.running]  # [R] read once a step (preemption
        self._draft_caps = self._budget_caps(budget, states)  # pops from the end: indices hold)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.pending_drafts and self.waits_commit(seq):
                i += 1
                continue
            item = self._plan(seq, budget, states[i])
            if self._reserve(item):
                batch.append(item)
                budget -= item.num_new_tokens + item.num_draft
                i += 1
            elif not self._preempt_last(keep=seq):
                break
        self._admit(batch, budget)
        if self._forking:
            self._cap_rows(batch)
        return batch

    def finish(self, seq: Sequence) -> None:
        """Free a finished or aborted sequence's blocks at once."""
        seq.status = SeqStatus.FINISHED
        self.bm.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def advance(self, items: list[ScheduledSeq], num_accepted: list[int]) -> list[tuple[int, int]]:
        """After a step's host copy, before its tokens are appended: each item's computed count
        grows by the tokens it fed plus the drafts it accepted (`num_accepted[i]`), prompt blocks
        that became full are registered for prefix reuse, and the samples of a prompt whose last
        token was computed are forked (before any sample may finish). Returns the (src, dst) block
        copies those forks need, for the engine to make before the next forward reads the blocks."""
        sampled = [item.samples for item in items]  # before the counts move
        for item, accepted in zip(items, num_accepted):
            seq, old = item.seq, item.seq.num_computed_tokens
            seq.num_computed_tokens = old + item.num_new_tokens + accepted
            self.bm.register_computed(seq, old)
        copies = []
        for item, samples in zip(items, sampled):
            if not samples:  # a prompt still mid-prefill keeps its samples to fork
                continue
            parent = item.seq
            for child in parent.children if parent.num_output_tokens == 0 else []:
                copy = self.fork(parent, child)
                if copy is not None:
                    copies.append(copy)
            parent.children = []
        return copies

    def accept(self, items: list[ScheduledSeq], num_accepted: list[int]) -> None:
        """A step advanced before its results (rollout.engine.overlap, which assumed no draft accepted):
        the drafts it accepted join each item's computed count, unless the sequence finished or was
        preempted since (its count restarted)."""
        for item, accepted in zip(items, num_accepted):
            if accepted and item.seq.status is SeqStatus.RUNNING:
                item.seq.num_computed_tokens += accepted

    def truncate_drafts(self, items: list[ScheduledSeq], ahead: list[ScheduledSeq] | None = None) -> None:
        """After the step's tokens are appended: free the blocks reserved for drafts that were not
        accepted (only they can lie past a running sequence's tokens; KV rollback). `ahead`: the plan of
        a step scheduled before this one's results (launched or held): its drafts' slots stay."""
        keep = {item.seq: item.num_draft for item in ahead or () if item.num_draft}
        for item in items:
            if item.num_draft and not item.seq.is_finished:
                self.bm.truncate(item.seq, item.seq.num_tokens + keep.get(item.seq, 0))

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Start a sample forked from its prompt's first sample once the prompt is computed:
        it shares the prompt's blocks and runs. Returns the (src, dst) partial-block copy the
        device must make, if any. When no block is free for that copy, or max_num_seqs are
        already running, the sample waits and recomputes its prompt later, like a preempted one
        (prefix caching still shares the prompt's full blocks)."""
        child.started = True
        no_copy_block = parent.num_prompt_tokens % self.bm.block_size and self.bm.num_free_blocks == 0
        if no_copy_block or len(self.running) >= self.max_num_seqs:
            child.status = SeqStatus.WAITING
            self.waiting.appendleft(child)
            return None
        copy = self.bm.fork(parent, child)
        child.status = SeqStatus.RUNNING
        self.running.append(child)
        return copy

    def waits_commit(self, seq: Sequence) -> bool:
        """Whether a sample whose step in flight verifies `pending_drafts` of its drafts sits the next
        step out: that step would depend on how many it accepts (a min_tokens not reached by its pending
        token bans end tokens; an output left short enough that some count would cap the step's drafts,
        at most remaining - 1). After that step's commit its state is known again. The samples that
        stay have num_spec + 1 tokens left at least whatever they accept: their drafts are uncapped."""
        params, k = seq.params, seq.pending_drafts
        return params.min_tokens > seq.num_output_tokens or seq.remaining_tokens < self.num_spec + k + 1

    # -- internals ---------------------------------------------------------------------

    def _budget_caps(self, budget: int, states: list[tuple[int, int]]) -> dict[Sequence, int] | None:
        """This step's most drafts per running sample, from the draft budget (None: full blocks);
        states: the running samples' behind_and_remaining()."""
        if self.draft_budget is None or not self.num_spec:
            return None
        return self.draft_budget.caps(self.running, budget, self._admissible_prompt_tokens(budget), states)

    def _admissible_prompt_tokens(self, budget: int) -> int:
        """Prompt tokens of the waiting samples this step may admit (by count: max_num_seqs), at most
        `budget`: the prefill that drafts would displace (`_admit` takes what the running items leave)."""
        total, slots = 0, self.max_num_seqs - len(self.running)
        for seq in self.waiting:
            if slots <= 0 or total >= budget or not self._admissible(seq):
                break
            total += seq.num_tokens - seq.num_computed_tokens
            slots -= 1
        return min(total, budget)

    def _plan(self, seq: Sequence, budget: int, state: tuple[int, int]) -> ScheduledSeq:
        """seq's item within `budget` tokens; state: its behind_and_remaining()."""
        behind, remaining = state
        if behind > 1:
            return ScheduledSeq(seq, min(behind, budget))
        if not self.num_spec:
            return ScheduledSeq(seq, 1)
        cap = self.num_spec if self._draft_caps is None else min(self.num_spec, self._draft_caps.get(seq, 0))
        return ScheduledSeq(seq, 1, max(0, min(cap, remaining - 1, budget - 1)))

    def _reserve(self, item: ScheduledSeq) -> bool:
        seq = item.seq
        end = seq.num_computed_tokens + item.num_new_tokens + item.num_draft + seq.pending_drafts
        if not self.bm.ensure_slots(seq, end, keep_free=self._fork_blocks):
            return False
        if seq.children and item.samples:
            # hold one block per forked sample (for its partial-block copy) as far as they go;
            # a sample left without one waits and recomputes its prompt (`fork`)
            self._fork_blocks += min(len(seq.children), self.bm.num_free_blocks - self._fork_blocks)
            self._forking = True
        return True

    def _admit(self, batch: list[ScheduledSeq], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._admissible(seq):
                break
            if not seq.block_table:
                seq.num_computed_tokens = self.bm.allocate_prompt(seq)
            item = self._plan(seq, budget, seq.behind_and_remaining())
            if not self._reserve(item):
                self.bm.free(seq)
                if not self.running:
                    raise RuntimeError("KV cache too small for one step of a single sequence")
                break
            self.waiting.popleft()
            seq.started = True
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.append(item)
            budget -= item.num_new_tokens + item.num_draft

    def _admissible(self, seq: Sequence) -> bool:
        """While a weight update drains, only samples already under way continue; a sample preempted
        while the step in flight verifies its drafts waits for that step's commit."""
        return (seq.started or not self.admission_paused) and not seq.pending_drafts

    def _cap_rows(self, batch: list[ScheduledSeq]) -> None:
        """Keep the forked samples' rows within `max_rows`; the rest wait as sequences of their own
        (started: they belong to their request's weights)."""
        sampling = [it for it in batch if it.samples]
        left = self.max_rows - sum(1 + it.num_draft for it in sampling)
        for item in sampling:
            seq = item.seq
            if seq.num_output_tokens or not seq.children:
                continue
            keep = max(0, left)
            for child in reversed(seq.children[keep:]):
                child.started = True
                self.waiting.appendleft(child)
            seq.children = seq.children[:keep]
            left -= len(seq.children)

    def _preempt_last(self, keep: Sequence) -> bool:
        """Preempt the newest running sequence (recompute later). Returns False when
        `keep` itself had to go (nothing else left to take blocks from)."""
        victim = self.running.pop()
        self.bm.free(victim)
        victim.status = SeqStatus.WAITING
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        return victim is not keep
