"""Shared pytest fixtures: tiny random HF checkpoints saved with transformers, for tests that need
a real model directory without the embedded assets.

`tiny_random_qwen3` (session-scoped) is a 2-layer Qwen3 with the project's byte-level tokenizer
(256 bytes + 8 specials, EOS 256, see scripts/make_tokenizer.py). `save_random_hf_model` builds
any small Qwen3 / Qwen3-MoE / Llama checkpoint from config keyword arguments.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# Without a GPU, Triton kernels (rollout/engine/triton_attention.py) run on CPU tensors through
# Triton's interpreter, which must be chosen before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests' models are tiny: one thread runs them several times faster than two (no fork/join
# per op) and keeps the suite's timing stable on CI's 2 cores.
torch.set_num_threads(1)

TINY_QWEN3 = dict(
    model_type="qwen3", vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    tie_word_embeddings=True, rms_norm_eps=1e-6,
)  # fmt: skip

# Qwen3-MoE as the tests use it: 3 layers (sparse, dense via mlp_only_layers, sparse), 4 experts of
# width 32, top 2, renormalised (as Qwen3-30B-A3B).
TINY_QWEN3_MOE = dict(
    TINY_QWEN3, model_type="qwen3_moe", num_hidden_layers=3, tie_word_embeddings=False, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
)  # fmt: skip


def _make_tokenizer_module():
    spec = importlib.util.spec_from_file_location("make_tokenizer", REPO / "scripts" / "make_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def save_random_hf_model(
    path: Path, seed: int = 0, init_std: float = 0.1, dtype=torch.float32, max_shard_size=None, **config
):
    """Build a random transformers Qwen3ForCausalLM / Qwen3MoeForCausalLM / LlamaForCausalLM from
    `config` keywords (`model_type` picks the class), randomise its norm weights too,
    `save_pretrained` it into `path` (safetensors, sharded below `max_shard_size`; a Qwen3-MoE's
    experts as per-expert tensors, as transformers writes them) and return the transformers
    model (float32, eval mode)."""
    import transformers

    config = dict(config)
    model_type = config.pop("model_type")
    config_cls, model_cls = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[model_type]
    hf_config = config_cls(initializer_range=init_std, **config)
    hf_config._attn_implementation = "eager"
    hf_config._experts_implementation = "eager"  # Qwen3-MoE: the per-expert loop (no grouped_mm)
    torch.manual_seed(seed)
    model = model_cls(hf_config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, init_std)
    model.to(dtype).save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model.float()


def write_byte_tokenizer(path: Path) -> None:
    """tokenizer.json + tokenizer_config.json of the project's byte-level tokenizer, and a
    generation_config.json naming EOS 256."""
    module = _make_tokenizer_module()
    module.write_tokenizer(path)
    (Path(path) / "generation_config.json").write_text(json.dumps({"eos_token_id": module.EOS_ID}))


@pytest.fixture(scope="session")
def tiny_random_qwen3(tmp_path_factory) -> Path:
    """Directory of a random 2-layer Qwen3 (vocab 264, hidden 64, 4 heads, 2 KV heads, head_dim 16,
    tied embeddings, float32 safetensors) with the byte-level tokenizer."""
    path = tmp_path_factory.mktemp("tiny-random-qwen3")
    save_random_hf_model(path, seed=0, **TINY_QWEN3)
    write_byte_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_random_qwen3_moe(tmp_path_factory) -> Path:
    """Directory of a random Qwen3-MoE (TINY_QWEN3_MOE, float32, per-expert safetensors as
    transformers saves them) with the byte-level tokenizer."""
    path = tmp_path_factory.mktemp("tiny-random-qwen3-moe")
    save_random_hf_model(path, seed=4, **TINY_QWEN3_MOE)
    write_byte_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def random_drafters(tiny_random_qwen3, tmp_path_factory) -> dict[str, str]:
    """Untrained DFlash and DSpark drafters (block 4, one layer) for `tiny_random_qwen3`, saved
    in the published layouts: {"dflash": dir, "dspark": dir}."""
    return _save_random_drafters(tiny_random_qwen3, tmp_path_factory)


@pytest.fixture(scope="session")
def random_moe_drafters(tiny_random_qwen3_moe, tmp_path_factory) -> dict[str, str]:
    """The same for `tiny_random_qwen3_moe` (dense Qwen3 draft layers reading its hidden states)."""
    return _save_random_drafters(tiny_random_qwen3_moe, tmp_path_factory)


def _save_random_drafters(target_dir: Path, tmp_path_factory) -> dict[str, str]:
    from rollout.engine.loader import load_model
    from rollout.spec.draft_loader import random_drafter, save_drafter

    target = load_model(target_dir)
    out = {}
    for kind in ("dflash", "dspark"):
        path = tmp_path_factory.mktemp(kind)
        save_drafter(random_drafter(target, kind, block_size=4, num_layers=1, mask_token_id=258, seed=1), path)
        out[kind] = str(path)
    return out
