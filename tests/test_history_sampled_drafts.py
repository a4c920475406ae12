"""History drafts of sampled requests follow the exact law (docs/verification.md), with the
Contract-1 joint-law harness of tests/test_spec_sampled_drafts.py: the embedded target at
temperature 1, top-k 4, 1,500 samples of one prompt to four tokens, block size 3 (two drafts:
the second and third tokens).

A first rollout (seed 3) fills the prompt's history; the next ones (other seeds) are drafted from
it: a one-hot q at the continuation most stored samples agree on, kept with probability p(d). The
joint law of their first three tokens must equal the exact law (chi-square, fixed seeds).

Negative controls, which must fail by at least twice the critical value: the drafter reporting a
uniform q for its deterministic drafts (a drafter that lies about q), and the acceptance test of
one-hot drafts ignoring p (a draft kept whenever the policy allows it at all).

The same with `--spec dflash+history` (rollout.spec.combined): the embedded DFlash drafter's sampled
drafts (their q a softmax) and the history's (one-hot) verified in the same steps, with the
proposers chosen by their estimates (DFlash, ~70% accepted here, wins nearly all samples: the
stored samples agree little) and, to mix them evenly, by sample parity; negative control:
the merged q losing the history rows' one-hot marks (they would read a DFlash row's q).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np
import pytest
import torch
from test_spec_sampled_drafts import NUM_SAMPLES, PARAMS, PROMPT_IDS, _chi2, exact_joint_law

import rollout.engine.verify as verify_mod
from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.sampler import PURPOSE_ACCEPT
from rollout.engine.verify import Proposal
from rollout.spec.combined import CombinedDrafter
from rollout.spec.history_drafter import HistoryDrafter

BLOCK = 3


@pytest.fixture(scope="module")
def exact_joint() -> dict[tuple[int, int, int], float]:
    return exact_joint_law()


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    # full draft blocks: the law of verified drafts is tested here, not when a budget verifies them
    # (an adaptive budget, priced from wall times, may verify none of a 4-token rollout's drafts)
    eng = build_engine(EngineConfig(spec="history", spec_block_size=BLOCK, block_size=4,
                                    num_kv_blocks=3 * NUM_SAMPLES, max_num_seqs=NUM_SAMPLES,
                                    max_num_batched_tokens=BLOCK * NUM_SAMPLES, spec_adaptive=False))
    _run(eng, seed=3)  # the history the later rollouts draft from
    return eng


def _run(engine: LLMEngine, seed: int, proposer: str = "history"):
    """The first three tokens of every sample of one rollout, and the fraction of `proposer`'s drafts
    accepted."""
    counts = engine.draft_counts.by_key.get((proposer, 0), (0, 0))
    engine.add_request(f"r{seed}", [PROMPT_IDS], dataclasses.replace(PARAMS, seed=seed), n=NUM_SAMPLES)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    engine.drafter.flush()  # the finished samples stored (a worker thread stores them)
    proposed, accepted = (a - b for a, b in zip(engine.draft_counts.by_key.get((proposer, 0), (0, 0)), counts))
    return Counter(tuple(o.token_ids[:3]) for o in outs), accepted / max(proposed, 1)


def test_history_drafts_of_sampled_requests_follow_the_exact_law(engine, exact_joint):
    counts, acceptance = _run(engine, seed=5)
    assert acceptance > 0.6, f"only {acceptance:.0%} of the history drafts were accepted"
    stat, crit = _chi2(counts, exact_joint)
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f}"


def _uniform_q(monkeypatch):
    real = HistoryDrafter.propose

    def propose(self, items, block_table):
        drafts = real(self, items, block_table)
        z = torch.zeros(len(drafts.tokens), 264)  # [D, V]: q reported as uniform
        drafts.q = Proposal(z, torch.full((len(drafts.tokens),), math.log(264)),
                            torch.zeros(len(drafts.tokens), dtype=torch.bool), drafts.tokens)
        return drafts

    monkeypatch.setattr(HistoryDrafter, "propose", propose)


def _acceptance_ignores_p(monkeypatch):
    real = verify_mod.uniform_of_keys
    monkeypatch.setattr(verify_mod, "uniform_of_keys",
                        lambda keys, purpose: real(keys, purpose) * (purpose != PURPOSE_ACCEPT))


@pytest.mark.parametrize("mutation, seed", [(_uniform_q, 6), (_acceptance_ignores_p, 7)],
                         ids=["uniform-q-reported", "one-hot-acceptance-ignores-p"])
def test_wrong_history_verification_fails_the_law(engine, exact_joint, mutation, seed, monkeypatch):
    mutation(monkeypatch)
    stat, crit = _chi2(_run(engine, seed)[0], exact_joint)
    assert stat > 2 * crit, f"the mutation passes: chi2 {stat:.1f}, critical value {crit:.1f}"


@pytest.fixture(scope="module")
def combined() -> LLMEngine:
    eng = build_engine(EngineConfig(spec="dflash+history", spec_block_size=BLOCK, block_size=4,
                                    num_kv_blocks=3 * NUM_SAMPLES, max_num_seqs=NUM_SAMPLES,
                                    max_num_batched_tokens=BLOCK * NUM_SAMPLES, spec_adaptive=False))
    _run(eng, seed=3)
    return eng


def _by_parity(monkeypatch):
    """The history drafts for even sample ids wherever it has a continuation, DFlash for the rest."""
    monkeypatch.setattr(CombinedDrafter, "_history_may_win", lambda self, items, *estimates: np.ones(len(items), bool))
    monkeypatch.setattr(CombinedDrafter, "_history_wins", lambda self, items, found, *estimates: np.asarray(
        [bool(tokens) and it.seq.seq_id % 2 == 0 for it, (tokens, _) in zip(items, found)]))


def _one_hot_marks_lost(monkeypatch):
    _by_parity(monkeypatch)
    real = CombinedDrafter._merged

    def merged(self, num_items, own, won):
        drafts = real(self, num_items, own, won)
        if drafts.q is not None:
            q = drafts.q
            drafts.q = Proposal(q.z, q.lse, torch.zeros_like(q.one_hot), q.tokens)
        return drafts

    monkeypatch.setattr(CombinedDrafter, "_merged", merged)


def _share(engine: LLMEngine, before: dict) -> dict[str, int]:
    return {name: engine.draft_counts.by_key.get((name, 0), (0, 0))[0] - before.get((name, 0), (0, 0))[0]
            for name in ("history", engine.drafter.block_drafter.name)}


@pytest.mark.parametrize("choice, seed", [(None, 5), (_by_parity, 6)], ids=["estimated", "by-parity"])
def test_combined_drafts_of_sampled_requests_follow_the_exact_law(combined, exact_joint, choice, seed,
                                                                   monkeypatch):
    if choice is not None:
        choice(monkeypatch)
    before = dict(combined.draft_counts.by_key)
    counts, _ = _run(combined, seed)
    proposed = _share(combined, before)
    if choice is not None:  # (by their estimates, DFlash wins nearly every sample here)
        assert min(proposed.values()) > 0.2 * sum(proposed.values()), proposed  # both drafted, evenly
    stat, crit = _chi2(counts, exact_joint)
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f}"


def test_combined_drafts_losing_their_one_hot_marks_fail_the_law(combined, exact_joint, monkeypatch):
    """The lost marks make a history row read another DFlash row of the same prompt as its q, close to
    the target's law, so this mutation moves the statistic less than the ones above: 1.6-2.3 times
    the critical value over seeds 8-10; 1.5 times is asked."""
    _one_hot_marks_lost(monkeypatch)
    stat, crit = _chi2(_run(combined, 10)[0], exact_joint)
    assert stat > 1.5 * crit, f"the mutation passes: chi2 {stat:.1f}, critical value {crit:.1f}"
