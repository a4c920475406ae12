"""`load_format="random"`: a model directory with only config.json loads with seeded random
weights (the benchmarks' Qwen3-shaped models), runs through the engine, and bad values are refused."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_QWEN3

from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.loader import load_model
from rollout.engine.params import SamplingParams
from rollout.errors import InvalidArgument


@pytest.fixture
def config_only_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY_QWEN3, eos_token_id=0)))
    return tmp_path


def test_random_load_is_seeded_and_finite(config_only_dir):
    a = load_model(config_only_dir, load_format="random")
    b = load_model(config_only_dir, load_format="random")
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.isfinite(pa).all(), name
        assert torch.equal(pa, pb), name
    assert a.model.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert a.tokenizer is None and a.eos_token_ids == [0]


def test_engine_generates_from_random_weights(config_only_dir):
    engine = build_engine(EngineConfig(model=str(config_only_dir), load_format="random", num_kv_blocks=16))
    engine.add_request("r", [[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert len(outs) == 1 and len(outs[0].token_ids) == 5


def test_bad_load_format_refused():
    with pytest.raises(InvalidArgument, match="load_format"):
        EngineConfig(load_format="dummy")
