"""Adaptive draft budgets through the real engine (issue 19), Contract 2 untouched: greedy outputs of
the embedded target with its embedded DFlash and DSpark drafters equal plain decoding whatever the
budget, chosen adaptively under a synthetic cost that mixes no drafts, partial and ragged blocks, or
forced at random per sample and step through the scheduler's hook; with drafts off the drafter's
forward is skipped while its context keeps up (acceptance right after drafts resume is that of full
blocks); `--spec-adaptive` is the default and `--no-spec-adaptive` keeps full blocks.
The statistical test under a varying budget is in test_spec_sampled_drafts.py."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from spec_helpers import cost_table

from rollout import build_engine
from rollout.cli import build_parser, engine_factory
from rollout.engine import spec_budget
from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.params import SamplingParams

CODE = [list(b"def main(args):\n    "), list(b"    for i in range(len(x")]  # the drafters follow well
NOISE = [[random.Random(i).randrange(256) for _ in range(12)] for i in range(2)]  # they do not
PROMPTS = CODE + NOISE
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
BLOCK = 6
K = BLOCK - 1


def _engine(spec: str, adaptive: bool = True, cost=None) -> LLMEngine:
    return build_engine(EngineConfig(spec=spec, spec_block_size=BLOCK if spec != "none" else None, num_kv_blocks=200,
                                     block_size=4, spec_adaptive=adaptive), step_cost=cost)


def _run(eng: LLMEngine, prompts=PROMPTS, on_step=None) -> list:
    eng.add_request("r", prompts, GREEDY)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
        if on_step is not None:
            on_step(eng)
    assert eng.kv_blocks()[0] == eng.kv_blocks()[1]
    return sorted(outs, key=lambda o: o.prompt_index)


def _record_caps(eng: LLMEngine) -> list[list[int]]:
    """Every step's chosen drafts per decode sample (wraps the budget's hook)."""
    chosen, caps = [], eng.spec_budget.caps

    def recording(running, budget, waiting_tokens=0, states=None):
        out = caps(running, budget, waiting_tokens, states)
        chosen.append([min(out.get(s, 0), s.remaining_tokens - 1) for s in running
                       if s.num_tokens - s.num_computed_tokens <= 1])  # (the scheduler's limit applied)
        return out

    eng.spec_budget.caps = recording
    return chosen


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return [o.token_ids for o in _run(_engine("none"))]


@pytest.mark.parametrize("spec", ["dflash", "dspark"])
def test_greedy_outputs_equal_plain_decoding_under_an_adaptive_budget(spec, plain):
    """A cost where a draft token costs a fifth of a decode step: blocks of fewer drafts than K, and
    steps whose samples verify different numbers of drafts (the better-accepted ones more)."""
    eng = _engine(spec, cost=cost_table(decode_ms=10.0, token_ms=2.0, drafter_ms=2.0, q=BLOCK))
    chosen = _record_caps(eng)
    outs = _run(eng)
    assert [o.token_ids for o in outs] == plain
    assert all(sum(o.accept_lengths) == len(o.token_ids) for o in outs)
    steps = [c for c in chosen if len(c) == len(PROMPTS)]
    assert any(len(set(c)) > 1 for c in steps), "no ragged step"
    assert any(0 < k < K for c in steps for k in c), "no partial block"
    code = [a for o in outs[:2] for a in o.accept_lengths[1:]]
    assert max(code) > 2  # the code prompts' drafts were verified and accepted


@pytest.mark.parametrize("spec", ["dflash", "dspark"])
def test_greedy_outputs_equal_plain_decoding_under_random_budgets(spec, plain):
    """Each step, each sample a random number of drafts in [0, K] through the scheduler's hook."""
    eng = _engine(spec, cost=cost_table(q=BLOCK))
    rng = random.Random(0)
    eng.spec_budget.caps = lambda running, admits, budget, waiting=0: {s: rng.randint(0, K) for s in running}
    outs = _run(eng)
    assert [o.token_ids for o in outs] == plain
    steps = Counter(a for o in outs for a in o.accept_lengths[1:])
    assert steps[1] > 0 and len(steps) >= 4  # 0-draft rows, rejections and accepted blocks of several lengths


def test_drafts_off_skip_the_drafter_and_its_context_keeps_up(plain, monkeypatch):
    """Verifying is priced out for the first 15 steps: no drafts, no drafter forward, not even a probe;
    yet the drafter's context cache holds every token computed meanwhile (the target forward writes
    it). Then verifying is free: drafts resume at once and are accepted. (REUSE_STEPS 0: the swapped
    cost is seen at once, not when the choice of no drafts expires.)"""
    monkeypatch.setattr(spec_budget, "REUSE_STEPS", 0)
    eng = _engine("dflash", cost=cost_table(decode_ms=1.0, token_ms=100.0, drafter_ms=100.0, q=BLOCK))
    proposals = []

    def switch(e: LLMEngine):
        proposals.append(e.drafter.num_proposals)
        if len(proposals) == 15:
            k_cache = e.drafter.caches[0][0].flatten(0, 1)  # [slots, Hkv, D], zero where never written
            for seq in e.scheduler.running:
                pos = range(seq.num_computed_tokens)
                slots = [seq.block_table[p // 4] * 4 + p % 4 for p in pos]
                assert len(slots) > 15 and (k_cache[slots].abs().sum(dim=(1, 2)) > 0).all()
            e.spec_budget.cost = cost_table(decode_ms=10.0, token_ms=0.0, drafter_ms=0.0, q=BLOCK)

    outs = _run(eng, CODE, switch)
    assert [o.token_ids for o in outs] == plain[:2]
    assert proposals[14] == 0 and eng.spec_budget.totals["probes"] == 0
    resumed = [a for o in outs for a in o.accept_lengths[15:18]]
    assert sum(resumed) > 2 * len(resumed), resumed


def test_spec_adaptive_is_the_default_and_the_flag_turns_it_off():
    parser = build_parser()
    on = engine_factory(parser.parse_args(["serve", "--spec", "dflash"])).args[0]
    off = engine_factory(parser.parse_args(["serve", "--spec", "dflash", "--no-spec-adaptive"])).args[0]
    assert on.spec_adaptive and not off.spec_adaptive
    assert _engine("dflash", adaptive=False).spec_budget is None and _engine("none").spec_budget is None


def test_drafts_are_counted_once_by_the_engine_and_the_budget_reads_that_count():
    """The engine's DraftCounts is the one count of drafts proposed and accepted: the budget's summary
    reads its drafts per decode row from it (since the last summary), keeping no count of its own."""
    eng = _engine("dflash", cost=cost_table(decode_ms=10.0, token_ms=2.0, drafter_ms=2.0, q=BLOCK))
    _run(eng, prompts=CODE)
    proposed, accepted = eng.draft_counts.total()
    assert proposed > 0 and accepted > 0 and not {"drafts", "accepted"} & set(eng.spec_budget.totals)
    summary = eng.spec_budget_summary()
    assert summary["drafts_per_row"] == round(proposed / summary["decode_rows"], 3)
    assert summary["accepted_per_verify"] > 0
    assert eng.spec_budget_summary()["drafts_per_row"] == 0  # nothing proposed since

