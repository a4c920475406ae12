"""After the step's one host copy (and the scheduler's `advance`): append committed tokens with
their logprobs and masks, stop at the finish (max_tokens, the context, a stop token, or the token
completing a stop string: rollout.engine.stops), and emit finished samples. Under overlapped
scheduling (rollout.engine.overlap) an entry whose sample finished or was aborted before the step's
results arrived is a discarded slot: nothing of it is read.

The mask hand-over, one step late (explained here once; capture and the engine refer here): a
step's masks reach its samples one step late, unless one of its masked samples finishes (then
at once). `hand_over_masks` runs while the device computes the next step, so their host work
(the gather of the committed rows, a support's overflow test, one part per sample) hides behind
a wait the engine has anyway. Anything that reads a sample's masks hands over first (a finish,
an abort); a sample whose support overflowed fails as a whole at its next step (or its finish).
The capture side keeps two staging buffers in turn for this (rollout.engine.capture)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from rollout.engine.batch import SampleRows
from rollout.engine.capture import committed_masks
from rollout.engine.intake import Intake
from rollout.engine.scheduler import Scheduler
from rollout.engine.sequence import Sequence
from rollout.errors import GrammarRejected
from rollout.masks.pack import assemble_supports
from rollout.outputs import SampleOutput


class StepMasks:
    """One step's masks on their way to its samples: the host array the step's copy of the packed
    rows lands in, and the (sample, entry, committed count) of every masked sample that took tokens."""

    __slots__ = ("captured", "packed", "taken")

    def __init__(self, captured, packed):
        self.captured, self.packed = captured, packed
        self.taken: list[tuple[Sequence, int, int]] = []


class HostStep(NamedTuple):
    """The step's one device -> host copy (`LLMEngine` makes it, `Committer.commit` reads it)."""

    tokens: list[list[int]]  # [E][Kmax+1] committed tokens of each entry, -1 past its end
    logprobs: list[list[float]]  # [E][Kmax+1] log p of each committed token
    num_accepted: list[int]  # [E] accepted drafts: entry e commits num_accepted[e] + 1 tokens
    has_support: list[bool]  # [E] False when the processors left the final row no token
    masks: np.ndarray | None  # the packed mask rows' host array (MaskCapture.to_host); None without masks


class Committer:
    """Appends each entry's committed tokens up to its finish, hands masks over and emits finished
    samples. `scheduler` frees a finished sample's blocks, `intake` forgets it; `policy_version()`
    stamps it; `max_model_len` bounds a sample's context; `decode` (token ids -> output text) fills
    the `text` of samples that asked for it; `on_finish(seq)` hears of every finished sample (the
    drafter's `sample_finished`)."""

    def __init__(self, scheduler: Scheduler, intake: Intake, max_model_len: int, policy_version: Callable[[], int],
                 decode: Callable[[list[int]], str] | None = None,
                 on_finish: Callable[[Sequence], None] | None = None):
        self.scheduler, self.intake = scheduler, intake
        self.max_model_len = max_model_len
        self.policy_version = policy_version
        self.decode = decode
        self.on_finish = on_finish
        self.pending: StepMasks | None = None  # the last step's masks, not yet handed to its samples

    def commit(self, rows: SampleRows, host: HostStep | None, captured) -> list[SampleOutput]:
        """After the scheduler advanced the step's sequences: `host` is None when the step had no
        entries; `captured` its packed masks (their host array is `host.masks`), None when no entry
        asked for masks."""
        if host is None:
            return []
        tokens, logprobs, num_accepted = host.tokens, host.logprobs, host.num_accepted
        masks = StepMasks(captured, host.masks) if captured is not None else None
        outputs, finishing = [], []
        for e, seq in enumerate(rows.entries):
            seq.pending_entry, seq.pending_drafts = -1, 0  # its tokens are read now (rollout.engine.overlap)
            if seq.is_finished:  # finished or aborted before this step's results: a discarded slot
                continue
            count = num_accepted[e] + 1
            if not host.has_support[e]:
                position = seq.num_output_tokens + num_accepted[e]
                outputs.append(self.fail(seq, f"no token is allowed at output position {position}: the grammar and "
                                              f"min_tokens / stop_token_ids exclude every token"))
            elif seq.mask_error is not None:  # found while this step ran, in the previous step's masks
                outputs.append(self.fail(seq, seq.mask_error))
            else:
                try:
                    reason = self._append(seq, tokens[e][:count], logprobs[e][:count], masks, e)
                except GrammarRejected as exc:  # never expected (verification applies the bitmask): fail the sample
                    outputs.append(self.fail(seq, str(exc)))
                    continue
                if reason:
                    finishing.append((seq, reason))
        self.pending = masks
        if any(seq.mask for seq, _ in finishing):
            self.hand_over_masks()  # a finishing sample's masks are read now
        return outputs + [self.finish(seq, reason) for seq, reason in finishing]

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[float], masks, e: int) -> str | None:
        """Append committed tokens (entry e of the step) up to the finish; returns the finish reason
        or None. `masks`: the step's StepMasks, None when no entry asked for masks."""
        n, reason = self._kept(seq, tokens)
        if n < len(tokens):
            tokens, logprobs = tokens[:n], logprobs[:n]
        seq.output_token_ids += tokens
        seq.output_logprobs += logprobs
        if seq.mask:
            masks.taken.append((seq, e, n))
        seq.accept_lengths.append(n)
        if seq.grammar is not None:
            seq.grammar.commit(tokens)
        return reason

    def _kept(self, seq: Sequence, tokens: list[int]) -> tuple[int, str | None]:
        """How many of the step's committed tokens the sample keeps, and its finish reason (None: it
        goes on). The finish is the token that reaches max_tokens or the context, unless a stop token
        or the token completing a stop string comes first (or is that token)."""
        out, n, reason = seq.output_token_ids, len(tokens), None
        room = min(seq.params.max_tokens - len(out), self.max_model_len - len(seq.prompt_token_ids) - len(out))
        if room <= n:
            n, reason = max(room, 1), "length"
        if not seq.stop_ids.isdisjoint(tokens):
            for j in range(n):
                if tokens[j] in seq.stop_ids:
                    n, reason = j + 1, "stop"
                    break
        if seq.stop_matcher is not None:  # stop strings, on the tokens kept so far
            hit = seq.stop_matcher.scan(tokens[:n], len(out), seq.params.min_tokens)
            if hit is not None:
                n, reason, seq.stop_reason = hit[0] + 1, "stop", hit[1]
        return n, reason

    def hand_over_masks(self) -> None:
        """Gives the pending step's committed mask rows to its samples (one part each); a sample one
        of whose rows overflowed its bound is marked to fail as a whole."""
        masks, self.pending = self.pending, None
        if masks is None or not masks.taken:
            return
        kept = committed_masks(masks.captured, masks.packed, {e: n for _, e, n in masks.taken})
        rows = kept.rows
        for (seq, _, n), first in zip(masks.taken, kept.first):
            seq.support_parts.append((rows, first, n))
        if kept.failed:
            for seq, e, _ in masks.taken:
                if e in kept.failed:
                    seq.mask_error = f"mask support exceeded its bound of {rows.width}"

    def finish(self, seq: Sequence, reason: str) -> SampleOutput:
        if seq.mask_error is not None and reason != "error":  # its masks overflowed: the sample fails
            return self.fail(seq, seq.mask_error)
        self.scheduler.finish(seq)
        self.intake.done(seq)
        seq.finish_reason = reason
        if self.on_finish is not None:
            self.on_finish(seq)
        return SampleOutput(
            request_id=seq.request_id, prompt_index=seq.prompt_index, sample_index=seq.sample_index,
            prompt_token_ids=seq.prompt_token_ids, token_ids=seq.output_token_ids,
            token_logprobs=seq.output_logprobs, finish_reason=reason,
            supports=None if seq.support_parts is None else assemble_supports(seq.support_parts,
                                                                              seq.mask == "support"),
            accept_lengths=seq.accept_lengths, policy_version=self.policy_version(),
            params=seq.params, mask=seq.mask, grammar_kind=seq.grammar_kind, stop_reason=seq.stop_reason,
            text=self.decode(seq.output_token_ids) if seq.return_text and reason != "error" else None,
        )

    def fail(self, seq: Sequence, error: str) -> SampleOutput:
        """The whole sample fails: no tokens, no partial masks."""
        out = self.finish(seq, "error")
        out.token_ids, out.token_logprobs, out.supports = [], [], None
        out.accept_lengths, out.error, out.stop_reason = [], error, None
        return out
