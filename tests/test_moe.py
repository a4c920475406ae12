"""Qwen3-MoE targets (rollout/engine/moe.py): the config fields and what is refused; greedy
generation through the engine equal to transformers' Qwen3MoeForCausalLM token for token, with
and without a DFlash drafter and with cached prompt prefixes; loading the per-expert layout of
a sharded checkpoint written by `save_pretrained` and a transformers-5 fused state dict; weight
updates in either layout, through the engine and through a server's streamed path. Logits /
hidden-state parity of the paged forward is in test_model_parity.py, the kernels in
test_triton_moe.py, host syncs in test_host_syncs.py."""

from __future__ import annotations

import functools
import json

import grpc
import pytest
import torch
import transformers
from conftest import TINY_QWEN3_MOE, save_random_hf_model
from safetensors.torch import save_file
from test_model_parity import check_parity
from test_spec_engine import PROMPTS, _generate

from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.loader import load_model, read_state_dict
from rollout.engine.model import ModelConfig
from rollout.engine.moe import FusedExperts, SparseMoeBlock
from rollout.engine.params import SamplingParams
from rollout.errors import InvalidArgument, LoadError
from rollout.server.app import BackgroundServer
from trainer_client import RolloutClient

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def hf_greedy(hf_model, prompts, max_tokens=GREEDY.max_tokens) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])  # [1, P]; one prompt holds token 0: an explicit mask, no padding
            ids = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                    min_new_tokens=max_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
            out.append(ids[0, len(prompt):].tolist())
    return out


def load_hf(path):
    return transformers.Qwen3MoeForCausalLM.from_pretrained(
        path, dtype=torch.float32, experts_implementation="eager", attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def hf_tokens(tiny_random_qwen3_moe) -> list[list[int]]:
    return hf_greedy(load_hf(tiny_random_qwen3_moe), PROMPTS)


def moe_config(**changes) -> dict:
    d = transformers.Qwen3MoeConfig(**{k: v for k, v in TINY_QWEN3_MOE.items() if k != "model_type"}).to_dict()
    d.update(changes)
    return {k: v for k, v in d.items() if v is not None}


# -- config -------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["num_experts", "num_local_experts"])
def test_sparse_layers_follow_transformers(key):
    changes = dict(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    d = moe_config(**changes)
    d[key] = d.pop("num_local_experts", None) or d.pop("num_experts")  # published configs say num_experts
    cfg = ModelConfig.from_hf(d)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **{k: v for k, v in TINY_QWEN3_MOE.items() if k != "model_type"} | changes))
    hf_sparse = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    assert [cfg.sparse_layer(i) for i in range(6)] == hf_sparse == [False, True, False, False, False, True]
    assert cfg.moe.num_experts == 4 and cfg.moe.num_experts_per_tok == 2 and cfg.moe.norm_topk_prob
    assert cfg.qk_norm


@pytest.mark.parametrize("changes, fragment", [
    (dict(shared_expert_intermediate_size=64), "shared expert"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok (5) must be <= num_experts (4)"),
    (dict(num_experts=8), "disagree"),
    (dict(moe_intermediate_size=None), "moe_intermediate_size"),
    (dict(num_local_experts=0), "num_experts must be > 0"),
    (dict(mlp_only_layers="0,1"), "mlp_only_layers"),
    (dict(model_type="qwen2_moe"), "unsupported model_type 'qwen2_moe'"),
])  # fmt: skip
def test_unsupported_moe_configs_are_refused(changes, fragment):
    d = moe_config()
    d.update(changes)
    d = {k: v for k, v in d.items() if v is not None}
    with pytest.raises(LoadError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_hf(d)


# -- generation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["none", "dflash"])
def test_greedy_equals_transformers(tiny_random_qwen3_moe, random_moe_drafters, hf_tokens, spec):
    """Mixed prompt lengths in one batch, then the same prompts again (their prefixes cached)."""
    outs, eng = _generate(tiny_random_qwen3_moe, PROMPTS, GREEDY, spec=spec, draft=random_moe_drafters.get(spec),
                          block=4)
    assert isinstance(eng.model.layers[0].mlp, SparseMoeBlock) and not isinstance(eng.model.layers[1].mlp,
                                                                                  SparseMoeBlock)
    assert [o.token_ids for o in outs] == hf_tokens
    cached, allocate = [], eng.block_manager.allocate_prompt
    eng.block_manager.allocate_prompt = lambda seq: cached.append(allocate(seq)) or cached[-1]
    eng.add_request("again", PROMPTS, GREEDY)
    again = []
    while eng.has_unfinished():
        again += eng.step()
    again.sort(key=lambda o: o.prompt_index)
    assert sum(cached) >= 12  # prompt tokens whose KV came from the prefix cache
    assert [o.token_ids for o in again] == hf_tokens


# -- loading ------------------------------------------------------------------------------------


def test_sharded_per_expert_checkpoint_matches(tmp_path):
    hf_model = save_random_hf_model(tmp_path, seed=5, max_shard_size="20KB", **TINY_QWEN3_MOE)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 3
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in weight_map  # the published per-expert names
    assert not any(name.endswith("experts.gate_up_proj") for name in weight_map)
    check_parity(hf_model, tmp_path, TINY_QWEN3_MOE["vocab_size"], seed=5)


def test_fused_state_dict_loads_like_the_per_expert_checkpoint(tiny_random_qwen3_moe, tmp_path):
    hf_state = load_hf(tiny_random_qwen3_moe).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf_state  # transformers 5 holds experts fused
    (tmp_path / "config.json").write_text((tiny_random_qwen3_moe / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in hf_state.items()}, str(tmp_path / "model.safetensors"))
    fused, per_expert = load_model(tmp_path).model, load_model(tiny_random_qwen3_moe).model
    for (name, a), (_, b) in zip(fused.named_parameters(), per_expert.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    experts = per_expert.layers[2].mlp.experts
    assert isinstance(experts, FusedExperts)
    up = hf_state["model.layers.2.mlp.experts.gate_up_proj"][3, 32:]  # expert 3's up rows
    assert torch.equal(experts.gate_up_proj[3, 32:], up)


def test_missing_expert_tensor_is_named(tiny_random_qwen3_moe, tmp_path):
    state = read_state_dict(tiny_random_qwen3_moe)
    del state["model.layers.2.mlp.experts.3.up_proj.weight"]
    (tmp_path / "config.json").write_text((tiny_random_qwen3_moe / "config.json").read_text())
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(LoadError, match=r"missing tensor\(s\) in checkpoint: \['model.layers.2.mlp.experts.3.up_proj"):
        load_model(tmp_path)


# -- weight updates -----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["fused", "per-expert"])
def test_update_in_either_layout_gives_the_new_models_tokens(tiny_random_qwen3_moe, hf_tokens, tmp_path, layout):
    new_hf = save_random_hf_model(tmp_path, seed=9, **TINY_QWEN3_MOE)
    state = new_hf.state_dict() if layout == "fused" else read_state_dict(tmp_path)
    assert any(name.endswith(".experts.gate_up_proj") for name in state) == (layout == "fused")
    outs, eng = _generate(tiny_random_qwen3_moe, PROMPTS[:3], GREEDY)
    assert [o.token_ids for o in outs] == hf_tokens[:3]
    eng.update_weights(state)
    eng.add_request("new", PROMPTS[:3], GREEDY)
    new = []
    while eng.has_unfinished():
        new += eng.step()
    new.sort(key=lambda o: o.prompt_index)
    assert all(o.policy_version == 1 for o in new)
    want = hf_greedy(new_hf, PROMPTS[:3])
    assert [o.token_ids for o in new] == want != hf_tokens[:3]


@pytest.mark.parametrize("layout", ["fused", "per-expert"])
def test_streamed_update_in_either_layout_through_a_server(tiny_random_qwen3_moe, tmp_path, layout):
    """The gRPC path (pieces into the server's arena, staged and checked off the engine thread,
    swapped between steps) takes the fused and the per-expert layouts like `update_weights`; a
    wrong expert shape is refused at its first piece with nothing applied."""
    new_hf = save_random_hf_model(tmp_path, seed=9, **TINY_QWEN3_MOE)
    state = new_hf.state_dict() if layout == "fused" else read_state_dict(tmp_path)
    config = EngineConfig(model=str(tiny_random_qwen3_moe), block_size=4, num_kv_blocks=200)
    sampling = dict(temperature=0.0, max_tokens=GREEDY.max_tokens, ignore_eos=True)
    with BackgroundServer(functools.partial(build_engine, config)) as server:
        with RolloutClient(server.address, timeout=120) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.update_weights({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 32, 64)})
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "gate_up_proj" in err.value.details()
            assert client.update_weights(state) == 1
            table = client.generate(PROMPTS[:3], sampling=sampling)
    assert table.column("policy_version").to_pylist() == [1, 1, 1]
    assert table.column("token_ids").to_pylist() == hf_greedy(new_hf, PROMPTS[:3])


@pytest.mark.parametrize("name, shape, fragment", [
    ("model.layers.0.mlp.experts.1.gate_proj.weight", (32, 63), "has shape (32, 63), expected (32, 64)"),
    ("model.layers.0.mlp.experts.gate_up_proj", (4, 32, 64), "has shape (4, 32, 64), expected (4, 64, 64)"),
    ("model.layers.0.mlp.experts.4.down_proj.weight", (64, 32), "unknown tensor"),
    ("model.layers.1.mlp.experts.0.up_proj.weight", (32, 64), "unknown tensor"),  # layer 1 is dense
])  # fmt: skip
def test_bad_expert_updates_are_refused(tiny_random_qwen3_moe, name, shape, fragment):
    _, eng = _generate(tiny_random_qwen3_moe, PROMPTS[:1], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidArgument, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        eng.update_weights({name: torch.zeros(shape)})
    assert eng.policy_version == 0 and not eng.weight_update_pending()


def test_the_upload_bound_counts_an_expert_parameter_once_whatever_its_layout(tiny_random_qwen3_moe, tmp_path):
    """WeightSpecs.budget (the arena an upload may fill) holds a whole update in either layout, and
    not both: a fused expert tensor and its per-expert parts fill the same parameter."""
    from rollout.engine.weight_specs import ALIGN

    new_hf = save_random_hf_model(tmp_path, seed=9, **TINY_QWEN3_MOE)
    engine = build_engine(EngineConfig(model=str(tiny_random_qwen3_moe), block_size=4, num_kv_blocks=16))
    budget = engine.weights.specs().budget()
    aligned = lambda state: sum(-(-t.numel() * 4 // ALIGN) * ALIGN for t in state.values())  # noqa: E731 (float32)
    fused, per_expert = aligned(new_hf.state_dict()), aligned(read_state_dict(tmp_path))
    params = sum(p.numel() * 4 for p in engine.model.parameters())
    assert max(fused, per_expert) <= budget < 1.1 * max(fused, per_expert) and budget < 1.5 * params
