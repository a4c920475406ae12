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

A step runs synchronously (n+1 is scheduled after n's commit, as with `--no-overlap`) when building
n+1 needs host state of step n; `sync_reason` names each case, and `Pipeline.sync_steps` counts them:
* "drafts": step n was scheduled with drafts (n+1's positions depend on how many it accepts, and n's
  commit frees the blocks reserved for drafts not accepted or not proposed);
* "drafter": a drafter that keeps per-step host state and says so (`Drafter.overlaps` False; the
  shipped drafters overlap, a refreshing one too: rollout.spec.refresh);
* "grammar": a grammar sample of step n (its bitmask in n+1 needs the matcher advanced by n's token);
* "weight update": a pending weight update (the pipeline drains, then it applies between steps);
* "off": `overlap=False`.

With a drafter, a step without drafts (the draft budget verifies none: an untrained or drifted
drafter, a batch too wide to pay) overlaps like any plain step. Step n+1 is scheduled ahead as above;
when the budget gives it drafts, they need n's committed token as their anchor, so n+1 is held
(`Pipeline.held`, counted as "drafts next") and launches at the start of the next `step()`, after n's
commit, without the samples that finished meanwhile. Its schedule is the one the synchronous loop
would make, but for the one-step lag of admissions that any overlapped step has.
"""

from __future__ import annotations

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
    advanced: bool = False  # `advance` ran: its sync only commits


class Pipeline:
    """The launched step not yet synchronised, at most one between `LLMEngine.step()` calls."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.inflight: Launched | None = None
        self.held: list[ScheduledSeq] | None = None  # step n+1 scheduled ahead with drafts, not launched
        self.sync_steps: Counter[str] = Counter()  # steps that ran synchronously, by `sync_reason`
        self.overlapped = 0  # steps launched before the step ahead of them synchronised

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

    def ahead(self, launched: Launched | None) -> Launched | None:
        """Step n+1 launched before n's sync: counted."""
        self.overlapped += launched is not None
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
    if any(item.num_draft for item in current.plan):  # (scheduled: unproposed drafts' blocks go at its commit)
        return "drafts"
    if weights_pending:
        return "weight update"
    if any(seq.grammar is not None for seq in current.step.rows.entries):
        return "grammar"
    return None


def advance(scheduler: Scheduler, launched: Launched) -> list[tuple[int, int]]:
    """Before the step's results: its live sequences' computed counts move as after a sync that
    accepted no drafts (the step has none), and each live sample's draw becomes its pending token.
    Samples finished meanwhile (their slots are discarded) are left out. Returns the fork copies
    (scheduler.advance)."""
    items = [item for item in launched.plan if not item.seq.is_finished]
    copies = scheduler.advance(items, [0] * len(items))
    for e, seq in enumerate(launched.step.rows.entries):
        if not seq.is_finished:
            seq.pending_entry = e
    launched.advanced = True
    return copies


def fill_pending(step: StepBatch, num_drafts: list[int], prev: Launched, device: torch.device) -> None:
    """Writes the pending tokens of the step's sequences (sampled by `prev`, not read back) into its
    input ids, on the device: input_ids[t] = prev's token of entry `pending_entry`."""
    index, source = [], []
    offset = 0
    for item, k in zip(step.tokens.items, num_drafts):
        seq, new = item.seq, item.num_new_tokens
        if seq.pending_entry >= 0:  # (a loop over the batch every overlapped step: kept lean)
            at = len(seq.prompt_token_ids) + len(seq.output_token_ids) - seq.num_computed_tokens  # its input slot
            if 0 <= at < new:
                index.append(offset + at)
                source.append(seq.pending_entry)
        offset += new + k
    if index:
        where, entry = upload([index, source], torch.int64, device)  # [2, P]: one copy
        step.tokens.input_ids.index_put_((where,), prev.result.tokens[entry, 0])  # each entry's first token
