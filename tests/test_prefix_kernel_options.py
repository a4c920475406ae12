"""The shared-prefix kernels' launch options (prefix_launch.LaunchConfig) beyond the layouts that
test_prefix_attention.py runs through every case: where decode's all-heads lone pass runs, where key
offsets fit int32, and the lone pass's lazy rescale against plain attention with scores that jump
between tiles."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_prefix_attention import CASES, DEVICE, LAUNCHES, expected_and_plan, needs_triton

import rollout.engine.triton_prefix_attention as tpa
from rollout.engine.prefix_launch import DEFAULT_LAUNCH, LaunchConfigs
from rollout.engine.triton_prefix_lone import all_heads
from rollout.engine.triton_prefix_tiles import index32_fits


@pytest.mark.parametrize("shape, view, fits", [
    ((1000, 16, 8, 128), None, True),
    ((131072, 16, 8, 128), None, True),  # 2**31 elements: the last at 2**31 - 1
    ((131073, 16, 8, 128), None, False),  # one block more: past int32
    ((2, 70000, 16, 8, 128), 1, True),  # one layer's slice of a larger pool: offsets from the slice's start
])
def test_int32_offsets_are_taken_only_where_the_caches_fit(shape, view, fits):
    cache = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    assert index32_fits(cache if view is None else cache[view]) is fits


def test_int32_offsets_need_every_cache_to_fit():
    """The kernels read keys and values through one INDEX32: both caches must fit."""
    small, large = (torch.empty(shape, dtype=torch.bfloat16, device="meta")
                    for shape in ((1000, 16, 8, 128), (131073, 16, 8, 128)))
    assert index32_fits(small, small)
    assert not index32_fits(small, large) and not index32_fits(large, small)


LAZY = {"lone heads": LaunchConfigs(*(replace(LAUNCHES["lone heads"].decode, lone_lazy_rescale=True),) * 2),
        "lone heads, merge kernel": LaunchConfigs(*(replace(LAUNCHES["lone heads, merge kernel"].decode,
                                                            lone_lazy_rescale=True),) * 2)}


@needs_triton
@pytest.mark.parametrize("launch", list(LAZY))
@pytest.mark.parametrize("name", ["group of 8 beside sequences alone",
                                  "4 KV heads (all-heads lone tiles of 4 keys x 4 KV heads)",
                                  "32 query heads on 8 KV heads (Qwen3-8B's grouping)"])
@pytest.mark.parametrize("spikes", [3.0, 200.0])
def test_a_lazy_softmax_equals_plain_attention_as_scores_jump(name, launch, spikes):
    """LaunchConfig.lone_lazy_rescale (decode's all-heads lone pass): every third block's keys `spikes`
    times the others', so a row's scores jump between tiles. At 3 (scores' spread ~12, the slack 22 at
    scale 0.25) most jumps stay inside the slack, whose tiles' probabilities reach past 1 against the
    kept reference; at 200 they pass it by hundreds of log2 units (the reference must move, or exp2
    overflows)."""
    make, heads, kv_heads, block_size = CASES[name]
    q, want, k_cache, v_cache, meta, plan, _ = expected_and_plan(*make(), heads, kv_heads, block_size,
                                                                 launch=LAZY[launch], spikes=spikes)
    got = tpa.shared_prefix_attention_triton(q, k_cache, v_cache, meta.block_tables.to(DEVICE),
                                             meta.positions.to(DEVICE), plan, 0.25)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_the_all_heads_lone_pass_runs_where_its_tile_fits():
    """Decode steps only (a lone item is one token), KV heads dividing the key tile, and a tile no
    larger than the measured one: a head dim of 256 falls back to the per-KV-head lone pass."""
    config = DEFAULT_LAUNCH.decode
    assert all_heads(config, 1, num_kv_heads=8, head_dim=128)
    assert not all_heads(config, 9, num_kv_heads=8, head_dim=128)
    assert not all_heads(config, 1, num_kv_heads=8, head_dim=256)
    assert not all_heads(config, 1, num_kv_heads=6, head_dim=128)
    assert not all_heads(DEFAULT_LAUNCH.verify, 1, num_kv_heads=8, head_dim=128)
