"""`--spec dflash+history` / `dspark+history` through the real engine (rollout.spec.combined):
greedy outputs and masks equal plain decoding token for token on revisited prompts (with
preemption), both proposers drafting and counted apart by proposer; the per-request choice follows
acceptance: a request whose history drafts are accepted keeps getting history drafts, one whose
history drafts are rejected gets the model's."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from spec_helpers import RepeatDrafter, budget_seq

from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.params import SamplingParams
from rollout.engine.scheduler import ScheduledSeq
from rollout.spec.combined import CombinedDrafter
from rollout.spec.history import prompt_key
from rollout.spec.history_drafter import HistoryDrafter
from rollout.spec.history_store import HistoryStore

PROMPTS = [[5, 6, 7], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110], [42], [1, 2, 3, 4, 5, 6],
           [200, 201], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13, 14, 15, 16, 17]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)


def _engine(model, spec="none", draft=None, num_kv_blocks=400):
    """Full draft blocks (the choice between proposers is tested, not the budget's)."""
    return build_engine(EngineConfig(model=str(model), spec=spec, draft=draft, block_size=4,
                                     num_kv_blocks=num_kv_blocks, max_num_batched_tokens=48, spec_adaptive=False))


def _run(eng, requests: dict[str, list[list[int]]], params=GREEDY, n=1, mask=None):
    for request_id, prompts in requests.items():
        eng.add_request(request_id, prompts, params, n=n, mask=mask)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert eng.kv_blocks()[0] == eng.kv_blocks()[1]
    if eng.drafter is not None:
        eng.drafter.flush()
    return sorted(outs, key=lambda o: (o.request_id, o.prompt_index, o.sample_index))


def _seen(outs):
    return [(o.token_ids, o.support_ids, o.support_logprobs) for o in outs]


@pytest.mark.parametrize("kind,num_kv_blocks", [("dflash", 400), ("dspark", 400), ("dflash", 16)],
                         ids=["dflash", "dspark", "dflash-preempting"])
def test_greedy_combined_equals_plain_decoding(tiny_random_qwen3, random_drafters, kind, num_kv_blocks):
    plain = _seen(_run(_engine(tiny_random_qwen3), {"r": PROMPTS}, n=2, mask="support"))
    eng = _engine(tiny_random_qwen3, f"{kind}+history", random_drafters[kind], num_kv_blocks)
    assert isinstance(eng.drafter, CombinedDrafter) and eng.info()["spec_block_size"] == 4
    for _ in range(3):  # epochs: from the second on, the history drafts too
        outs = _run(eng, {"r": PROMPTS}, n=2, mask="support")
        assert _seen(outs) == plain
        assert all(sum(o.accept_lengths) == len(o.token_ids) for o in outs)
    counts = eng.draft_counts.by_key
    model = eng.drafter.block_drafter.name
    assert set(counts) == {(model, 0), ("history", 0)}  # counted apart, per proposer
    assert counts[("history", 0)][1] > 0.5 * counts[("history", 0)][0] > 0 and counts[(model, 0)][0] > 0
    if num_kv_blocks == 16:
        assert eng.scheduler.num_preemptions > 0
    assert eng.drafter.history.matchers == {}


def _proposers_by_request(monkeypatch) -> Counter:
    """(request id, proposer) -> the steps in which that proposer drafted for the request."""
    seen, real = Counter(), CombinedDrafter.propose

    def propose(self, items, block_table):
        drafts = real(self, items, block_table)
        for item, count, name in zip(items, drafts.num_per_item, drafts.proposers):
            if count:
                seen[(item.seq.request_id, name)] += 1
        return drafts

    monkeypatch.setattr(CombinedDrafter, "propose", propose)
    return seen


def _repeat_and_history(config, target) -> CombinedDrafter:
    """The history beside a model stand-in whose drafts repeat the last token: accepted often where
    the tiny target repeats itself, rarely where it does not."""
    repeat = RepeatDrafter(4)
    repeat.name = "repeat"
    return CombinedDrafter(repeat, HistoryDrafter(HistoryStore(config.spec_history_tokens), 4))


def test_the_choice_follows_each_requests_acceptance(tiny_random_qwen3, monkeypatch):
    """`good`'s prompt (an output that seldom repeats a token) has its own greedy sample stored: its
    history drafts are accepted, repeats would not be. `bad`'s (an output of long runs) has a planted
    sample in which every token is followed by one its output never holds: the history always matches
    and proposes, with full confidence, drafts that are rejected, while repeats are accepted."""
    good, bad = PROMPTS[4], PROMPTS[3]
    plain = {o.prompt_index: o.token_ids for o in _run(_engine(tiny_random_qwen3), {"r": [good, bad]})}
    wrong = next(t for t in range(264) if t not in plain[1])
    eng = build_engine(EngineConfig(model=str(tiny_random_qwen3), block_size=4, num_kv_blocks=400,
                                    max_num_batched_tokens=48, spec_adaptive=False),
                       drafter_factory=_repeat_and_history)
    eng.drafter.history.store.add(prompt_key(good), 1 << 40, plain[0], 0)
    eng.drafter.history.store.add(prompt_key(bad), 1 << 40, [x for t in range(264) for x in (t, wrong)], 0)
    eng.drafter.flush()
    seen = _proposers_by_request(monkeypatch)
    outs = _run(eng, {"good": [good], "bad": [bad]})
    assert [o.token_ids for o in outs] == [plain[1], plain[0]]  # (sorted: "bad" first)
    assert seen[("good", "history")] >= 3 and seen[("good", "repeat")] == 0
    assert seen[("bad", "history")] <= 2 and seen[("bad", "repeat")] >= 3
    counts = eng.draft_counts.by_key
    assert counts[("history", 0)][1] > 0 and counts[("repeat", 0)][1] > 0


def test_the_history_is_walked_only_where_it_could_win(tiny_random_qwen3):
    """`_history_may_win` (its expected length at full confidence against the model's) never drops an
    item the history would win (random estimates, continuations and confidences), and items it drops
    are not matched: their matchers do not move until they are asked again."""
    config = EngineConfig(model=str(tiny_random_qwen3), block_size=4)
    drafter = _repeat_and_history(config, None)
    rng = np.random.default_rng(0)
    seqs = [budget_seq(i) for i in range(64)]
    for estimates in drafter.acceptance.values():
        tried = rng.integers(1, 4, size=64 * 4)
        estimates.observe([s for s in seqs for _ in range(4)], tried, rng.integers(0, tried + 1))
    dropped = 0
    for _ in range(50):
        items = [ScheduledSeq(s, 1, int(rng.integers(1, drafter.num_spec + 1))) for s in seqs]
        found = []
        for it in items:
            n = int(rng.integers(0, it.num_draft + 1))
            found.append((list(range(n)), rng.uniform(0.2, 1.0, size=n).tolist()))
        estimates = drafter._estimates(items)
        may, wins = drafter._history_may_win(items, *estimates), drafter._history_wins(items, found, *estimates)
        assert not (wins & ~may).any()
        dropped += int((~may).sum())
    assert 0 < dropped < 50 * 64  # the bound bites for some items, not all
    walked = []
    drafter.history.draft = lambda seq, limit: walked.append(seq) or ([], [])
    low = drafter.acceptance["history"]
    low.observe(seqs * 8, np.full(64 * 8, drafter.num_spec), np.zeros(64 * 8, dtype=np.int64))  # all rejected
    items = [ScheduledSeq(s, 1, drafter.num_spec) for s in seqs]
    drafter.block_drafter.propose = lambda items, table: None
    drafter._merged = lambda n, own, won: won
    assert drafter.propose(items, np.zeros((64, 1), dtype=np.int32)) == {} and walked == []
