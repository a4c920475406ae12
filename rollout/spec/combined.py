"""`--spec dflash+history` / `dspark+history`: a drafter model (DFlash / DSpark, rollout.spec.proposer)
and the rollout-history drafter (rollout.spec.history_drafter) together. Per request and step, the
proposer expected to have more of its drafts accepted drafts the request's block:

* the model's expected accepted length: sum_j prod_{i<=j} a_i over the item's draft limit, a_i the
  request's conditional acceptance of the model's drafts at position i (adaptive speculation's
  estimate, rollout.engine.spec_budget.AcceptanceEstimates: decayed per-request counts shrunk towards
  the proposer's server-wide estimate, which starts from an optimistic prior);
* the history's: the same over the continuation its match proposes this step (0 without a match, or
  when the request's seed drew a stored sample), each position's acceptance min(h_i, c_i): h_i the
  request's past acceptance of history drafts (an AcceptanceEstimates of its own), c_i the
  continuation's own confidence, the fraction of the stored occurrences of the matched suffix that
  continue that way (a short match has many occurrences, which rarely agree; a long one few).

Ties go to the history: it costs no forward, and while nothing is measured both rest on the same
prior, so a request whose stored samples agree tries its history first. Each proposer's estimates
learn only from the drafts it proposed (`verified`): a request whose history drafts are rejected
turns to the model within a step or two, one whose history drafts are accepted keeps them.

Drafts: the history matches every decode item it could win (its expected length at full confidence
reaches the model's; the others' matches catch up when next asked), so it knows each one's
continuation; the model's forward drafts only the items it won (its context is updated for every
token, as always). The two sets are merged in item order; q keeps the model's rows as the model drew
them and marks the history's one-hot, so every row's q is the law its draft came from and
verification stays exact (docs/verification.md). `Drafts.proposers` names each item's proposer, so
the engine counts drafts proposed and accepted per proposer and policy version.

The adaptive draft budget (rollout.engine.spec_budget) prices a request's drafts with its own
estimate, learnt from whichever proposer drafted it: the chosen one, as the request settles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from rollout.engine.config import EngineConfig
from rollout.engine.draft_choice import slot_gains
from rollout.engine.drafter import Drafter, Drafts
from rollout.engine.loader import LoadedModel, LoadProgress
from rollout.engine.scheduler import ScheduledSeq
from rollout.engine.sequence import Sequence
from rollout.engine.spec_budget import AcceptanceEstimates
from rollout.engine.transfer import upload
from rollout.engine.verify import Proposal
from rollout.spec.history_drafter import HistoryDrafter
from rollout.spec.history_store import HistoryStore
from rollout.spec.proposer import BlockDrafter, build_drafter

HISTORY = HistoryDrafter.name


def build_combined_drafter(config: EngineConfig, target: LoadedModel,
                           progress: LoadProgress | None = None) -> CombinedDrafter:
    """The engine's drafter factory for `--spec KIND+history` (see rollout.build_engine)."""
    model = build_drafter(config, target, progress)
    store = HistoryStore(config.spec_history_tokens, config.spec_history_keep_versions)
    return CombinedDrafter(model, HistoryDrafter(store, model.block, config.spec_confidence_threshold, model.device))


class CombinedDrafter(Drafter):
    """A drafter model and the history drafter, chosen per request and step (see module docstring)."""

    def __init__(self, model: BlockDrafter, history: HistoryDrafter):
        self.block_drafter, self.history = model, history
        self.name = f"{model.name}+{HISTORY}"
        self.block, self.num_spec = model.block, model.num_spec
        self.target_layer_ids = model.target_layer_ids
        self.acceptance = {model.name: AcceptanceEstimates(self.num_spec),
                           HISTORY: AcceptanceEstimates(self.num_spec)}  # per proposer

    # the drafter model's state, which the engine reaches through its drafter
    model = property(lambda self: self.block_drafter.model)
    device = property(lambda self: self.block_drafter.device)
    caches = property(lambda self: self.block_drafter.caches)
    graphs = property(lambda self: self.block_drafter.graphs,
                      lambda self, graphs: setattr(self.block_drafter, "graphs", graphs))

    def max_model_len(self) -> int | None:
        return self.block_drafter.max_model_len()

    def bytes_per_block(self, block_size: int) -> int:
        return self.block_drafter.bytes_per_block(block_size)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        self.block_drafter.allocate(num_blocks, block_size)

    def parts(self) -> list[Drafter]:
        return [self.block_drafter, self.history]

    def free(self) -> None:
        self.block_drafter.free()

    def update_context(self, target_aux: torch.Tensor, meta) -> None:
        self.block_drafter.update_context(target_aux, meta)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.block_drafter.copy_blocks(pairs)

    def use_graphs(self, max_batch: int, max_blocks_per_seq: int, block_size: int, scratch_block: int,
                   capture: bool) -> None:
        self.block_drafter.use_graphs(max_batch, max_blocks_per_seq, block_size, scratch_block, capture)

    def profile_forward(self, rows: int, scratch_block: int, block_size: int) -> Callable[[], object] | None:
        return self.block_drafter.profile_forward(rows, scratch_block, block_size)

    def sample_finished(self, seq: Sequence) -> None:
        self.history.sample_finished(seq)
        self.block_drafter.sample_finished(seq)

    def after_step(self, seconds: float) -> None:
        self.block_drafter.after_step(seconds)

    def overlaps(self) -> bool:
        return self.block_drafter.overlaps() and self.history.overlaps()

    def idle(self) -> bool:
        return self.block_drafter.idle()

    def checkpoint(self) -> tuple[str, bytes]:
        return self.block_drafter.checkpoint()

    def stats(self) -> dict[str, float]:
        return self.block_drafter.stats()

    def policy_updated(self, version: int) -> None:
        self.history.policy_updated(version)
        self.block_drafter.policy_updated(version)

    def flush(self) -> None:
        """Wait until the finished samples handed over so far are stored (tests, benchmarks)."""
        self.history.flush()

    def propose(self, items: list[ScheduledSeq], block_table: np.ndarray) -> Drafts:
        drafting = [i for i, it in enumerate(items) if it.num_draft > 0]
        drafted = [items[i] for i in drafting]
        history, model = self._estimates(drafted)
        may = np.flatnonzero(self._history_may_win(drafted, history, model)).tolist()
        rows = [drafting[j] for j in may]  # the items whose history is matched and walked
        found = [self.history.draft(items[i].seq, items[i].num_draft) for i in rows]
        chosen = self._history_wins([items[i] for i in rows], found, history[may], model[may]) \
            if any(t for t, _ in found) else ()
        won = {rows[j]: found[j][0] for j in np.flatnonzero(chosen).tolist()}  # item -> the history's drafts
        model_items = [dataclasses.replace(it, num_draft=0) if i in won else it for i, it in enumerate(items)] \
            if won else items
        own = self.block_drafter.propose(model_items, block_table) if len(won) < len(drafting) or not drafting \
            else None
        if own is None:
            self.block_drafter.begin_step(items)
        return self._merged(len(items), own, won)

    def _estimates(self, items: list[ScheduledSeq]) -> tuple[np.ndarray, np.ndarray]:
        """([S, K] each item's conditional acceptance of history drafts, [S] the model's expected
        accepted length over the item's draft limit), read once a step for both choices below."""
        seqs = [it.seq for it in items]
        limits = np.asarray([it.num_draft for it in items], dtype=np.int64)  # [S]
        model = slot_gains(self.acceptance[self.block_drafter.name].of(seqs), limits).sum(axis=1)  # [S]
        return self.acceptance[HISTORY].of(seqs), model

    def _history_may_win(self, items: list[ScheduledSeq], history: np.ndarray, model: np.ndarray) -> np.ndarray:
        """[S] whether the history could win each item: its expected accepted length at full confidence
        over the item's limit (an upper bound: the confidence only lowers it, a shorter continuation
        too) reaches the model's. history, model: `_estimates`'. Only those items' histories are
        matched and walked (`_history_wins` decides among them), so a batch whose history drafts
        stopped paying (temperature 1: ~10% accepted) no longer walks every sample's match each step:
        on the CPU machine at batch 128 that walk was ~3 ms a step, ~2.4 ms of it the suffix
        automaton's. A skipped sample's matcher catches up on the tokens it missed when it is next
        asked (HistoryDrafter._synced)."""
        limits = np.asarray([it.num_draft for it in items], dtype=np.int64)  # [S]
        return slot_gains(history, limits).sum(axis=1) >= model

    def _history_wins(self, items: list[ScheduledSeq], found: list[tuple[list[int], list[float]]],
                      history: np.ndarray, model: np.ndarray) -> np.ndarray:
        """[S] whether the history's expected accepted length is at least the model's (module
        docstring); history, model: `_estimates`' rows of these items."""
        lengths = np.asarray([len(tokens) for tokens, _ in found], dtype=np.int64)  # [S]
        confidence = np.zeros((len(items), self.num_spec))  # [S, K]
        for j, (_, c) in enumerate(found):
            confidence[j, :len(c)] = c
        expected_history = slot_gains(np.minimum(history, confidence), lengths).sum(axis=1)  # [S]
        return (lengths > 0) & (expected_history >= model)

    def _merged(self, num_items: int, own: Drafts | None, won: dict[int, list[int]]) -> Drafts:
        """The model's drafts (`own`, None: it drafted for no item) and the history's (`won`: item ->
        drafts) as one set in item order, with each item's proposer."""
        name = self.block_drafter.name
        if not won:
            return dataclasses.replace(own, proposers=[name] * num_items)
        num_own = 0 if own is None else int(own.tokens.shape[0])
        per_item = [0] * num_items if own is None else list(own.num_per_item)
        proposers, source, one_hot, flat = [name] * num_items, [], [], []
        taken = 0  # the model's drafts placed so far
        for i in range(num_items):
            if i in won:
                per_item[i], proposers[i] = len(won[i]), HISTORY
                source += range(num_own + len(flat), num_own + len(flat) + len(won[i]))
                one_hot += [True] * len(won[i])
                flat += won[i]
            else:
                source += range(taken, taken + per_item[i])
                one_hot += [False] * per_item[i]
                taken += per_item[i]
        history = self.history.drafts_of(flat, [len(won.get(i, ())) for i in range(num_items)])
        index = upload(source, torch.int64, history.tokens.device)  # [D] rows of [own; history]
        tokens = history.tokens if own is None else torch.cat([own.tokens, history.tokens])[index]  # [D]
        q = None
        if own is not None and own.q is not None and num_own:
            rows = index.clamp(max=num_own - 1)  # a history row reads any model row: one-hot, z unread
            marks = upload(one_hot, torch.bool, index.device)  # [D]
            q = Proposal(own.q.z[rows], own.q.lse[rows], own.q.one_hot[rows] | marks, tokens)
        return Drafts(tokens, per_item, q, proposers)

    def verified(self, items: list[ScheduledSeq], drafts: Drafts, accepted: list[int]) -> None:
        """Each proposer's estimates learn from the drafts it proposed; the model's refresh from the
        committed tokens."""
        self.block_drafter.verified(items, drafts, accepted)
        drafted = np.flatnonzero(drafts.num_per_item).tolist()  # the items that verified drafts
        for name, estimates in self.acceptance.items():
            mine = [i for i in drafted if drafts.proposers[i] == name]
            if mine:
                estimates.observe([items[i].seq for i in mine],
                                  np.asarray([drafts.num_per_item[i] for i in mine], dtype=np.int64),
                                  np.asarray([accepted[i] for i in mine], dtype=np.int64))
