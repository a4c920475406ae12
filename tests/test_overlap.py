"""Overlapped scheduling (rollout/engine/overlap.py): the same samples as the synchronous loop
(`overlap=False`, the reference) for greedy and seeded sampling, masks in both modes, stop ids and
strings, min_tokens, max_tokens, n > 1 with shared prefixes, aborts between steps, preemption under a
small KV pool and a weight update between steps; the cases that need step n's committed tokens to
build step n+1 (grammar, a draining weight update, drafts of a drafter without device anchors) run
synchronously, each counted by its reason, while a drafter's steps without drafts overlap (with
budgets that draft in some steps, in none, and a weight update among them; a refreshing drafter's
buffer holds what the synchronous loop's does). Drafted steps that overlap: tests/test_overlap_drafts.py.
tests/test_host_syncs.py checks that step n+1 launches before step n's sync without any host read."""

from __future__ import annotations

import argparse

import pytest
import torch
from overlap_helpers import PROMPTS, SAMPLED, assert_same, overlap_engine, run_steps
from spec_helpers import RepeatDrafter, factory_of

from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.grammar import GrammarSpec
from rollout.engine.params import SamplingParams
from rollout.options import add_options, from_options


@pytest.fixture(scope="module")
def greedy_ref(tiny_random_qwen3):
    eng = overlap_engine(tiny_random_qwen3, overlap=False)
    eng.add_request("r", [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    out = run_steps(eng)[("r", 0, 0)]
    return out.token_ids, eng.decode(out.token_ids)


def _workload(eng, greedy_ref) -> None:
    ref, text = greedy_ref
    greedy = dict(temperature=0.0, ignore_eos=True)
    eng.add_request("greedy", PROMPTS[:2], SamplingParams(max_tokens=10, **greedy))
    eng.add_request("seeded", [PROMPTS[2]], SamplingParams(max_tokens=12, seed=7, **SAMPLED), n=3)
    eng.add_request("shared", [PROMPTS[2], PROMPTS[3]], SamplingParams(max_tokens=9, seed=8, **SAMPLED), n=2)
    eng.add_request("selected", [PROMPTS[1]], SamplingParams(max_tokens=8, seed=9, **SAMPLED), mask="selected")
    eng.add_request("support", [PROMPTS[3]], SamplingParams(max_tokens=8, seed=10, **SAMPLED), n=2, mask="support")
    eng.add_request("greedy-mask", [PROMPTS[0]], SamplingParams(max_tokens=7, **greedy), mask="support")
    eng.add_request("stop-id", [PROMPTS[0]], SamplingParams(max_tokens=12, stop_token_ids=[ref[3]], **greedy))
    eng.add_request("min-tokens", [PROMPTS[0]], SamplingParams(max_tokens=12, min_tokens=6,
                                                                stop_token_ids=[ref[1]], **greedy), mask="support")
    eng.add_request("stop-str", [PROMPTS[0]], SamplingParams(max_tokens=12, stop=[text[4:6]], **greedy),
                    return_text=True)
    eng.add_request("one", [PROMPTS[1], PROMPTS[2]], SamplingParams(max_tokens=1, seed=11, **SAMPLED), n=2)
    eng.add_request("eos", [PROMPTS[3]], SamplingParams(max_tokens=30, seed=12, temperature=1.0), n=3)


def test_overlap_gives_the_synchronous_samples(tiny_random_qwen3, greedy_ref):
    runs = {}
    for overlap in (False, True):
        eng = overlap_engine(tiny_random_qwen3, overlap)
        _workload(eng, greedy_ref)
        runs[overlap] = run_steps(eng), eng
    (want, _), (got, eng) = runs[False], runs[True]
    assert_same(got, want)
    assert want[("stop-id", 0, 0)].finish_reason == "stop" and want[("stop-str", 0, 0)].stop_reason is not None
    assert len(want[("min-tokens", 0, 0)].token_ids) >= 6
    assert eng.pipeline.overlapped > 10 and not eng.pipeline.sync_steps  # nothing here falls back
    assert eng.kv_blocks()[0] == eng.kv_blocks()[1] and eng.pipeline.idle  # every block back, nothing in flight
    # the prefix cache holds the same prompt blocks: none holding a discarded slot's write
    assert set(eng.block_manager.hash_to_block) == set(runs[False][1].block_manager.hash_to_block)


def test_samples_reaching_the_context_limit(tiny_random_qwen3):
    """Samples that fill max_model_len: the discarded slot in the step in flight after the last token
    sits at the context's last position (its block is reserved like any other)."""
    runs = {}
    for overlap in (False, True):
        eng = overlap_engine(tiny_random_qwen3, overlap, max_model_len=24, num_kv_blocks=12)
        eng.add_request("a", [list(range(30, 50))], SamplingParams(max_tokens=4, seed=6, **SAMPLED), n=2)
        eng.add_request("b", [list(range(60, 77))], SamplingParams(max_tokens=7, seed=7, **SAMPLED), n=2)
        runs[overlap] = run_steps(eng)
    assert_same(runs[True], runs[False])
    assert {len(o.prompt_token_ids) + len(o.token_ids) for o in runs[True].values()} == {24}
    assert {o.finish_reason for o in runs[True].values()} == {"length"}


def test_a_finished_sample_keeps_a_discarded_slot_in_the_step_in_flight(tiny_random_qwen3):
    eng = overlap_engine(tiny_random_qwen3, overlap=True)
    sizes = []
    eng.model.register_forward_pre_hook(lambda _m, args: sizes.append(args[0].numel()))
    eng.add_request("a", [PROMPTS[0]], SamplingParams(max_tokens=1, seed=1, **SAMPLED))
    eng.add_request("b", [PROMPTS[1]], SamplingParams(max_tokens=4, seed=2, **SAMPLED))
    first = eng.step()  # commits step 1; step 2 is in flight with a's slot
    assert [o.request_id for o in first] == ["a"] and len(first[0].token_ids) == 1
    assert sizes == [7, 2]  # both prompts, then both anchors (a's discarded)
    assert [s.seq.request_id for s in eng.pipeline.inflight.plan] == ["a", "b"]
    outs = run_steps(eng)
    assert len(outs[("b", 0, 0)].token_ids) == 4 and sizes[2:] == [1, 1, 1]  # b alone; its last slot discarded


def test_preemption_under_a_small_kv_pool(tiny_random_qwen3, greedy_ref):
    want = None
    for overlap in (False, True):
        eng = overlap_engine(tiny_random_qwen3, overlap, num_kv_blocks=14)
        _workload(eng, greedy_ref)
        got = run_steps(eng)
        assert eng.scheduler.num_preemptions > 0
        want = want or got
    assert_same(got, want)
    assert eng.pipeline.overlapped > 10


def _abort_after(step: int, request_id: str):
    def between(eng, i):
        if i == step:
            assert request_id in {s.seq.request_id for s in eng.pipeline.inflight.plan} if eng.pipeline.inflight \
                else True
            return eng.abort(request_id)
    return between


def test_aborts_between_steps(tiny_random_qwen3, greedy_ref):
    runs = {}
    for overlap in (False, True):
        eng = overlap_engine(tiny_random_qwen3, overlap)
        _workload(eng, greedy_ref)
        runs[overlap] = run_steps(eng, _abort_after(4, "seeded")), eng
    (want, _), (got, eng) = runs[False], runs[True]
    assert_same(got, want)
    aborted = [want[("seeded", 0, s)] for s in range(3)]
    assert all(o.finish_reason == "abort" and 0 < len(o.token_ids) < 12 for o in aborted)
    assert eng.kv_blocks()[0] == eng.kv_blocks()[1]


def test_an_abort_leaves_no_step_behind(tiny_random_qwen3):
    eng = overlap_engine(tiny_random_qwen3, overlap=True)
    eng.add_request("a", [PROMPTS[0]], SamplingParams(max_tokens=20, seed=1, **SAMPLED))
    eng.step()
    eng.step()
    assert eng.pipeline.inflight is not None
    out = eng.abort("a")
    assert len(out[0].token_ids) == 2 and not eng.has_unfinished()
    eng.release_memory()  # the step left in flight held only the aborted sample's slot
    eng.resume_memory()
    eng.add_request("b", [PROMPTS[0]], SamplingParams(max_tokens=20, seed=1, **SAMPLED))
    assert run_steps(eng)[("b", 0, 0)].token_ids[:2] == out[0].token_ids


def test_an_abort_while_a_prefill_chunk_is_in_flight(tiny_random_qwen3):
    """The aborted prompt's chunk in flight still writes its (correct) KV; a later request with the
    same prompt reuses the blocks registered for it and draws what the synchronous loop draws."""
    long_prompt = list(range(100, 140))  # five chunks of 8
    params = SamplingParams(max_tokens=4, seed=1, **SAMPLED)
    ref = overlap_engine(tiny_random_qwen3, overlap=False)
    ref.add_request("again", [long_prompt], params)
    want = run_steps(ref)
    eng = overlap_engine(tiny_random_qwen3, overlap=True, max_num_batched_tokens=8)
    eng.add_request("long", [long_prompt], params)
    eng.add_request("other", [PROMPTS[1]], SamplingParams(max_tokens=6, seed=2, **SAMPLED))
    eng.step()
    assert any(it.seq.request_id == "long" and it.num_new_tokens > 1 for it in eng.pipeline.inflight.plan)
    assert eng.abort("long")[0].finish_reason == "abort"
    assert len(run_steps(eng)[("other", 0, 0)].token_ids) == 6 and eng.kv_blocks()[0] == eng.kv_blocks()[1]
    assert eng.block_manager.hash_to_block  # the aborted prompt's computed blocks
    eng.add_request("again", [long_prompt], params)
    assert_same(run_steps(eng), want)


def _update_at(step: int, late_tokens: int):
    """Between steps: at `step`, a weight update and a greedy request "late" of `late_tokens` tokens."""
    def between(eng, i):
        if i == step:
            w = eng.model.layers[0].mlp.down_proj.weight
            eng.update_weights({"model.layers.0.mlp.down_proj.weight": w.detach().clone() + 0.5})
            eng.add_request("late", [PROMPTS[0]], SamplingParams(max_tokens=late_tokens, temperature=0.0))
    return between


def test_a_weight_update_between_steps(tiny_random_qwen3, greedy_ref):
    runs = {}
    for overlap in (False, True):
        eng = overlap_engine(tiny_random_qwen3, overlap)
        _workload(eng, greedy_ref)
        runs[overlap] = run_steps(eng, _update_at(3, 6)), eng
    (want, _), (got, eng) = runs[False], runs[True]
    assert_same(got, want)
    assert want[("late", 0, 0)].policy_version == 1 and want[("greedy", 0, 0)].policy_version == 0
    assert eng.pipeline.sync_steps["weight update"] > 0 and eng.pipeline.overlapped > 5


def _plain_and(eng, add) -> dict:
    eng.add_request("plain", [PROMPTS[1]], SamplingParams(max_tokens=20, seed=3, **SAMPLED))
    add(eng)
    return run_steps(eng)


def test_grammar_samples_run_synchronously(tiny_random_qwen3):
    def grammar(eng):
        eng.add_request("g", [PROMPTS[0]], SamplingParams(max_tokens=10, seed=4, temperature=1.0, top_k=20),
                        grammar=GrammarSpec("regex", "[a-z]{4,8}"), mask="support")

    want = _plain_and(overlap_engine(tiny_random_qwen3, overlap=False), grammar)
    eng = overlap_engine(tiny_random_qwen3, overlap=True)
    assert_same(_plain_and(eng, grammar), want)
    assert eng.pipeline.sync_steps["grammar"] >= 4  # every step the grammar sample draws in
    assert eng.pipeline.overlapped >= 5  # "plain" alone overlaps again


def test_penalties_count_the_pending_token_on_the_device(tiny_random_qwen3):
    def penalised(eng):
        params = dict(repetition_penalty=1.5, frequency_penalty=0.8, presence_penalty=0.5, max_tokens=16)
        eng.add_request("p", [PROMPTS[0]], SamplingParams(seed=4, **params, **SAMPLED), n=2)
        eng.add_request("pg", [[7, 7, 7]], SamplingParams(temperature=0.0, **params))

    want = _plain_and(overlap_engine(tiny_random_qwen3, overlap=False), penalised)
    eng = overlap_engine(tiny_random_qwen3, overlap=True)
    assert_same(_plain_and(eng, penalised), want)
    assert eng.pipeline.overlapped > 15 and not eng.pipeline.sync_steps


class _EveryThird:
    """A draft budget that verifies full blocks for the samples of requests "g" and "late" whose length
    is a multiple of 3 and no drafts for the others (or none at all with `never`): a run mixes drafted
    steps with plain ones, decided by the samples' state alone, so both loops decide alike."""

    def __init__(self, never: bool = False):
        self.never = never

    def caps(self, running, token_budget, waiting_tokens=0, states=None):
        return {} if self.never else {s: 8 for s in running if s.request_id in ("g", "late") and s.num_tokens % 3 == 0}


class _OverlappingRepeat(RepeatDrafter):
    """Repeats the anchor (often accepted by the tiny random model) and says it may overlap."""

    def overlaps(self) -> bool:
        return True


@pytest.mark.parametrize("spec", ["dflash", "dspark", "repeat"])
@pytest.mark.parametrize("never", [False, True], ids=["mixed", "never"])
def test_steps_without_drafts_overlap_with_a_drafter(tiny_random_qwen3, random_drafters, spec, never):
    """A drafter does not turn overlap off: a step that verifies no drafts launches ahead like a plain
    one; with a drafter that needs host anchors, a step scheduled ahead with drafts waits for the sync
    before it (`drafts next`) and one that verified drafts is followed synchronously (`drafts`). The
    samples are those of the synchronous loop."""
    runs = {}
    for overlap in (False, True):
        if spec == "repeat":
            config = EngineConfig(model=str(tiny_random_qwen3), overlap=overlap, spec_adaptive=False, block_size=4,
                                  num_kv_blocks=256, max_num_batched_tokens=64, max_num_seqs=32)
            eng = build_engine(config, drafter_factory=factory_of(_OverlappingRepeat(8)))
        else:
            eng = overlap_engine(tiny_random_qwen3, overlap, spec=spec, draft=random_drafters[spec],
                                 spec_adaptive=False)
        eng.scheduler.draft_budget = _EveryThird(never)
        eng.add_request("s", [PROMPTS[0], PROMPTS[2]], SamplingParams(max_tokens=24, seed=5, **SAMPLED), n=2,
                        mask="support")
        eng.add_request("g", [PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0.0), mask="selected")
        eng.add_request("stop", [PROMPTS[3]], SamplingParams(max_tokens=12, seed=2, stop_token_ids=[7, 9, 11],
                                                             temperature=1.0))

        def abort_late(eng, i):
            return eng.abort("late") if i == 6 else (eng.add_request(
                "late", [[3, 4, 5]], SamplingParams(max_tokens=20, seed=1, **SAMPLED)) if i == 2 else None)

        runs[overlap] = run_steps(eng, abort_late), eng
    (want, _), (got, eng) = runs[False], runs[True]
    late = ("late", 0, 0)  # admitted a step later when scheduled ahead, so aborted one step shorter or so
    short, long = sorted((got.pop(late), want.pop(late)), key=lambda o: len(o.token_ids))
    assert short.finish_reason == long.finish_reason == "abort" and 0 < len(short.token_ids)
    assert short.token_ids == long.token_ids[:len(short.token_ids)]
    assert_same(got, want)
    assert eng.pipeline.idle and eng.kv_blocks()[0] == eng.kv_blocks()[1]
    assert eng.pipeline.overlapped > 10 and not eng.pipeline.sync_steps["drafter"]
    proposed, accepted = eng.draft_counts.total()
    if never:
        assert not proposed and not eng.pipeline.sync_steps
    else:
        assert proposed >= 8
        if spec == "repeat":  # drafts from host anchors: held, and followed synchronously
            assert eng.pipeline.sync_steps["drafts next"] >= 2 and eng.pipeline.sync_steps["drafts"] >= 2
        else:  # DFlash / DSpark draft from device anchors: neither waits (tests/test_overlap_drafts.py)
            assert not eng.pipeline.sync_steps["drafts next"] and not eng.pipeline.sync_steps["drafts"]
            assert eng.pipeline.overlapped_drafts >= 2
        assert all(got[key].accept_lengths == w.accept_lengths for key, w in want.items())  # the same steps drafted
        assert accepted > 0 if spec == "repeat" else True  # (the random drafters' drafts are rejected)


@pytest.mark.parametrize("spec, kv_blocks", [("dflash", 256), ("dspark", 256), ("dflash+history", 256),
                                             ("dflash", 24)], ids=["dflash", "dspark", "dflash+history", "preempting"])
def test_a_refreshing_drafter_overlaps_and_buffers_what_the_synchronous_loop_does(tiny_random_qwen3,
                                                                                   random_drafters, spec, kv_blocks):
    """The refresh keeps each step's tapped rows until that step's commit (a step launched ahead
    would overwrite the shared tap buffer first), so its steps without drafts overlap, and the buffer
    ends holding the same rows as the synchronous loop's: same positions and tokens, the same target
    layer outputs; no row for a slot discarded after its sample finished (a stop id) or was aborted;
    also with samples preempted under a small KV pool (at other steps in each loop: they recompute).
    Training is off here so that both runs draft alike."""
    runs = {}
    for overlap in (False, True):
        eng = overlap_engine(tiny_random_qwen3, overlap, spec=spec,
                             draft=random_drafters[spec.removesuffix("+history")], spec_adaptive=False,
                             drafter_refresh="always", drafter_refresh_tokens=4096, num_kv_blocks=kv_blocks)
        refresh, seqs = getattr(eng.drafter, "block_drafter", eng.drafter).refresh, {}
        refresh.train_slice = lambda idle=False, bound=None: None
        begin = refresh.begin_step

        def remember(items, begin=begin, seqs=seqs):
            seqs.update({it.seq.seq_id: it.seq for it in items})
            begin(items)

        refresh.begin_step = remember
        eng.scheduler.draft_budget = _EveryThird()
        eng.add_request("s", [PROMPTS[0], PROMPTS[2]], SamplingParams(max_tokens=24, seed=5, **SAMPLED), n=2)
        eng.add_request("g", [PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0.0))
        eng.add_request("stop", [PROMPTS[3]], SamplingParams(max_tokens=12, seed=2, stop_token_ids=[7, 9, 11],
                                                             temperature=1.0))
        eng.add_request("gone", [PROMPTS[3]], SamplingParams(max_tokens=30, seed=3, **SAMPLED))
        outs = run_steps(eng, lambda eng, i: eng.abort("gone") if i == 5 else None)
        buffer = refresh.buffer
        rows = {}
        for key, positions in buffer.slots.items():
            seq = seqs[key]
            for pos, row in positions.items():
                rows[(seq.request_id, seq.prompt_index, seq.sample_index, pos)] = (
                    int(buffer.token[row]), bool(buffer.output[row]), buffer.taps[row].clone())
        runs[overlap] = outs, rows, eng
    (want, want_rows, _), (got, got_rows, eng) = runs[False], runs[True]
    gone = ("gone", 0, 0)  # aborted after the same step index, which is a step's worth apart in tokens
    assert got.pop(gone).finish_reason == want.pop(gone).finish_reason == "abort"
    assert_same(got, want)
    assert eng.pipeline.overlapped > 10 and not eng.pipeline.sync_steps["drafter"]
    assert (eng.scheduler.num_preemptions > 0) == (kv_blocks < 100)
    assert len(getattr(eng.drafter, "block_drafter", eng.drafter).refresh.pending) <= 1
    mine = {k: v for k, v in got_rows.items() if k[0] != "gone"}
    theirs = {k: v for k, v in want_rows.items() if k[0] != "gone"}
    assert mine.keys() == theirs.keys() and len(mine) > 100
    for k, (token, output, taps) in theirs.items():
        assert mine[k][:2] == (token, output), k
        torch.testing.assert_close(mine[k][2], taps, atol=1e-5, rtol=1e-5)
    gone_rows = sorted(p for (r, _, _, p) in got_rows if r == "gone")
    assert gone_rows == list(range(gone_rows[0], gone_rows[0] + len(gone_rows)))  # no gap, no row past its end


def test_no_overlap_flag():
    parser = argparse.ArgumentParser()
    add_options(parser, EngineConfig)
    assert from_options(EngineConfig, parser.parse_args(["--no-overlap"])).overlap is False
    assert from_options(EngineConfig, parser.parse_args([])).overlap is True


def test_a_weight_update_among_drafted_and_plain_steps(tiny_random_qwen3, greedy_ref):
    """A weight update arriving while steps with and without drafts alternate (some held, some
    launched ahead) drains and applies between steps as in the synchronous loop: the same samples,
    stamped with the same policy versions."""
    runs = {}
    for overlap in (False, True):
        config = EngineConfig(model=str(tiny_random_qwen3), overlap=overlap, spec_adaptive=False, block_size=4,
                              num_kv_blocks=256, max_num_batched_tokens=64, max_num_seqs=32)
        eng = build_engine(config, drafter_factory=factory_of(_OverlappingRepeat(4)))
        eng.scheduler.draft_budget = _EveryThird()
        _workload(eng, greedy_ref)
        eng.add_request("g", [PROMPTS[2]], SamplingParams(max_tokens=14, temperature=0.0))
        runs[overlap] = run_steps(eng, _update_at(3, 9)), eng
    (want, _), (got, eng) = runs[False], runs[True]
    assert_same(got, want)
    assert want[("late", 0, 0)].policy_version == 1 and want[("g", 0, 0)].policy_version == 0
    assert eng.pipeline.sync_steps["weight update"] > 0 and eng.pipeline.sync_steps["drafts next"] > 0
    assert eng.pipeline.overlapped >= 3 and eng.draft_counts.total()[0] > 0
