"""After the step's one host copy: advance the sequences, append committed tokens with
their logprobs and masks, stop at the finish, fork the samples of freshly prefilled
prompts, roll back the KV of rejected drafts, and emit finished samples."""

from __future__ import annotations

from rollout.engine.batch import StepBatch
from rollout.engine.outputs import SampleOutput
from rollout.engine.sequence import Sequence
from rollout.errors import GrammarRejected
from rollout.masks.capture import committed_masks
from rollout.masks.pack import assemble_supports


class Committer:
    def __init__(self, engine):
        self.engine = engine

    def commit(self, step: StepBatch, host) -> list[SampleOutput]:
        if not host:
            self._advance(step, [])
            return []
        tokens, logprobs, num_accepted, has_support = (h.tolist() for h in host[:4])
        self._advance(step, num_accepted)
        masks = None
        if len(host) > 4:
            counts = {e: num_accepted[e] + 1 for e, s in enumerate(step.entries) if s.mask}
            masks = committed_masks(self.engine.capture.last, host[4], counts)
        outputs = []
        for e, seq in enumerate(step.entries):
            count = num_accepted[e] + 1
            if not has_support[e]:
                position = seq.num_output_tokens + num_accepted[e]
                outputs.append(self.fail(seq, f"no token is allowed at output position {position}: the grammar and "
                                              f"min_tokens / stop_token_ids exclude every token"))
            elif seq.mask and e in masks.failed:
                bound = masks.rows.width
                outputs.append(self.fail(seq, f"mask support exceeded its bound of {bound}"))
            else:
                try:
                    reason = self._append(seq, tokens[e][:count], logprobs[e][:count], masks, e)
                except GrammarRejected as exc:  # never expected (verification applies the bitmask): fail the sample
                    outputs.append(self.fail(seq, str(exc)))
                    continue
                if reason:
                    outputs.append(self.finish(seq, reason))
        for item in step.items:  # only blocks reserved for drafts can lie past the committed tokens
            if item.num_draft and not item.seq.is_finished:
                self.engine.block_manager.truncate(item.seq, item.seq.num_tokens)
        return outputs

    def _advance(self, step: StepBatch, num_accepted: list[int]) -> None:
        """Computed counts (the tokens fed plus the accepted drafts), prefix-cache registration,
        and the forks of prompts whose last token was computed (before anyone may finish)."""
        bm = self.engine.block_manager
        accepted, forks = {}, []
        for e, (seq, i) in enumerate(zip(step.entries, step.entry_item)):
            parent = step.items[i].seq
            if seq is parent:
                accepted[i] = num_accepted[e]
            else:
                forks.append((parent, seq))
        for i, item in enumerate(step.items):
            seq, old = item.seq, item.seq.num_computed_tokens
            seq.num_computed_tokens = old + item.num_new_tokens + accepted.get(i, 0)
            bm.register_computed(seq, old)
        for parent, child in forks:
            self._fork(parent, child)
        for i in set(step.entry_item):  # a prompt still mid-prefill keeps its samples to fork
            step.items[i].seq.children = []

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        copy = self.engine.scheduler.fork(parent, child)
        if copy is not None:
            self.engine.pending_copies.append(copy)

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[float], masks, e: int) -> str | None:
        """Append committed tokens (entry e of the step) up to the finish; returns the finish reason
        or None. `masks`: the step's CommittedMasks, None when no entry asked for masks."""
        out, n, reason = seq.output_token_ids, len(tokens), None
        # the finish: the token that reaches max_tokens or the context, unless a stop token
        # comes first (or is that token)
        room = seq.params.max_tokens - len(out)
        context_room = self.engine.max_model_len - len(seq.prompt_token_ids) - len(out)
        if context_room < room:
            room = context_room
        if room <= n:
            n, reason = max(room, 1), "length"
        if not seq.stop_ids.isdisjoint(tokens):
            for j in range(n):
                if tokens[j] in seq.stop_ids:
                    n, reason = j + 1, "stop"
                    break
        if n < len(tokens):
            tokens, logprobs = tokens[:n], logprobs[:n]
        out += tokens
        seq.output_logprobs += logprobs
        if seq.mask:
            seq.support_parts.append((masks.rows, masks.first[e], n))
        seq.accept_lengths.append(n)
        if seq.grammar is not None:
            seq.grammar.commit(tokens)
        return reason

    def finish(self, seq: Sequence, reason: str) -> SampleOutput:
        self.engine.scheduler.finish(seq)
        self.engine.intake.done(seq)
        seq.finish_reason = reason
        return SampleOutput(
            request_id=seq.request_id, prompt_index=seq.prompt_index, sample_index=seq.sample_index,
            prompt_token_ids=seq.prompt_token_ids, token_ids=seq.output_token_ids,
            token_logprobs=seq.output_logprobs, finish_reason=reason,
            supports=None if seq.support_parts is None else assemble_supports(seq.support_parts,
                                                                              seq.mask == "support"),
            accept_lengths=seq.accept_lengths, policy_version=self.engine.policy_version,
        )

    def fail(self, seq: Sequence, error: str) -> SampleOutput:
        """The whole sample fails: no tokens, no partial masks."""
        out = self.finish(seq, "error")
        out.token_ids, out.token_logprobs, out.supports = [], [], None
        out.accept_lengths, out.error = [], error
        return out
