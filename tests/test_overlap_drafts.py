"""Drafted steps under overlapped scheduling (rollout/engine/overlap.py): step n+1 is scheduled,
drafted and launched before a drafted step n syncs. Its pending tokens are n's last committed ones,
and its positions move by the drafts n accepted, both on the device. The samples match the
synchronous loop's (`overlap=False`): greedy and seeded, with masks, stop ids, min_tokens, for
DFlash, DSpark and a device-anchored repeat drafter (often accepted by the tiny random model, so
shifts happen). The same holds under preemption, aborts and a weight update. A sample whose next
step depends on how many drafts n accepts (near its end, a min_tokens) sits n+1 out; penalties and
drafters that need host anchors make n+1 wait for the sync, each counted by its reason."""

from __future__ import annotations

import time

import pytest
from overlap_helpers import PROMPTS, SAMPLED, assert_same, overlap_engine, run_steps
from spec_helpers import DeviceRepeatDrafter, factory_of

from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.params import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _drafting_engine(model, drafters, spec: str, overlap: bool, **kw):
    """An engine verifying full blocks (no adaptive budget, so both loops draft alike) with `spec`:
    dflash / dspark (block 4) or repeat (DeviceRepeatDrafter, block 4)."""
    if spec == "repeat":
        cfg = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=64, max_num_seqs=32)
        cfg.update(kw)
        config = EngineConfig(model=str(model), overlap=overlap, spec_adaptive=False, **cfg)
        return build_engine(config, drafter_factory=factory_of(DeviceRepeatDrafter(4)))
    return overlap_engine(model, overlap, spec=spec, draft=drafters[spec], spec_adaptive=False, **kw)


def _workload(eng) -> None:
    eng.add_request("s", [PROMPTS[0], PROMPTS[2]], SamplingParams(max_tokens=40, seed=5, **SAMPLED), n=2)
    eng.add_request("g", [PROMPTS[1]], SamplingParams(max_tokens=36, **GREEDY), mask="support")
    eng.add_request("sel", [PROMPTS[3]], SamplingParams(max_tokens=30, seed=6, **SAMPLED), mask="selected")
    eng.add_request("stop", [PROMPTS[3]], SamplingParams(max_tokens=40, seed=2, temperature=1.0,
                                                         stop_token_ids=[7, 9, 11, 120]), n=2)
    eng.add_request("min", [PROMPTS[0]], SamplingParams(max_tokens=30, min_tokens=14, stop_token_ids=[120],
                                                        temperature=0.0))


@pytest.mark.parametrize("spec", ["dflash", "dspark", "repeat"])
def test_drafted_steps_overlap_and_give_the_synchronous_samples(tiny_random_qwen3, random_drafters, spec):
    runs = {}
    for overlap in (False, True):
        eng = _drafting_engine(tiny_random_qwen3, random_drafters, spec, overlap)
        _workload(eng)
        runs[overlap] = run_steps(eng), eng
    (want, _), (got, eng) = runs[False], runs[True]
    assert_same(got, want)
    assert all(got[key].accept_lengths == w.accept_lengths for key, w in want.items())  # the same drafts verified
    pipe = eng.pipeline
    assert pipe.overlapped_drafts >= 20 and not pipe.sync_steps["drafts"] and not pipe.sync_steps["drafts next"]
    assert eng.pipeline.idle and eng.kv_blocks()[0] == eng.kv_blocks()[1]
    proposed, accepted = eng.draft_counts.total()
    assert proposed > 100
    if spec == "repeat":  # accepted drafts move the next step's positions (the shift path ran)
        assert accepted > 30 and max(max(o.accept_lengths) for o in got.values()) >= 3


@pytest.mark.parametrize("spec", ["dflash", "repeat"])
def test_drafted_overlap_under_preemption(tiny_random_qwen3, random_drafters, spec):
    """A small KV pool preempts samples whose drafted step is in flight (they wait for its commit,
    then recompute). Greedy samples, whose tokens do not depend on which steps drafted (a preempted
    sample's recompute samples without drafts, so seeded ones draw differently wherever the two loops
    preempt differently, exactly in both), are the synchronous loop's."""
    runs = {}
    for overlap in (False, True):
        eng = _drafting_engine(tiny_random_qwen3, random_drafters, spec, overlap, num_kv_blocks=22)
        eng.add_request("g", [PROMPTS[0], PROMPTS[2]], SamplingParams(max_tokens=40, **GREEDY), n=2)
        eng.add_request("m", [PROMPTS[1], PROMPTS[3]], SamplingParams(max_tokens=36, **GREEDY), n=2, mask="support")
        eng.add_request("stop", [PROMPTS[3]], SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[120]))
        runs[overlap] = run_steps(eng), eng
        assert eng.scheduler.num_preemptions > 5
    (want, _), (got, eng) = runs[False], runs[True]
    assert_same(got, want)
    assert eng.pipeline.overlapped_drafts >= 20 and eng.kv_blocks()[0] == eng.kv_blocks()[1]


def test_drafted_overlap_with_an_abort_and_a_weight_update(tiny_random_qwen3, random_drafters):
    """An abort lands between steps and a weight update drains the pipeline (the samples under way
    finish on the old weights, a late request runs on the new): the samples are the synchronous loop's."""
    def between(eng, i):
        if i == 5:
            return eng.abort("sel")
        if i == 8:
            w = eng.model.layers[0].mlp.down_proj.weight
            eng.update_weights({"model.layers.0.mlp.down_proj.weight": w.detach().clone() + 0.5})
            eng.add_request("late", [PROMPTS[2]], SamplingParams(max_tokens=24, seed=3, **SAMPLED))

    runs = {}
    for overlap in (False, True):
        eng = _drafting_engine(tiny_random_qwen3, random_drafters, "repeat", overlap)
        _workload(eng)
        runs[overlap] = run_steps(eng, between), eng
    (want, _), (got, eng) = runs[False], runs[True]
    assert_same(got, want)
    assert want[("sel", 0, 0)].finish_reason == "abort" and want[("late", 0, 0)].policy_version == 1
    assert eng.pipeline.overlapped_drafts >= 10 and eng.pipeline.sync_steps["weight update"] > 0
    assert eng.kv_blocks()[0] == eng.kv_blocks()[1]


def test_a_confidence_cut_waits_for_the_sync(tiny_random_qwen3, random_drafters):
    """DSpark with a confidence threshold reads its block lengths back: its drafted steps are followed
    synchronously ("drafts") and its steps with drafts are held ("drafts next"), as before."""
    runs = {}
    for overlap in (False, True):
        eng = _drafting_engine(tiny_random_qwen3, random_drafters, "dspark", overlap, spec_confidence_threshold=1e-9)
        _workload(eng)
        runs[overlap] = run_steps(eng), eng
    (want, _), (got, eng) = runs[False], runs[True]
    assert_same(got, want)
    assert eng.pipeline.sync_steps["drafts"] > 10 and not eng.pipeline.overlapped_drafts


class _EveryOther:
    """A draft budget that verifies full blocks for samples of even length and none for the others:
    drafted and plain steps mix."""

    def caps(self, running, token_budget, waiting_tokens=0, states=None):
        return {s: 8 for s in running if s.num_tokens % 2 == 0}


def test_a_steps_launch_time_is_billed_to_that_step(tiny_random_qwen3, monkeypatch):
    """Under overlap the call that syncs step n launches n+1 first: the draft budget's cost model
    must see a drafted step's launch (its proposal, made slow here by a clock that jumps 1 s in
    every proposal with drafts) in that step's time, not in the plain step before it."""
    skew, real = [0.0], time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real() + skew[0])
    config = EngineConfig(model=str(tiny_random_qwen3), block_size=4, num_kv_blocks=256, max_num_batched_tokens=64,
                          max_num_seqs=32)
    drafter = DeviceRepeatDrafter(4)
    propose = drafter.propose

    def slow_propose(items, block_table, pending=None):
        skew[0] += 1.0 if any(it.num_draft for it in items) else 0.0
        return propose(items, block_table, pending)

    drafter.propose = slow_propose
    eng = build_engine(config, drafter_factory=factory_of(drafter))
    eng.scheduler.draft_budget = _EveryOther()
    recorded, record = [], eng.spec_budget.record
    eng.spec_budget.record = lambda step, acc, seconds, graphed, choice: (
        recorded.append((any(step.rows.num_draft), seconds)), record(step, acc, seconds, graphed, choice))
    eng.add_request("s", [PROMPTS[0], PROMPTS[2]], SamplingParams(max_tokens=30, seed=5, **SAMPLED), n=2)
    run_steps(eng)
    drafted = [s for d, s in recorded if d]
    plain = [s for d, s in recorded if not d]
    assert eng.pipeline.overlapped > 10 and len(drafted) > 5 and len(plain) > 5
    assert min(drafted) >= 1.0 and max(plain) < 1.0, (drafted, plain)
