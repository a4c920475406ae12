"""The rollout-history drafter (`--spec history`): RL revisits its prompts epoch after epoch, so the
samples the server already generated for a prompt predict the next ones. Drafts come from the
prompt's history (rollout.spec.history): the longest suffix of the sample's output (from its
beginning, `START`) that occurs in a stored sample of the same prompt, followed by the
continuation the stored samples agree on most, up to the block's drafts. No model, no KV cache.

Drafts are deterministic given what was stored before the step, so `q` is one-hot (`Drafts.q` is
None) and verification is exact for greedy and sampled requests alike (docs/verification.md): a
sampled draft d is kept with probability p(d). The drafts cut at the first position whose
confidence (the fraction of stored occurrences continuing that way) falls below
`spec_confidence_threshold`.

What feeds the history: every sample that finishes with `stop` or `length`, handed to the
history store (rollout.spec.history_store) as it finishes; a worker thread stores it, so the
samples of one group (n > 1) or of one rollout feed those still running a few steps later, and the
engine thread does no building. Aborted and failed samples are not stored. Each running sample
keeps its match (`Matcher`) in the published history of its prompt and advances it by the tokens
committed since its last step; it matches afresh when the published history of its prompt changed
(a new snapshot). Preemption keeps a sample's tokens, so its match stays valid.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from rollout.engine.config import EngineConfig
from rollout.engine.drafter import Drafter, Drafts
from rollout.engine.scheduler import ScheduledSeq
from rollout.engine.sequence import Sequence
from rollout.engine.transfer import upload
from rollout.spec.history import PromptHistory, prompt_key
from rollout.spec.history_store import HistoryStore
from rollout.spec.suffix import START

log = logging.getLogger(__name__)

DEFAULT_BLOCK = 8  # tokens per verify step (7 drafts) when --spec-block-size is not given
MATCH_WINDOW = 256  # a fresh match reads at most this many of the output's last tokens
STORED_REASONS = ("stop", "length")


def build_history_drafter(config: EngineConfig, target=None) -> HistoryDrafter:
    """The engine's drafter factory for `--spec history` (see rollout.build_engine)."""
    return HistoryDrafter(HistoryStore(config.spec_history_tokens, config.spec_history_keep_versions),
                          config.spec_block_size or DEFAULT_BLOCK, config.spec_confidence_threshold,
                          torch.device(config.device))


@dataclass
class Matcher:
    """A running sample's longest match in its prompt's history, after `consumed` output tokens."""

    key: bytes
    entry: PromptHistory | None = None  # the published snapshot matched in (never changes)
    consumed: int = 0
    state: int = 0
    length: int = 0
    blocked: bool = False  # its seed drew a stored sample: it must not draft from them


class HistoryDrafter(Drafter):
    """Drafts from the rollout history of each sample's prompt (see module docstring)."""

    name = "history"
    target_layer_ids = ()

    def __init__(self, store: HistoryStore, block_size: int = DEFAULT_BLOCK, confidence_threshold: float = 0.0,
                 device: torch.device | None = None):
        self.store = store
        self.block = block_size
        self.num_spec = block_size - 1
        self.threshold = confidence_threshold
        self.device = device or torch.device("cpu")
        self.version = 0  # the policy version now sampling
        self.matchers: dict[int, Matcher] = {}  # seq_id -> its match, while it runs
        self.num_proposals = 0  # batched propose calls
        self.num_drafted = 0  # draft tokens proposed

    def bytes_per_block(self, block_size: int) -> int:
        return 0

    def allocate(self, num_blocks: int, block_size: int) -> None:
        return None

    def update_context(self, target_aux: torch.Tensor, meta) -> None:
        return None

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        return None

    def overlaps(self) -> bool:
        return True  # it reads committed tokens only when it drafts, and drafted steps launch after a sync

    def propose(self, items: list[ScheduledSeq], block_table: np.ndarray) -> Drafts:
        per_item, flat = [0] * len(items), []
        for i, item in enumerate(items):
            if item.num_draft > 0:
                drafts = self.draft(item.seq, item.num_draft)[0]
                per_item[i] = len(drafts)
                flat += drafts
        return self.drafts_of(flat, per_item)

    def drafts_of(self, flat: list[int], per_item: list[int]) -> Drafts:
        """The step's drafts (flat, in item order; `per_item` each item's count), counted."""
        self.num_proposals += 1
        self.num_drafted += len(flat)
        return Drafts(upload(flat, torch.int64, self.device), per_item)  # [D]; q None: one-hot

    def sample_finished(self, seq: Sequence) -> None:
        matcher = self.matchers.pop(seq.seq_id, None)
        if seq.finish_reason in STORED_REASONS and seq.output_token_ids:
            key = matcher.key if matcher is not None else prompt_key(seq.prompt_token_ids)
            self.store.add(key, seq.seed, seq.output_token_ids, self.version)

    def policy_updated(self, version: int) -> None:
        self.version = version
        self.store.policy_updated(version)
        log.info("history drafter: policy version %d; earlier versions' samples %s", version,
                 "kept" if self.store.history.keep_versions else "dropped")

    def flush(self) -> None:
        """Wait until the finished samples handed over so far are stored (tests, benchmarks)."""
        self.store.flush()

    def draft(self, seq: Sequence, limit: int) -> tuple[list[int], list[float]]:
        """Up to `limit` drafts following `seq`'s output, from its prompt's history, and each one's
        confidence (the fraction of stored occurrences continuing that way)."""
        matcher = self._synced(seq)
        if matcher.entry is None or matcher.blocked or matcher.length == 0:
            return [], []
        tokens, confidence = matcher.entry.automaton.continuation(matcher.state, limit)
        if self.threshold > 0:
            for i, c in enumerate(confidence):
                if c < self.threshold:
                    return tokens[:i], confidence[:i]
        return tokens, confidence

    def _synced(self, seq: Sequence) -> Matcher:
        """`seq`'s matcher, advanced over the tokens committed since its last draft, or matched afresh
        when its prompt's published history changed (or was evicted) since."""
        matcher = self.matchers.get(seq.seq_id)
        if matcher is None:
            matcher = self.matchers[seq.seq_id] = Matcher(prompt_key(seq.prompt_token_ids))
        entry = self.store.published.get(matcher.key)
        out = seq.output_token_ids
        if entry is None:
            matcher.entry = None
        elif entry is not matcher.entry:
            start = max(0, len(out) - MATCH_WINDOW)
            context = out[start:] if start else [START, *out]
            matcher.entry, matcher.consumed = entry, len(out)
            matcher.state, matcher.length = entry.automaton.match(context)
            matcher.blocked = seq.seed in entry.seeds
            self.store.touch(matcher.key)
        else:
            automaton, state, length = entry.automaton, matcher.state, matcher.length
            for token in out[matcher.consumed:]:
                state, length = automaton.step(state, length, token)
            matcher.state, matcher.length, matcher.consumed = state, length, len(out)
        return matcher
