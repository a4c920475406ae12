"""`--spec history` through the real engine: on prompts revisited epoch after epoch the drafter
proposes (and its drafts are accepted), while greedy outputs and their masks equal plain decoding
token for token, with n > 1 groups, continuous batching and preemption; a seeded sampled request
replayed draws exactly what plain decoding draws (the seed guard); a weight update drops the
history of the earlier policy unless told to keep it; the counts of drafts proposed and accepted
by proposer and policy version."""

from __future__ import annotations

import pytest
import torch

from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.params import SamplingParams
from rollout.spec.history_drafter import HistoryDrafter

PROMPTS = [[5, 6, 7], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110], [42], [1, 2, 3, 4, 5, 6],
           [200, 201], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13, 14, 15, 16, 17]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=11)


def _engine(model, spec="history", num_kv_blocks=400, spec_adaptive=False, **kw):
    """Full draft blocks unless `spec_adaptive` (the tests below check whole blocks accepted)."""
    return build_engine(EngineConfig(model=str(model), spec=spec, block_size=4, num_kv_blocks=num_kv_blocks,
                                     max_num_batched_tokens=48, spec_adaptive=spec_adaptive, **kw))


def _run(eng, request_id, prompts, params, n=1, mask=None):
    eng.add_request(request_id, prompts, params, n=n, mask=mask)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert eng.kv_blocks()[0] == eng.kv_blocks()[1]
    if eng.drafter is not None:
        eng.drafter.flush()  # the finished samples stored (a worker thread stores them)
    return sorted(outs, key=lambda o: (o.prompt_index, o.sample_index))


def _seen(outs):
    return [(o.token_ids, o.support_ids, o.support_logprobs) for o in outs]


def _accepted(eng) -> tuple[int, int]:
    return eng.draft_counts.by_key.get(("history", eng.policy_version), (0, 0))


@pytest.mark.parametrize("num_kv_blocks,adaptive", [(400, False), (16, False), (400, True)],
                         ids=["roomy", "preempting", "adaptive"])
def test_greedy_revisits_equal_plain_decoding_and_are_drafted(tiny_random_qwen3, num_kv_blocks, adaptive):
    plain = _seen(_run(_engine(tiny_random_qwen3, "none"), "r", PROMPTS, GREEDY, n=2, mask="support"))
    eng = _engine(tiny_random_qwen3, num_kv_blocks=num_kv_blocks, spec_adaptive=adaptive)
    assert isinstance(eng.drafter, HistoryDrafter) and eng.info()["spec_block_size"] == 8
    for epoch in range(3):
        outs = _run(eng, f"epoch{epoch}", PROMPTS, GREEDY, n=2, mask="support")
        assert _seen(outs) == plain
        assert all(sum(o.accept_lengths) == len(o.token_ids) for o in outs)
    proposed, accepted = _accepted(eng)
    assert accepted > 0.5 * proposed > 0  # the revisits were drafted from the stored samples
    if not adaptive:  # (an adaptive budget may verify shorter blocks)
        assert max(a for o in outs for a in o.accept_lengths) == 8  # whole blocks accepted
    if num_kv_blocks == 16:
        assert eng.scheduler.num_preemptions > 0
    assert eng.drafter.matchers == {}  # every finished sample let go of its match


def test_seeded_replay_draws_what_plain_decoding_draws(tiny_random_qwen3):
    """A sample never drafts from stored samples drawn with its own seed (their uniforms would
    verify the drafts); other seeds do draft from them."""
    plain = _seen(_run(_engine(tiny_random_qwen3, "none"), "r", PROMPTS[:3], SAMPLED, n=3))
    eng = _engine(tiny_random_qwen3)
    assert _seen(_run(eng, "first", PROMPTS[:3], SAMPLED, n=3)) == plain  # equal lengths: nothing stored yet
    assert _seen(_run(eng, "replay", PROMPTS[:3], SAMPLED, n=3)) == plain
    assert _accepted(eng)[0] == 0
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=12)
    outs = _run(eng, "other", PROMPTS[:3], other, n=3)
    assert _accepted(eng)[0] > 0 and all(sum(o.accept_lengths) == len(o.token_ids) for o in outs)


def _same_weights(eng):
    w = eng.model.layers[0].mlp.down_proj.weight
    return {"model.layers.0.mlp.down_proj.weight": w.detach().clone()}


@pytest.mark.parametrize("keep", [False, True], ids=["dropped", "kept"])
def test_a_weight_update_drops_the_earlier_policy_history(tiny_random_qwen3, keep):
    eng = _engine(tiny_random_qwen3, spec_history_keep_versions=keep)
    first = _run(eng, "v0", PROMPTS[:1], GREEDY)
    assert eng.drafter.store.history.num_tokens > 0
    eng.update_weights(_same_weights(eng))
    again = _run(eng, "v1", PROMPTS[:1], GREEDY)  # the same policy, but a new version
    assert eng.policy_version == 1 and [o.token_ids for o in again] == [o.token_ids for o in first]
    proposed, accepted = _accepted(eng)
    if keep:
        assert accepted > 0
    else:
        assert proposed == 0 and eng.drafter.store.history.num_tokens == len(first[0].token_ids) + 2
    assert set(eng.draft_counts.by_key) == ({("history", 1)} if keep else set())


def test_aborted_samples_are_not_stored_and_the_store_stays_bounded(tiny_random_qwen3):
    eng = _engine(tiny_random_qwen3, spec_history_tokens=40)
    eng.add_request("gone", PROMPTS[:2], GREEDY)
    eng.step()
    eng.abort("gone")
    eng.drafter.flush()
    assert eng.drafter.store.history.num_tokens == 0 and eng.drafter.matchers == {}
    _run(eng, "kept", PROMPTS, GREEDY)
    assert 0 < eng.drafter.store.history.num_tokens <= 40 and eng.drafter.store.history.evicted_prompts > 0


def test_history_config_is_checked_where_it_enters(tiny_random_qwen3):
    from rollout.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="spec_history_tokens"):
        EngineConfig(spec="history", spec_history_tokens=0)
    with pytest.raises(InvalidArgument) as err:
        EngineConfig(spec="history", draft="/some/dir")
    assert err.value.field == "draft"
    with pytest.raises(InvalidArgument) as err:
        _engine(tiny_random_qwen3).update_weights({}, {"fc.weight": torch.zeros(1)})
    assert err.value.field == "draft_weights"


def test_acceptance_by_proposer_and_policy_version_reaches_metrics_and_the_stats_line(tiny_random_qwen3):
    from rollout.server.engine_stats import EngineStats
    from rollout.server.metrics import EngineCollector, Metrics
    from rollout.server.stats_log import headline

    eng, stats = _engine(tiny_random_qwen3), EngineStats()
    _run(eng, "a", PROMPTS[:2], GREEDY)
    first = stats.snapshot(eng)
    _run(eng, "b", PROMPTS[:2], GREEDY)
    now = stats.snapshot(eng)
    proposed, accepted = now.drafts[("history", 0)]
    assert accepted > 0 and proposed >= accepted and first.drafts == {}  # nothing to draft from at first
    assert headline(first, now, 0)["draft_acceptance"] == {"history": round(accepted / proposed, 3)}
    metrics = Metrics(lambda: 0)
    metrics.update(now)
    family = next(f for f in EngineCollector(metrics).collect() if f.name == "rollout_draft_tokens")
    assert {(s.labels["proposer"], s.labels["policy_version"], s.labels["outcome"]): s.value
            for s in family.samples} == {("history", "0", "proposed"): proposed,
                                         ("history", "0", "accepted"): accepted}
