"""The loader refuses bad checkpoints with a LoadError naming the culprit, and reads the good
variants (bf16 weights, EOS from each of its three sources, old and new RoPE config layouts)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from rollout.engine.loader import load_model, read_state_dict
from rollout.engine.model import ModelConfig
from rollout.errors import LoadError

Q_PROJ = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture
def model_dir(tiny_random_qwen3, tmp_path):
    """A private copy of the tiny random Qwen3 checkpoint that a test may break."""
    path = tmp_path / "model"
    shutil.copytree(tiny_random_qwen3, path)
    return path


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def edit_weights(path, fn):
    state = read_state_dict(path)
    fn(state)
    save_file(state, str(path / "model.safetensors"))


def assert_load_error(path, *fragments):
    with pytest.raises(LoadError) as info:
        load_model(path)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_unsupported_model_type_names_it_and_the_supported_ones(model_dir):
    edit_config(model_dir, model_type="mistral")
    assert_load_error(model_dir, "mistral", "qwen3", "llama")


def test_missing_config_key_is_named(model_dir):
    edit_config(model_dir, intermediate_size=None)
    assert_load_error(model_dir, "intermediate_size")


def test_missing_tensor_is_named(model_dir):
    edit_weights(model_dir, lambda state: state.pop(Q_PROJ))
    assert_load_error(model_dir, "missing", Q_PROJ)


def test_missing_lm_head_of_untied_model_is_named(model_dir):
    edit_config(model_dir, tie_word_embeddings=False)
    assert_load_error(model_dir, "missing", "lm_head.weight")


def test_misshaped_tensor_names_it_with_both_shapes(model_dir):
    def shrink(state):
        state[Q_PROJ] = state[Q_PROJ][:32]

    edit_weights(model_dir, shrink)
    assert_load_error(model_dir, Q_PROJ, "(32, 64)", "(64, 64)")


def test_unexpected_tensor_is_named(model_dir):
    edit_weights(model_dir, lambda state: state.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    assert_load_error(model_dir, "unexpected", "model.layers.0.mlp.extra.weight")


def test_tokenizer_larger_than_vocab_is_a_vocabulary_mismatch(model_dir):
    edit_config(model_dir, vocab_size=260)
    assert_load_error(model_dir, "vocabulary mismatch", "264", "260")


def test_missing_files_and_directory(model_dir, tmp_path):
    assert_load_error(tmp_path / "nowhere", "nowhere", "does not exist")
    (model_dir / "model.safetensors").unlink()
    assert_load_error(model_dir, "model.safetensors")
    (model_dir / "config.json").unlink()
    assert_load_error(model_dir, "config.json")


def test_bf16_weights_are_cast_to_the_target_dtype(model_dir):
    reference = load_model(model_dir).model
    edit_weights(model_dir, lambda state: state.update({k: v.bfloat16() for k, v in state.items()}))
    loaded = load_model(model_dir).model
    q_proj = loaded.layers[1].self_attn.qkv_proj.weight[:64]
    assert q_proj.dtype == torch.float32
    assert torch.equal(q_proj, reference.layers[1].self_attn.qkv_proj.weight[:64].bfloat16().float())
    assert load_model(model_dir, dtype=torch.bfloat16).model.norm.weight.dtype == torch.bfloat16


def test_eos_ids_from_each_source(model_dir):
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [260, 256]}))
    assert load_model(model_dir).eos_token_ids == [260, 256]
    (model_dir / "generation_config.json").unlink()
    assert load_model(model_dir).eos_token_ids == [256]  # tokenizer_config.json eos_token
    (model_dir / "tokenizer_config.json").unlink()
    edit_config(model_dir, eos_token_id=7)
    assert load_model(model_dir).eos_token_ids == [7]


def test_old_and_new_rope_config_layouts_agree():
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2, rms_norm_eps=1e-5, max_position_embeddings=64)  # fmt: skip
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # fmt: skip
    old = ModelConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}})
    new = ModelConfig.from_hf(
        {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}}
    )
    assert old == new
    assert old.rope_scaling["rope_type"] == "llama3" and old.head_dim == 4 and old.num_key_value_heads == 2
    plain = ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_scaling is None and plain.rope_theta == 1e4


def test_unsupported_rope_type_is_named():
    with pytest.raises(LoadError, match="yarn"):
        ModelConfig.from_hf(
            dict(model_type="qwen3", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                 num_attention_heads=2, rms_norm_eps=1e-6, max_position_embeddings=64,
                 rope_scaling={"rope_type": "yarn", "factor": 4.0})
        )  # fmt: skip
