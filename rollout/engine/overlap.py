"""Overlapped scheduling (`--no-overlap` turns it off): the host schedules, builds and launches
step n+1 while the device computes step n, so the host's share of a step hides behind the device's.

The order inside one `LLMEngine.step()`, step n launched already (by the previous call, or just now):

    hand over n-1's masks -> schedule n+1 -> build n+1 -> fill its pending tokens on the device
    -> launch n+1 -> sync n -> commit n (outputs) -> advance n+1 past its discarded slots

* Scheduling n+1 assumes every sample of step n commits exactly one token (its anchor): `advance`
  moves each scheduled sequence's computed count as the synchronous engine does after its sync
  (steps without drafts accept none, so nothing it does depends on the results) and marks the
  token each sample draws as pending (`Sequence.pending_entry`: its entry in step n). A pending
  token counts in the sequence's length (KV blocks are reserved for it, the scheduler plans it as
  the next anchor, min_tokens counts it) but its id is on the device only: `fill_pending` writes
  it into n+1's input ids from n's sampled tokens (a gather and an index_put, no host read), where
  penalty counts read it too (rollout.engine.rows).
* Discarded slots: a sample that finishes in step n (max_tokens, a stop token or string, the
  context, a failure) or is aborted before n+1's results arrive keeps its slot in n+1, whose
  result is never read: the committer skips finished samples and `advance` skips those finished
  by then. A discarded write never lands in a registered prefix block: a pending token sits past
  the prompt, and only full prompt blocks are registered (a prompt chunk still runs in full after
  an abort, so blocks registered for it hold the prompt's KV). Their blocks were freed when they
  finished; a later step that gets them writes after n+1's discarded writes (the device runs
  steps in order).
* Preemption while scheduling n+1 may take a sequence of step n: it waits with its pending token,
  which step n's commit then appends (a sequence readmitted at once recomputes it, filled like any
  pending token).
* Step n's results are copied to the host right behind its own work (`start_copy`, at launch), and
  its sync waits on an event after those copies, not on the stream (which holds n+1 by then).
* The one-step-late mask hand-over (rollout.engine.commit) runs before n+1's launch: n+1's mask copy
  reuses the staging buffer of n-1's.
* After a drafted step (rollout.engine.verify: sample e commits its a_e accepted drafts and one more
  token): scheduling n+1 assumes a_e = 0 too, and the sample's `pending_drafts` says by how many
  tokens its length may fall short. n+1 reserves KV slots for them; on the device (`Pending`,
  `fill_pending`) its pending token is n's last committed one, tokens[e, a_e], and its positions,
  slots, context lengths and sampled positions move by a_e (the shared-prefix plan and the kernels'
  bounds take the longest case, and causal masks hide the keys past a query). n's commit then adds
  a_e to the computed count (`Scheduler.accept`) and frees the rejected drafts' blocks but those n+1
  still writes. A sample whose next step would depend on a_e (a min_tokens still to reach, or
  max_tokens close enough to cap its next drafts) sits n+1 out (`Scheduler.waits_commit`) and joins
  the step after, with the drafts the synchronous loop gives it: the same drafts make the same
  samples.
* A drafter that proposes from anchors on the device (`Drafter.device_anchors`: DFlash and DSpark
  without a confidence cut or a refresh) drafts n+1 before n syncs: its anchors and their positions
  are `Pending`'s.

A step runs synchronously (n+1 is scheduled after n's commit, as with `--no-overlap`) when building
n+1 needs host state of step n; `sync_reason` names each case, and `Pipeline.sync_steps` counts them:
* "drafts": step n verified drafts and the drafter does not propose from device anchors (its host
  state follows each step's committed tokens: the history drafter, a refresh, a confidence cut);
* "draft penalties": step n verified drafts of a sample with penalties (their counts need n's
  committed tokens on the host);
* "drafter": a drafter that keeps per-step host state and says so (`Drafter.overlaps` False; the
  shipped drafters overlap, a refreshing one too: rollout.spec.refresh);
* "grammar": a grammar sample of step n (its bitmask in n+1 needs the matcher advanced by n's token);
* "weight update": a pending weight update (the pipeline drains, then it applies between steps);
* "off": `overlap=False`.

A step scheduled ahead with drafts from a drafter without device anchors is held (`Pipeline.held`,
counted as "drafts next") and launches at the start of the next `step()`, after n's commit, without
the samples that finished meanwhile. Its schedule is the one the synchronous loop would make, but for
the one-step lag of admissions that any overlapped step has.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from rollout.engine.batch import StepBatch
from rollout.engine.drafter import Drafter, Drafts
from rollout.engine.scheduler import ScheduledSeq, Scheduler
from rollout.engine.transfer import upload
from rollout.engine.verify import VerifyResult


class StepCopy(NamedTuple):
    """A step's results on their way to the host, queued right behind the step's own work (a step
    launched after it does not delay them): tokens, logprobs, num_accepted and has_support as host
    tensors (pinned on CUDA), and on CUDA the event that marks the copies' end."""

    tensors: tuple[torch.Tensor, ...]
    event: torch.cuda.Event | None


def start_copy(result: VerifyResult | None) -> StepCopy | None:
    """Starts the copy of the step's committed tokens, logprobs and acceptance counts (no wait)."""
    if result is None:
        return None
    tensors = (result.tokens, result.logprobs, result.num_accepted, result.has_support)
    event = None
    host = tuple(t.to("cpu", non_blocking=True) for t in tensors)
    if result.tokens.is_cuda:
        event = torch.cuda.Event()
        event.record()
    return StepCopy(host, event)


@dataclass
class Launched:
    """A step whose device work is queued: what its sync and commit need."""

    plan: list[ScheduledSeq]
    drafts: Drafts
    step: StepBatch
    result: VerifyResult | None  # None: no sampling entries
    captured: object  # the capture's Captured, None without mask entries
    masks: np.ndarray | None  # the host array its mask copy lands in (MaskCapture.to_host)
    copy: StepCopy | None  # its results' copy to the host, started at launch; None without entries
    graphed: bool  # its target forward replayed a CUDA graph (the draft budget's cost model reads it)
    choice: int  # the draft budget's choice its plan came from (SpecBudget.choices; 0 without a budget)
    launch_seconds: float  # host time its launch took (the engine bills it to this step's recorded time)
    advanced: bool = False  # `advance` ran: its sync only commits
    ahead: bool = False  # launched before the step ahead of it synchronised (by an earlier step() call)

    @functools.cached_property
    def drafted(self) -> bool:
        """Some item verifies drafts (read by the pipeline each step: computed once)."""
        return any(self.drafts.num_per_item)


class Pipeline:
    """The launched step not yet synchronised, at most one between `LLMEngine.step()` calls."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.inflight: Launched | None = None
        self.held: list[ScheduledSeq] | None = None  # step n+1 scheduled ahead with drafts, not launched
        self.sync_steps: Counter[str] = Counter()  # steps that ran synchronously, by `sync_reason`
        self.overlapped = 0  # steps launched before the step ahead of them synchronised
        self.overlapped_drafts = 0  # of them, steps launched before a drafted step synchronised

    @property
    def idle(self) -> bool:
        return self.inflight is None and self.held is None

    def take(self) -> Launched | None:
        launched, self.inflight = self.inflight, None
        return launched

    def take_held(self) -> list[ScheduledSeq] | None:
        """The held plan without the samples that finished since it was scheduled (their blocks are
        free already); None when no plan is held or none of its samples is left."""
        plan, self.held = self.held, None
        plan = [item for item in plan or () if not item.seq.is_finished]
        return plan or None

    def hold(self, plan: list[ScheduledSeq]) -> None:
        """Step n+1, scheduled ahead, verifies drafts: it launches after n's sync (module docstring)."""
        self.held = plan
        self.sync_steps["drafts next"] += 1

    def ahead(self, launched: Launched | None, current: Launched) -> Launched | None:
        """Step n+1 launched before n's (`current`) sync: marked and counted."""
        if launched is not None:
            launched.ahead = True
            self.overlapped += 1
            self.overlapped_drafts += current.drafted
        return launched

    def overlaps(self, current: Launched, drafter: Drafter | None, weights_pending: bool) -> bool:
        """Whether step n+1 may be scheduled before `current` syncs; counts the reason when not."""
        reason = sync_reason(current, self.enabled, drafter, weights_pending)
        if reason is not None:
            self.sync_steps[reason] += 1
        return reason is None


def sync_reason(current: Launched, enabled: bool, drafter: Drafter | None, weights_pending: bool) -> str | None:
    """Why the step after `current` must be built from current's committed tokens (None: it need not)."""
    if not enabled:
        return "off"
    if drafter is not None and not drafter.overlaps():
        return "drafter"
    if current.drafted:
        if not drafter.device_anchors():
            return "drafts"
        rows = current.step.rows
        if any(k and seq.params.has_penalties for seq, k in zip(rows.entries, rows.num_draft)):
            return "draft penalties"
    if weights_pending:
        return "weight update"
    if any(seq.grammar is not None for seq in current.step.rows.entries):
        return "grammar"
    return None


def advance(scheduler: Scheduler, launched: Launched) -> list[tuple[int, int]]:
    """Before the step's results: its live sequences' computed counts move as after a sync that
    accepted no drafts, and each live sample's draw becomes its pending token, with the drafts it
    verifies as `pending_drafts` (what its length may lack: `Scheduler.accept` adds the accepted ones
    after the sync). Samples finished meanwhile (their slots are discarded) are left out. Returns the
    fork copies (scheduler.advance)."""
    items = [item for item in launched.plan if not item.seq.is_finished]
    copies = scheduler.advance(items, [0] * len(items))
    rows = launched.step.rows
    for e, (seq, k) in enumerate(zip(rows.entries, rows.num_draft)):
        if not seq.is_finished:
            seq.pending_entry, seq.pending_drafts = e, k
    launched.advanced = True
    return copies


class Pending(NamedTuple):
    """What a step launched before `prev` syncs takes from prev's results, per item of its plan, on
    the device: `anchor` [S], the sample's last token (prev's last committed one, tokens[e, a_e]; 0
    for items without a pending token) and `shift` [S], a_e (its positions from that token on lie a_e
    further than the host counted; 0 without drafts; None when no item's sample verified drafts there)."""

    has: torch.Tensor  # [S] bool: the item's sample has a pending token
    anchor: torch.Tensor  # [S] int64
    shift: torch.Tensor | None  # [S] int64; None: no item's shift can be nonzero


def pending(plan: list[ScheduledSeq], prev: Launched, device: torch.device, drafts_ahead: bool) -> Pending | None:
    """The plan's pending tokens and shifts from `prev` (the step in flight), gathered on the device
    with no host read, where something needs them: a shift (prev verified drafts of an item's sample)
    or drafts that the drafter proposes from these anchors (`drafts_ahead`). None otherwise: after a
    plain step `fill_pending` gathers the tokens it writes itself, no more ops than that."""
    shifted = any(item.seq.pending_drafts for item in plan)
    if not (shifted or drafts_ahead):
        return None
    entries = [item.seq.pending_entry for item in plan]
    if max(entries, default=-1) < 0:
        return None
    entry = upload(entries, torch.int64, device)  # [S]
    has = entry >= 0
    entry = entry.clamp(min=0)
    if not shifted:
        return Pending(has, prev.result.tokens[entry, 0], None)
    shift = prev.result.num_accepted[entry] * has
    return Pending(has, prev.result.tokens[entry, shift], shift)


def fill_pending(step: StepBatch, num_drafts: list[int], prev: Launched, pend: Pending | None) -> None:
    """Writes the pending tokens of the step's sequences (drawn by `prev`, the step in flight, not
    read back) into its input ids, on the device: `pend`'s anchors, or without it each one's entry of
    prev's first token; and moves the positions of samples whose drafts prev verifies by the drafts
    it accepted (`shift_positions`)."""
    index, source = [], []
    offset = 0
    for i, (item, k) in enumerate(zip(step.tokens.items, num_drafts)):
        seq, new = item.seq, item.num_new_tokens
        if seq.pending_entry >= 0:  # (a loop over the batch every overlapped step: kept lean)
            at = len(seq.prompt_token_ids) + len(seq.output_token_ids) - seq.num_computed_tokens  # its input slot
            if 0 <= at < new:
                index.append(offset + at)
                source.append(i if pend is not None else seq.pending_entry)
        offset += new + k
    if index:
        where, source = upload([index, source], torch.int64, step.tokens.input_ids.device)  # [2, P]: one copy
        tokens = pend.anchor[source] if pend is not None else prev.result.tokens[source, 0]
        step.tokens.input_ids.index_put_((where,), tokens)
    if pend is not None and pend.shift is not None:
        shift_positions(step, pend.shift)


def shift_positions(step: StepBatch, shift: torch.Tensor) -> None:
    """Every token of item s lies shift[s] positions further (in place, on the device): positions,
    KV slots (from the block tables), context lengths and the positions the rows predict (their
    seeded draws read them)."""
    meta, rows = step.tokens.meta, step.rows
    num_tokens, width = meta.positions.shape[0], meta.block_tables.shape[1]
    q_lens = meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]  # [S]
    seq_of = torch.repeat_interleave(torch.arange(len(shift), device=shift.device), q_lens,
                                     output_size=num_tokens)  # [T], no host read
    moved = shift[seq_of]  # [T]
    meta.positions.add_(moved)
    meta.context_lens.add_(shift)
    pos, size = meta.positions, meta.block_size
    meta.slot_mapping.copy_(meta.block_tables.reshape(-1)[seq_of * width + pos // size] * size + pos % size)
    rows.row_position.add_(moved[rows.logits_index])
