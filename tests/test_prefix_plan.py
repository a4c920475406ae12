"""The shared-prefix planner (rollout/engine/prefix_plan.py, prefix_items.py, prefix_launch.py),
host arrays only: which sequences of a step are grouped, over which key ranges, and how the work
items, fused suffix segments and partial rows are laid out. The attention these plans drive is
checked against plain paged attention in test_prefix_attention.py; here, the structure: GRPO
forks, nesting under a system prompt, groups that end as samples finish, prefill chunks left
alone, ranges clamped before the queries (ending mid-block), a prefix-cache layout whose shared
blocks are not prefix-closed, groups not worth their partial results, chunking at small batch,
suffixes fused into their group's items, steps routed to the plain kernel by their launch
parameters, and the capacities a CUDA graph sizes its buffers by. Grouping is checked with
suffixes read alone (`ALONE`), where each sequence's own range is an item of its own."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from rollout.engine.prefix_items import ITEM_FIELDS, SEG_FIELDS
from rollout.engine.prefix_launch import (
    DEFAULT_LAUNCH,
    SHARE_RULE,
    LaunchConfig,
    LaunchConfigs,
    ShareRule,
    max_segments,
)
from rollout.engine.prefix_plan import SharedPrefixPlanner

BS = 4
F = {name: i for i, name in enumerate(ITEM_FIELDS)}
SF = {name: i for i, name in enumerate(SEG_FIELDS)}
ALONE = LaunchConfigs(*(LaunchConfig(fuse_suffix=False),) * 2)
FUSED = LaunchConfigs(LaunchConfig(), LaunchConfig())
ANY = ShareRule()  # every group shares: the structure tests' steps are far below SHARE_RULE
TINY = LaunchConfigs(*(LaunchConfig(block_m=16, block_n=16, min_chunk=16, target_programs=4096),) * 2)


def grpo_tables(prompts: int, samples: int, prompt_blocks: int, gen_lens, system_blocks: int = 0):
    """Block tables of `prompts` x `samples` forked samples (labels: equal = same physical block),
    context = (system + prompt blocks) * BS + gen_len, numbered so that no block id repeats."""
    tables, ctx, next_id = [], [], 1000
    system = list(range(system_blocks))
    for p in range(prompts):
        prompt = [10**6 + p * 10**5 + i for i in range(prompt_blocks)]
        for s in range(samples):
            gen = gen_lens[(p * samples + s) % len(gen_lens)]
            own = list(range(next_id, next_id + -(-gen // BS)))
            next_id += len(own)
            tables.append(system + prompt + own)
            ctx.append((system_blocks + prompt_blocks) * BS + gen)
    width = max(map(len, tables))
    return np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int64), ctx


def plan(table, ctx, q_lens, groups=2, kv_heads=2, prompt_lens=None, launch=ALONE, rule=ANY):
    """The plan of sequences with contexts `ctx` computing their last q_lens[s] tokens (by default
    their prompt is all but their queries)."""
    starts = [c - q for c, q in zip(ctx, q_lens, strict=True)]
    return SharedPrefixPlanner(BS, groups, kv_heads, launch, rule).plan(table, starts, q_lens, prompt_lens or starts)


def shared_units(p):
    """Sorted (key_lo, key_hi, tokens) of each shared unit's own keys."""
    items = p.items[p.items[:, F["indirect"]] == 1]
    return sorted({(int(it[F["key_lo"]]), int(it[F["key_lo"]] + it[F["range_len"]]),
                    tuple(p.unit_tokens[it[F["tok_start"]]: it[F["tok_start"]] + it[F["tok_count"]]].tolist()))
                   for it in items})


def suffix_ranges(p):
    """(key_lo, key_hi) each sequence reads alone, in sequence order."""
    items = p.items[p.items[:, F["indirect"]] == 0]
    ranges = {(int(it[F["table_row"]]), int(it[F["key_lo"]]), int(it[F["key_lo"]] + it[F["range_len"]]))
              for it in items}
    return [r[1:] for r in sorted(ranges)]


def test_forked_samples_share_their_prompt_blocks_and_read_the_rest_alone():
    table, ctx = grpo_tables(prompts=2, samples=4, prompt_blocks=5, gen_lens=[1, 3, 6, 9])
    p = plan(table, ctx, [1] * 8)
    assert shared_units(p) == [(0, 20, (0, 1, 2, 3)), (0, 20, (4, 5, 6, 7))]
    leaders = p.items[p.items[:, F["indirect"]] == 1][:, F["table_row"]]
    assert sorted(leaders.tolist()) == [0, 4]  # each prompt's keys read through one member's row
    assert suffix_ranges(p) == [(20, c) for c in ctx]
    assert p.part_count.tolist() == [2] * 8 and p.part_start.tolist() == list(range(0, 16, 2))
    assert p.shared_keys == 40 and p.plain_keys == 160


def test_nested_sharing_plans_a_system_level_and_a_prompt_level():
    """64 samples of 8 prompts under one system-prompt block: the system block once for all 64,
    each prompt's blocks once for its 8, then each sample's own keys: 3 partial rows a token."""
    table, ctx = grpo_tables(prompts=8, samples=8, prompt_blocks=4, gen_lens=[2, 5], system_blocks=1)
    p = plan(table, ctx, [1] * 64)
    assert shared_units(p) == [(0, 4, tuple(range(64)))] + [(4, 20, tuple(range(8 * i, 8 * i + 8))) for i in range(8)]
    assert set(p.part_count.tolist()) == {3}
    assert suffix_ranges(p) == [(20, c) for c in ctx]


def test_a_system_prompt_alone_groups_every_sequence_that_holds_it():
    table, ctx = grpo_tables(prompts=4, samples=1, prompt_blocks=3, gen_lens=[2], system_blocks=2)
    p = plan(table, ctx, [1] * 4)
    assert shared_units(p) == [(0, 8, (0, 1, 2, 3))]
    assert suffix_ranges(p) == [(8, c) for c in ctx]


def test_groups_end_as_samples_finish_and_nothing_shared_plans_nothing():
    table, ctx = grpo_tables(prompts=2, samples=2, prompt_blocks=5, gen_lens=[3])
    assert plan(table, ctx, [1] * 4) is not None
    left = [0, 2, 3]  # sample 1 of prompt 0 finished: prompt 0 is down to one sequence
    p = plan(table[left], [ctx[i] for i in left], [1] * 3)
    assert shared_units(p) == [(0, 20, (1, 2))]
    assert p.part_count.tolist() == [1, 2, 2]  # the lone sample is written directly
    assert plan(table[[0, 2]], [ctx[0], ctx[2]], [1, 1]) is None
    assert plan(table[:1], ctx[:1], [1]) is None


def test_prefill_chunks_attend_alone_in_causal_tiles():
    """A prompt whose cached prefix a running group also holds, computing a 70-token chunk: it
    is not grouped (too many queries) and its row tiles stop at their last query's position."""
    prompt = [1, 2, 3, 4, 5]
    table = np.array([prompt + [10] + [0] * 17, prompt + [11] + [0] * 17, prompt + list(range(20, 38))])
    ctx, q_lens = [23, 23, 90], [1, 1, 70]
    p = plan(table, ctx, q_lens, groups=2)
    assert shared_units(p) == [(0, 20, (0, 1))]
    prefill = p.items[p.items[:, F["table_row"]] == 2]
    rows, block_m = 70 * 2, ALONE.verify.block_m
    assert len(prefill) == -(-rows // block_m) and p.part_count[2:].tolist() == [1] * 70  # written directly
    last_token = (np.minimum(prefill[:, F["row0"]] + block_m, rows) - 1) // 2
    assert prefill[:, F["key_lo"]].tolist() == [0] * len(prefill)
    assert prefill[:, F["v_hi"]].tolist() == (20 + last_token + 1).tolist()


def test_shared_ranges_end_before_every_query_even_mid_block():
    """Two sequences holding the same blocks up to their queries (the block manager shares only
    full computed blocks, so this does not happen today): the shared range stops at the first
    query position, inside a block, and each reads its last key alone."""
    table = np.array([[7, 8, 9, 10], [7, 8, 9, 10]])
    p = plan(table, [15, 15], [1, 1])
    assert shared_units(p) == [(0, 14, (0, 1))]
    assert suffix_ranges(p) == [(14, 15), (14, 15)]
    q2 = plan(table, [15, 16], [1, 2])  # one of them verifies 2 tokens, from position 14
    assert shared_units(q2) == [(0, 14, (0, 1, 2))]
    prompts = plan(table, [15, 15], [1, 1], prompt_lens=[10, 9])  # only prompt blocks are compared
    assert shared_units(prompts) == [(0, 9, (0, 1))]


def test_blocks_shared_with_different_partners_are_grouped_exactly():
    """A prefix-cache layout that is not prefix-closed: C holds A's first 3 blocks and B's next 3
    (B registered those hashes first). A and C share 3 blocks; B and C share none at the start."""
    a = [1, 2, 3, 20, 21]
    b = [30, 31, 32, 4, 5, 6, 40]
    c = [1, 2, 3, 4, 5, 6, 50]
    table = np.array([a + [0, 0], b, c])
    p = plan(table, [20, 28, 28], [1, 1, 1])
    assert shared_units(p) == [(0, 12, (0, 2))]
    assert suffix_ranges(p) == [(12, 20), (0, 28), (12, 28)]


@pytest.mark.parametrize("q_len, prompt_blocks, kept", [(1, 2, True), (9, 12, False), (9, 13, True)])
def test_a_group_is_kept_only_where_it_saves_more_than_its_partial_results_cost(q_len, prompt_blocks, kept):
    table, ctx = grpo_tables(prompts=1, samples=4, prompt_blocks=prompt_blocks, gen_lens=[q_len + 2])
    p = plan(table, ctx, [q_len] * 4, groups=4)  # kept: (4 - 1) * keys > 4 * q_len * 4 (144 at q 9)
    assert (p is not None) == kept


def test_few_sequences_with_long_prefixes_are_chunked_within_capacity():
    """Two samples of a 1200-token prompt are too few programs: the prompt is cut into chunks of
    min_chunk keys; fused, the last chunk also holds the samples' own keys."""
    table, ctx = grpo_tables(prompts=1, samples=2, prompt_blocks=300, gen_lens=[5, 9])
    for launch, own_keys in ((ALONE, 0), (FUSED, 5 + 9)):
        p = SharedPrefixPlanner(BS, 4, 8, launch, ANY).plan(table, [c - 1 for c in ctx], [1, 1], [1200, 1200])
        shared = p.items[p.items[:, F["indirect"]] == 1]
        assert len(shared) == -(-(1200 + own_keys) // launch.decode.min_chunk)
        assert shared[:, F["slot"]].tolist() == list(range(len(shared)))
        assert shared[:, F["v_lo"]].min() == 0 and shared[:, F["v_hi"]].max() == 1200 + own_keys
        assert np.all(shared[1:, F["v_lo"]] == shared[:-1, F["v_hi"]])
        assert p.part_count.tolist() == [len(shared) + (own_keys == 0)] * 2


def test_the_issue_shape_cuts_each_prompt_into_even_chunks():
    """16 prompts x 16 samples of 4096 tokens, decoding: 16 x 8 KV heads are too few programs,
    so every prompt is read in the same number of even chunks, about target_programs (item, KV
    head) pairs in all (suffixes alone: the prompt's keys; fused: with its samples' own keys)."""
    table, ctx = grpo_tables(prompts=16, samples=16, prompt_blocks=1024, gen_lens=list(range(1, 150, 7)))
    for launch, lone in ((ALONE, 1), (FUSED, 0)):
        p = plan(table, ctx, [1] * 256, groups=4, kv_heads=8, launch=launch)
        shared = p.items[p.items[:, F["indirect"]] == 1]
        chunks = len(shared) // 16
        assert len(shared) == 16 * chunks and np.bincount(shared[:, F["tok_start"]] // 16).tolist() == [chunks] * 16
        target = launch.decode.target_programs
        assert target / 1.5 <= len(shared) * 8 <= target * 1.5
        spans = (shared[:, F["v_hi"]] - shared[:, F["v_lo"]]).reshape(16, chunks)  # [prompt, chunk]
        assert (spans[:, :-1] == spans[:, :1]).all() and (spans[:, :1] - spans[:, -1:] < chunks * 64).all()
        assert p.part_count.tolist() == [chunks + lone] * 256


def test_fused_suffixes_ride_in_their_groups_items():
    """Fused, a group's items read its members' own keys after the shared ones (one segment each,
    seen by the member's tokens only): no item of their own, and one partial result each, so
    every token is written directly."""
    table, ctx = grpo_tables(prompts=2, samples=4, prompt_blocks=5, gen_lens=[1, 3, 6, 9])
    p = plan(table, ctx, [1] * 8, launch=FUSED)
    assert (p.items[:, F["indirect"]] == 1).all() and len(p.items) == 2
    assert p.part_count.tolist() == [1] * 8
    segs = p.segments
    assert segs[:, SF["table_row"]].tolist() == list(range(8))
    assert segs[:, SF["tok_lo"]].tolist() == list(range(8)) and segs[:, SF["tok_hi"]].tolist() == list(range(1, 9))
    own = [c - 20 for c in ctx]  # keys 20 .. ctx of each sample
    starts = segs[:, SF["v_start"]]
    assert starts.tolist() == [20, 20 + own[0], 20 + sum(own[:2]), 20 + sum(own[:3])] * 2
    assert (starts + segs[:, SF["pos_offset"]]).tolist() == [20] * 8  # the first own key is position 20
    assert p.items[:, F["v_hi"]].tolist() == [20 + sum(own[:4]), 20 + sum(own[4:])]


def test_nested_members_fuse_into_their_bottom_group():
    table, ctx = grpo_tables(prompts=2, samples=3, prompt_blocks=4, gen_lens=[2, 5], system_blocks=1)
    p = plan(table, ctx, [1] * 6, launch=FUSED)
    top = p.items[p.items[:, F["tok_count"]] == 6]
    assert len(top) == 1 and top[0, F["seg_count"]] == 0  # the system prompt's unit: no one's own keys
    assert p.segments[:, SF["table_row"]].tolist() == list(range(6))
    assert p.part_count.tolist() == [2] * 6  # the system prompt's result and the bottom group's


def test_launch_parameters_can_route_a_kind_of_step_to_the_plain_kernel():
    table, ctx = grpo_tables(prompts=2, samples=4, prompt_blocks=12, gen_lens=[11])
    verify_off = LaunchConfigs(LaunchConfig(), LaunchConfig(enabled=False))
    assert plan(table, ctx, [1] * 8, launch=verify_off) is not None
    assert plan(table, ctx, [9] * 8, launch=verify_off) is None
    assert plan(table, ctx, [9] * 8, launch=FUSED) is not None


def test_suffixes_are_read_alone_where_a_tile_could_hold_too_many_sequences():
    """One query head per KV head: a 64-row tile could hold 64 sequences, past the kernel's
    segment registers; 4 heads: 16, fused."""
    assert SharedPrefixPlanner(BS, 1, 2, FUSED).config(1).fuse_suffix is False
    assert SharedPrefixPlanner(BS, 4, 2, FUSED).config(1).fuse_suffix is True
    table, ctx = grpo_tables(prompts=1, samples=4, prompt_blocks=5, gen_lens=[3])
    p = plan(table, ctx, [1] * 4, groups=1, launch=FUSED)
    assert p.config.fuse_suffix is False and p.part_count.tolist() == [2] * 4


@pytest.mark.parametrize("field, value", [("block_m", 48), ("block_n", 8), ("num_warps", 3), ("min_chunk", 16)])
def test_launch_parameters_are_checked(field, value):
    with pytest.raises(ValueError, match=field):
        LaunchConfig(**{field: value})


@pytest.mark.parametrize("block_m, groups, bound", [(64, 4, 16), (16, 3, 8), (64, 1, 64), (16, 32, 2)])
def test_the_segment_bound_covers_every_token_a_tile_can_hold(block_m, groups, bound):
    assert max_segments(block_m, groups) == bound
    most = max(len({r // groups for r in range(t * block_m, (t + 1) * block_m)}) for t in range(groups))
    assert most <= bound


@pytest.mark.parametrize("launch", [ALONE, FUSED, TINY])
@pytest.mark.parametrize("seed", range(6))
def test_plans_fit_the_capacities_of_their_token_count(seed, launch):
    rng = np.random.default_rng(seed)
    prompts, samples = int(rng.integers(1, 12)), int(rng.integers(1, 17))
    gen = rng.integers(1, 200, size=prompts * samples).tolist()
    table, ctx = grpo_tables(prompts, samples, int(rng.integers(1, 80)), gen, system_blocks=int(rng.integers(0, 3)))
    q = rng.choice([1, 5, 9], size=len(ctx)).tolist()
    ctx = [c + k for c, k in zip(ctx, q)]
    table = np.concatenate([table, np.zeros((len(ctx), 3), np.int64)], 1)  # room for the verify keys
    planner = SharedPrefixPlanner(BS, 4, 8, launch, ANY)
    p = planner.plan(table, [c - k for c, k in zip(ctx, q)], q, [c - k for c, k in zip(ctx, q)])
    if p is None:
        return
    num_tokens = sum(q)
    assert len(p.items) <= planner.items_cap(num_tokens)
    assert len(p.segments) <= planner.segments_cap(num_tokens)
    assert p.num_partial_rows <= planner.partial_rows_cap(num_tokens)
    assert len(p.unit_tokens) <= 2 * num_tokens
    direct = p.part_count == 1
    assert (p.part_start[~direct] + p.part_count[~direct]).max(initial=0) <= p.num_partial_rows
    assert p.items[:, F["seg_count"]].max() <= max_segments(p.config.block_m, 4)


D, V = SHARE_RULE.decode[0], SHARE_RULE.verify[0]  # the most members, the fewest keys
MAX_Q = SHARE_RULE.max_verify_query_len


def _edges(steps, q_len):
    """(samples, keys, q_len, shared) at each step of a kind's rule: at it, one member fewer (where
    that is still a group), one block fewer (the rule is a staircase, so no other step admits those)."""
    edges = []
    for s in steps:
        edges += [(s.min_members, s.min_keys, q_len, True), (s.min_members, s.min_keys - BS, q_len, False)]
        if s.min_members > 2:
            edges.append((s.min_members - 1, s.min_keys, q_len, False))
    return edges


def test_the_measured_rule_is_a_staircase():
    """Each kind's steps: fewer members need strictly more keys (else a step would hide another,
    and the edges tested below would not be edges)."""
    for steps in (SHARE_RULE.decode, SHARE_RULE.verify):
        members = [s.min_members for s in steps]
        keys = [s.min_keys for s in steps]
        assert members == sorted(members, reverse=True) and len(set(members)) == len(members) and min(members) >= 2
        assert keys == sorted(keys) and len(set(keys)) == len(keys)
        assert all(k % BS == 0 for k in keys)
    with pytest.raises(ValueError, match="decode"):
        ShareRule(decode=())


@pytest.mark.parametrize("samples, keys, q_len, shared", [
    *_edges(SHARE_RULE.decode, 1), *_edges(SHARE_RULE.verify, MAX_Q), (V.min_members, V.min_keys, 2, True),
    (V.min_members, V.min_keys, MAX_Q + 1, False), (D.min_members, D.min_keys, 2, False),  # decode-sized, verifying
])
def test_the_measured_rule_decides_which_groups_share(samples, keys, q_len, shared):
    """The engine's planner at the edges of SHARE_RULE (one group of `samples` holding `keys`
    prompt tokens, each verifying `q_len`): outside it the step runs the plain kernel (None),
    though every group is worth sharing by its key reads alone (ANY shares each of them)."""
    assert keys % BS == 0
    table, ctx = grpo_tables(prompts=1, samples=samples, prompt_blocks=keys // BS, gen_lens=[q_len + 2, q_len + 7])
    starts = [c - q_len for c in ctx]
    args = (table, starts, [q_len] * samples, starts)
    assert (SharedPrefixPlanner(BS, 4, 8).plan(*args) is not None) == shared
    assert SharedPrefixPlanner(BS, 4, 8, rule=ANY).plan(*args) is not None


def test_a_group_below_the_rule_reads_alone_beside_one_above_it():
    """Two prompts' samples decoding, one sample of the second finished: the first group shares,
    the second (one member short) is not shared, its members read their whole context alone."""
    table, ctx = grpo_tables(prompts=2, samples=D.min_members, prompt_blocks=D.min_keys // BS, gen_lens=[3, 6])
    keep = list(range(2 * D.min_members - 1))
    ctx = [ctx[i] for i in keep]
    starts = [c - 1 for c in ctx]
    p = SharedPrefixPlanner(BS, 4, 8).plan(table[keep], starts, [1] * len(keep), starts)
    assert shared_units(p) == [(0, D.min_keys, tuple(range(D.min_members)))]
    assert suffix_ranges(p) == [(D.min_keys, c) for c in ctx[:D.min_members]] + [(0, c) for c in ctx[D.min_members:]]


def test_the_default_launch_reads_suffixes_alone():
    """The sweeps' winners (prefix_launch.DEFAULT_LAUNCH): suffixes read alone, in a lone pass of
    their own, every head of a token at once in decode steps."""
    assert DEFAULT_LAUNCH.decode.fuse_suffix is False and DEFAULT_LAUNCH.verify.fuse_suffix is False
    assert DEFAULT_LAUNCH.decode.lone_pass and DEFAULT_LAUNCH.verify.lone_pass
    assert DEFAULT_LAUNCH.decode.lone_all_heads
    assert SharedPrefixPlanner(BS, 4, 8).launch == DEFAULT_LAUNCH


def test_a_lone_pass_cuts_long_lone_units_into_chunks_of_at_most_lone_max_keys():
    """A lone item is one program's serial work in a lone pass: a sequence alone with a long
    context is cut (a GRPO group's short suffixes are not); chunks cover its keys exactly once."""
    capped = LaunchConfig(block_m=16, block_n=16, min_chunk=16, target_programs=1, fuse_suffix=False,
                          lone_pass=True, lone_max_keys=32)  # (block_m 16: lone_pass False is one launch)
    table, ctx = grpo_tables(prompts=1, samples=4, prompt_blocks=5, gen_lens=[1, 3, 6, 9])
    alone = np.arange(5000, 5030)[None, :]  # a sequence of 30 blocks of its own
    table = np.concatenate([np.pad(table, ((0, 0), (0, 30 - table.shape[1]))), alone])
    ctx = ctx + [117]
    for launch, cut in ((LaunchConfigs(capped, capped), True),
                        (LaunchConfigs(*(replace(capped, lone_pass=False),) * 2), False)):
        p = plan(table, ctx, [1] * 5, launch=launch)
        lone = p.items[(p.items[:, F["indirect"]] == 0) & (p.items[:, F["table_row"]] == 4)]
        covered = sorted((int(i[F["v_lo"]]), int(i[F["v_hi"]])) for i in lone)
        assert covered[0][0] == 0 and covered[-1][1] == 117
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
        assert (len(lone) == 4 and max(hi - lo for lo, hi in covered) <= 32) if cut else len(lone) == 1
        members = p.items[(p.items[:, F["indirect"]] == 0) & (p.items[:, F["table_row"]] < 4)]
        assert len(members) == 4  # the samples' short suffixes stay whole


def test_lone_max_keys_is_0_or_at_least_a_key_tile():
    with pytest.raises(ValueError, match="lone_max_keys"):
        LaunchConfig(block_n=64, lone_max_keys=32)
