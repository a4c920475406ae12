"""Continuous batching under a token budget. Pure Python, no torch.

The scheduler allocates *tokens*, not modes: every running sequence has `num_tokens`
tokens of which `num_computed_tokens` have KV in the cache, and a step lets it catch up by
a chunk (prefill, chunked under the step's token budget; recompute after preemption) or,
once caught up but for its last token, by that token plus up to `num_spec` draft tokens
(a decode / verify step). Admission needs free KV blocks; when blocks run out the most
recently admitted sequence is preempted (blocks freed, recomputed later), so the oldest
work always progresses and nothing deadlocks.

How many drafts a decode step verifies is the draft budget's (`draft_budget`, spec_budget.py:
per-sample caps chosen once per step from measured acceptance and step costs); without one,
full blocks.
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
        self.draft_budget = draft_budget  # a SpecBudget, or None: full blocks
        self._draft_caps: dict[Sequence, int] | None = None  # this step's, from draft_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.admission_paused = False
        self.num_preemptions = 0
        self._fork_blocks = 0  # free blocks promised to this step's forks (copies of partial blocks)

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
        self._draft_caps = None
        if self.draft_budget is not None and self.num_spec:
            admits = bool(self.waiting) and len(self.running) < self.max_num_seqs
            self._draft_caps = self.draft_budget.caps(self.running, admits, budget)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            item = self._plan(seq, budget)
            if self._reserve(item):
                batch.append(item)
                budget -= item.num_new_tokens + item.num_draft
                i += 1
            elif not self._preempt_last(keep=seq):
                break
        self._admit(batch, budget)
        return batch

    def finish(self, seq: Sequence) -> None:
        """Free a finished or aborted sequence's blocks at once."""
        seq.status = SeqStatus.FINISHED
        self.bm.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

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

    # -- internals ---------------------------------------------------------------------

    def _plan(self, seq: Sequence, budget: int) -> ScheduledSeq:
        behind = seq.num_tokens - seq.num_computed_tokens
        if behind > 1:
            return ScheduledSeq(seq, min(behind, budget))
        if not self.num_spec:
            return ScheduledSeq(seq, 1)
        cap = self.num_spec if self._draft_caps is None else min(self.num_spec, self._draft_caps.get(seq, 0))
        num_draft = max(0, min(cap, seq.remaining_tokens - 1, budget - 1))
        return ScheduledSeq(seq, 1, num_draft)

    def _reserve(self, item: ScheduledSeq) -> bool:
        seq = item.seq
        end = seq.num_computed_tokens + item.num_new_tokens + item.num_draft
        if not self.bm.ensure_slots(seq, end, keep_free=self._fork_blocks):
            return False
        if seq.children and item.samples:
            # hold one block per forked sample (for its partial-block copy) as far as they go;
            # a sample left without one waits and recomputes its prompt (Committer._fork)
            self._fork_blocks += min(len(seq.children), self.bm.num_free_blocks - self._fork_blocks)
        return True

    def _admit(self, batch: list[ScheduledSeq], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.admission_paused and not seq.started:
                break  # a weight update is draining: only samples already under way continue
            if not seq.block_table:
                seq.num_computed_tokens = self.bm.allocate_prompt(seq)
            item = self._plan(seq, budget)
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

    def _preempt_last(self, keep: Sequence) -> bool:
        """Preempt the newest running sequence (recompute later). Returns False when
        `keep` itself had to go (nothing else left to take blocks from)."""
        victim = self.running.pop()
        self.bm.free(victim)
        victim.status = SeqStatus.WAITING
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        return victim is not keep
