"""Drafter checkpoints in the published config layout, field by field: the embedded DFlash and
DSpark drafters and what `save_drafter` writes carry every field of the published configs
(tests/data/published_drafter_configs.json: z-lab's DFlash, DeepSeek's DSpark) with the
published type and values consistent with the checkpoint and its target; the loader reads the
published examples; transformers' Qwen3Config exposes what the reference DFlashDraftModel reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from rollout.engine.loader import load_model
from rollout.engine.model import ModelConfig
from rollout.errors import LoadError
from rollout.spec.draft_loader import draft_config_from_hf, load_drafter, random_drafter, save_drafter

REPO = Path(__file__).resolve().parents[1]
PUBLISHED = json.loads((REPO / "tests" / "data" / "published_drafter_configs.json").read_text())
ASSETS = REPO / "rollout" / "assets"
JSON_TYPES = {"array": list, "boolean": bool, "integer": int, "number": (int, float), "object": dict,
              "string": str, "null": type(None)}


@pytest.fixture(scope="module")
def embedded_target():
    return load_model(ASSETS / "tiny-qwen3", "cpu")


def _is(value, json_type: str) -> bool:
    types = tuple(JSON_TYPES[t] for t in json_type.split("|"))
    return isinstance(value, types) and not (isinstance(value, bool) and bool not in types)


def assert_published_layout(d: dict, kind: str, target_dir: Path, trained: bool) -> None:
    """Every published field of `kind` present, of its type, and consistent with the target
    (the training record's fields only for a trained checkpoint)."""
    spec = PUBLISHED[kind]
    target = json.loads((target_dir / "config.json").read_text())
    for name, json_type in spec["fields"].items():
        if name in spec["hf_bookkeeping"] or (name in spec["training_record"] and not trained):
            continue
        assert name in d, f"{kind} config.json lacks published field {name!r}"
        assert _is(d[name], json_type), f"{name}={d[name]!r} is not a JSON {json_type}"
    for name, json_type in spec.get("dflash_config_fields", {}).items():
        assert _is(d["dflash_config"][name], json_type), f"dflash_config.{name}"
    assert {k: d[k] for k in spec["fixed"]} == spec["fixed"]
    draft = {**d, **d.get("dflash_config", {})}
    layers = d["num_hidden_layers"]
    assert d["layer_types"] == ["full_attention"] * layers
    assert d.get("max_window_layers", layers) == layers
    assert d["num_target_layers"] == target["num_hidden_layers"]
    assert all(0 <= i < d["num_target_layers"] for i in draft["target_layer_ids"])
    assert 0 <= draft["mask_token_id"] < d["vocab_size"] == target["vocab_size"]
    assert d["block_size"] == draft["block_size"] >= 2
    for token in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert d.get(token) == target.get(token), token
    if kind == "dflash":  # the target's embeddings and LM head feed the draft layers
        assert d["hidden_size"] == target["hidden_size"]
    else:
        assert d["rope_parameters"]["rope_theta"] == d.get("rope_theta", d["rope_parameters"]["rope_theta"])


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_embedded_drafter_config_has_every_published_field(kind):
    root = ASSETS / f"tiny-qwen3-{kind}"
    d = json.loads((root / "config.json").read_text())
    assert_published_layout(d, kind, ASSETS / "tiny-qwen3", trained=True)
    with safe_open(root / "model.safetensors", "pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes == {{"float32": "F32", "bfloat16": "BF16"}[d["dtype"]]}
    if kind == "dspark":  # published: recorded from the training run
        training = json.loads((root / "training.json").read_text())
        assert d["num_anchors"] == training["config"]["anchors"]


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_saved_layout_matches_the_published_one(embedded_target, kind, tmp_path):
    drafter = random_drafter(embedded_target, kind, block_size=4, num_layers=2, markov_rank=8)
    save_drafter(drafter, tmp_path, target=embedded_target)
    d = json.loads((tmp_path / "config.json").read_text())
    assert_published_layout(d, kind, ASSETS / "tiny-qwen3", trained=False)
    assert list(d) == sorted(d)  # transformers writes keys sorted
    assert load_drafter(tmp_path, embedded_target).config == drafter.config


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_loader_reads_the_published_example(kind):
    example = {k: v for k, v in PUBLISHED[kind]["example"].items() if not k.startswith("_")}
    target = ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=example["hidden_size"],
                         intermediate_size=4 * example["hidden_size"], num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                         rope_scaling=None, max_position_embeddings=40960, tie_word_embeddings=False,
                         attention_bias=False)
    cfg = draft_config_from_hf(example, target)
    draft = {**example, **example.get("dflash_config", {})}
    assert (cfg.kind, cfg.block_size, cfg.mask_token_id, list(cfg.target_layer_ids), cfg.num_target_layers) == (
        kind, draft["block_size"], draft["mask_token_id"], draft["target_layer_ids"], 36)
    assert (cfg.num_layers, cfg.intermediate_size, cfg.rope_theta) == (5, example["intermediate_size"], 1e6)
    assert cfg.markov_rank == example.get("markov_rank", 0)


@pytest.mark.parametrize("edit, message", [
    (dict(layer_types=["sliding_attention", "full_attention"]), "only full_attention"),
    (dict(markov_head_type="rnn"), "markov_head_type 'rnn'"),
    (dict(confidence_head_with_markov=False), "confidence_head_with_markov=False"),
    (dict(num_target_layers=7), "num_target_layers 7 does not match the target's 6 layers"),
])  # fmt: skip
def test_published_options_the_drafter_does_not_implement_are_refused(embedded_target, tmp_path, edit, message):
    d = json.loads((ASSETS / "tiny-qwen3-dspark" / "config.json").read_text()) | edit
    (tmp_path / "config.json").write_text(json.dumps(d))
    (tmp_path / "model.safetensors").symlink_to(ASSETS / "tiny-qwen3-dspark" / "model.safetensors")
    with pytest.raises(LoadError, match=message):
        load_drafter(tmp_path, embedded_target)


def test_old_layout_still_loads(embedded_target, tmp_path):
    """This project's earlier configs: no num_target_layers, DSparkDraftModel, draft fields only
    in dflash_config."""
    d = json.loads((ASSETS / "tiny-qwen3-dspark" / "config.json").read_text())
    for key in ("num_target_layers", "mask_token_id", "target_layer_ids", "layer_types", "markov_head_type",
                "enable_confidence_head", "confidence_head_with_markov", "rope_parameters", "num_anchors"):
        del d[key]
    d["architectures"] = ["DSparkDraftModel"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    (tmp_path / "model.safetensors").symlink_to(ASSETS / "tiny-qwen3-dspark" / "model.safetensors")
    old = load_drafter(tmp_path, embedded_target)
    assert old.config == load_drafter(ASSETS / "tiny-qwen3-dspark", embedded_target).config


def test_transformers_config_has_what_the_reference_reads():
    """The reference builds DFlashDraftModel from a transformers Qwen3Config and reads
    num_target_layers, dflash_config['target_layer_ids'] / ['mask_token_id'] and block_size."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config.from_pretrained(ASSETS / "tiny-qwen3-dflash")
    assert config.num_target_layers == 6 and config.block_size == 8 and config.num_hidden_layers == 2
    assert config.dflash_config["target_layer_ids"] == [1, 3, 5] and config.dflash_config["mask_token_id"] == 258
    assert config.architectures == ["DFlashDraftModel"] and config.dtype == torch.float32
