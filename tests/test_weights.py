"""Weight updates in the engine: validated before anything changes, applied only once the
samples under way have drained, version stamped on every sample, drafter-only updates."""

from __future__ import annotations

import pytest
import torch

from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.params import SamplingParams
from rollout.errors import FailedPrecondition, InvalidArgument

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [[5, 6, 7, 8]]


def _engine(model, **kw):
    return build_engine(EngineConfig(model=str(model), block_size=4, num_kv_blocks=100, spec_adaptive=False, **kw))


def _drain(eng):
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    return outs


def _perturbed(eng):
    w = eng.model.layers[0].mlp.down_proj.weight
    return {"model.layers.0.mlp.down_proj.weight": w.detach().clone() + 0.5}


@pytest.mark.parametrize("bad, field_msg", [
    ({"model.layers.0.mlp.down_proj.weight": torch.zeros(3, 3)}, "shape"),
    ({"model.layers.99.mlp.down_proj.weight": torch.zeros(3, 3)}, "unknown tensor"),
    ({"model.norm.weight": torch.zeros(64, dtype=torch.int32)}, "floating"),
    ({}, "no tensors"),
])
def test_bad_updates_are_refused_and_change_nothing(tiny_random_qwen3, bad, field_msg):
    eng = _engine(tiny_random_qwen3)
    before = {k: v.clone() for k, v in eng.model.state_dict().items()}
    with pytest.raises(InvalidArgument, match=field_msg) as err:
        eng.update_weights(bad)
    assert err.value.field == "weights"
    assert not eng.weight_update_pending() and eng.policy_version == 0
    assert all(torch.equal(v, eng.model.state_dict()[k]) for k, v in before.items())


def test_update_drains_running_samples_then_applies(tiny_random_qwen3):
    eng = _engine(tiny_random_qwen3)
    eng.add_request("ref", PROMPT, GREEDY)
    reference = _drain(eng)[0].token_ids
    eng.add_request("old", PROMPT, GREEDY)
    eng.step()  # "old" is under way
    eng.update_weights(_perturbed(eng))
    with pytest.raises(FailedPrecondition):
        eng.update_weights(_perturbed(eng))
    eng.add_request("new", PROMPT, GREEDY)  # admitted only after the update applied
    outs = {o.request_id: o for o in _drain(eng)}
    assert outs["old"].policy_version == 0 and outs["old"].token_ids == reference
    assert outs["new"].policy_version == 1 and outs["new"].token_ids != reference
    assert eng.policy_version == 1 and not eng.weight_update_pending()


def test_drafter_only_update(tiny_random_qwen3, random_drafters):
    eng = _engine(tiny_random_qwen3, spec="dflash", draft=random_drafters["dflash"])
    name, w = next((n, p) for n, p in eng.drafter.model.named_parameters() if n.endswith("fc.weight"))
    eng.update_weights({}, {name: torch.zeros_like(w)})
    eng.add_request("a", PROMPT, GREEDY)
    out = _drain(eng)[0]
    assert out.policy_version == 1 and torch.count_nonzero(eng.drafter.model.fc.weight) == 0


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_values_that_are_not_finite_are_refused_by_name(tiny_random_qwen3, value):
    eng = _engine(tiny_random_qwen3)
    state = _perturbed(eng)
    state["model.norm.weight"] = eng.model.norm.weight.detach().clone()
    state["model.layers.0.mlp.down_proj.weight"][3, 5] = value
    with pytest.raises(InvalidArgument, match="'model.layers.0.mlp.down_proj.weight' has values that are not finite"):
        eng.update_weights(state)
    assert not eng.weight_update_pending() and eng.policy_version == 0


def test_tied_lm_head_is_checked_against_the_embedding(tiny_random_qwen3):
    eng = _engine(tiny_random_qwen3)
    embed = eng.model.embed_tokens.weight.detach()
    with pytest.raises(InvalidArgument, match=r"'lm_head.weight' has shape \(3, 3\)"):
        eng.update_weights({"lm_head.weight": torch.zeros(3, 3)})
    with pytest.raises(InvalidArgument, match="'lm_head.weight' is tied to 'embed_tokens.weight'"):
        eng.update_weights({"lm_head.weight": embed + 1})  # differs from the current embedding
    new = embed + 0.25
    with pytest.raises(InvalidArgument, match="'lm_head.weight' is tied to 'model.embed_tokens.weight'"):
        eng.update_weights({"model.embed_tokens.weight": new, "lm_head.weight": embed})
    assert eng.policy_version == 0 and torch.equal(eng.model.embed_tokens.weight, embed)
    eng.update_weights({"model.embed_tokens.weight": new, "lm_head.weight": new.clone()})  # a tied state_dict()
    eng.step()
    assert eng.policy_version == 1 and torch.equal(eng.model.lm_head.weight, new)


def test_withdrawn_and_repeated_updates_change_nothing(tiny_random_qwen3):
    eng = _engine(tiny_random_qwen3)
    eng.add_request("old", PROMPT, GREEDY)
    eng.step()
    weights = eng.weights
    assert weights.submit(weights.stage_state(_perturbed(eng)), token="t1", update_id="u1") is None
    assert weights.withdraw("t1") and not eng.weight_update_pending()
    assert not weights.withdraw("t2")  # not submitted yet: refused when it comes
    with pytest.raises(FailedPrecondition, match="withdrawn"):
        weights.submit(weights.stage_state(_perturbed(eng)), token="t2")
    outs = _drain(eng)
    assert outs[0].policy_version == 0 and eng.policy_version == 0
    assert weights.submit(weights.stage_state(_perturbed(eng)), token="t3", update_id="u1") is None
    eng.step()
    assert eng.policy_version == 1
    assert weights.submit(weights.stage_state(_perturbed(eng)), token="t4", update_id="u1") == 1  # a repeat
    assert not eng.weight_update_pending() and eng.policy_version == 1
