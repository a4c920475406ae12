"""Shared-prefix attention (prefix_plan.py, prefix_items.py, prefix_attention.py,
triton_prefix_attention.py) against plain paged attention (attention.paged_attention): the torch
reference of the two passes and the Triton kernel (through Triton's interpreter on CPU) on small
block layouts (a group of 8 with different suffix lengths beside sequences alone, nesting under
a system prompt, verify rows beside a prefill chunk, a shared range ending mid-block, a chunked
prefix, GQA groups of 1, 3 and 4, a CUDA graph's padded rows), each cut three ways (suffixes
fused into their group's items, suffixes alone, and tiles small enough that chunk and tile
boundaries fall inside tokens and segments); then the engine: greedy tokens equal to the torch
backend's (which never shares), eagerly and with a drafter through the static-buffer graph path,
and the flag that turns it off.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from test_spec_engine import _generate

import rollout.engine.triton_prefix_attention as tpa
from rollout import build_engine
from rollout.cli import build_parser, engine_factory
from rollout.engine.attention import AttentionMetadata, paged_attention, write_kv
from rollout.engine.config import EngineConfig
from rollout.engine.params import SamplingParams
from rollout.engine.prefix_attention import StaticSharedPrefix, plan_to_device, shared_prefix_attention_reference
from rollout.engine.prefix_items import ITEM_FIELDS
from rollout.engine.prefix_launch import DEFAULT_LAUNCH, SHARE_RULE, LaunchConfig, LaunchConfigs, ShareRule
from rollout.engine.prefix_plan import SharedPrefixPlanner
from rollout.engine.triton_attention import paged_attention_triton, supported

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F = {name: i for i, name in enumerate(ITEM_FIELDS)}
TINY_TILES = LaunchConfig(block_m=16, block_n=16, min_chunk=16, target_programs=4096)
LAUNCHES = {
    "fused": LaunchConfigs(LaunchConfig(), LaunchConfig()),
    "suffixes alone": LaunchConfigs(*(LaunchConfig(fuse_suffix=False),) * 2),  # the first sweep's winner
    "tiny tiles": LaunchConfigs(TINY_TILES, TINY_TILES),
    # lone units' items in a launch of their own (compiled apart, each program taking every P-th)
    "lone pass": LaunchConfigs(*(LaunchConfig(fuse_suffix=False, lone_pass=True, lone_block_n=16),) * 2),
    # decode steps: every head of a lone item in one program (tiles of 16 key rows: 8 keys x 2 KV
    # heads), lone units cut into chunks of at most 16 keys (merged with the shared partials)
    "lone heads": LaunchConfigs(*(LaunchConfig(block_n=16, min_chunk=16, target_programs=1, fuse_suffix=False,
                                               lone_pass=True, lone_all_heads=True, lone_block_n=16,
                                               lone_max_keys=16),) * 2),
}
LAUNCHES["lone heads, merge kernel"] = LaunchConfigs(*(replace(LAUNCHES["lone heads"].decode, lone_merge=False),) * 2)
for _name in ("fused", "lone heads"):  # key rows' offsets in int32 (the caches here are small)
    LAUNCHES[f"{_name}, int32 offsets"] = LaunchConfigs(*(replace(LAUNCHES[_name].decode, index32=True),) * 2)
LAUNCHES["the engine's default"] = DEFAULT_LAUNCH  # as shipped: int32 offsets, decode's lazy rescale
ANY = ShareRule()  # every group shares
needs_triton = pytest.mark.skipif(not supported(16, torch.float32, DEVICE), reason="triton missing")


def layout(prompts, samples, prompt_blocks, gen_lens, q_len=1, system_blocks=0, block_size=4, tag="a"):
    """Block tables (labels; equal = one physical block), contexts and query lengths of
    prompts x samples forked samples whose last q_len tokens are this step's queries (layouts of
    different `tag`s share no block)."""
    tables, ctx = [], []
    for p in range(prompts):
        for s in range(samples):
            gen = gen_lens[(p * samples + s) % len(gen_lens)] + q_len
            shared = [(tag, i) for i in range(system_blocks)] + [(tag, p, i) for i in range(prompt_blocks)]
            tables.append(shared + [(tag, p, s, i) for i in range(-(-gen // block_size))])
            ctx.append((system_blocks + prompt_blocks) * block_size + gen)
    return tables, ctx, [q_len] * len(ctx)


def joined(*layouts):
    """Several layouts in one step."""
    return tuple(sum((list(part[i]) for part in layouts), []) for i in range(3))


def _verify_beside_prefill():
    """Four samples verifying 5 tokens, and a new request for their prompt computing a 70-token
    chunk after a prefix-cache hit on the 6 prompt blocks: too many queries to join the group."""
    tables, ctx, q_lens = layout(1, 4, 6, [0, 3, 8, 1], q_len=5)
    tables.append(tables[0][:6] + [("new", i) for i in range(18)])
    return tables, ctx + [24 + 70], q_lens + [70]


def build(tables, ctx, q_lens, heads, kv_heads, head_dim=16, block_size=4, seed=0, spikes=1.0):
    """q/k/v, caches and metadata of a step over `tables` (labels mapped to scrambled physical blocks;
    every third physical block's keys `spikes` times the others')."""
    gen = torch.Generator().manual_seed(seed)
    labels = sorted({b for t in tables for b in t}, key=repr)
    num_blocks = len(labels) + 2
    physical = dict(zip(labels, (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist(), strict=False))
    width = max(map(len, tables)) + 1
    table = torch.zeros(len(tables), width, dtype=torch.int64)
    for s, t in enumerate(tables):
        table[s, : len(t)] = torch.tensor([physical[b] for b in t])
    positions = [p for c, q in zip(ctx, q_lens, strict=True) for p in range(c - q, c)]
    seq = np.repeat(np.arange(len(ctx)), q_lens)
    slots = [int(table[s, p // block_size]) * block_size + p % block_size for s, p in zip(seq, positions, strict=True)]
    meta = AttentionMetadata(positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
                             cu_seqlens_q=torch.tensor([0, *np.cumsum(q_lens).tolist()]),
                             context_lens=torch.tensor(ctx), block_tables=table, max_query_len=max(q_lens),
                             max_context_len=max(ctx), block_size=block_size)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = [torch.randn(shape, generator=gen) for _ in range(2)]
    caches[0][1::3] *= spikes
    t = len(positions)
    q = torch.randn(t, heads, head_dim, generator=gen)
    k, v = torch.randn(t, kv_heads, head_dim, generator=gen), torch.randn(t, kv_heads, head_dim, generator=gen)
    return q, k, v, caches[0], caches[1], meta


def expected_and_plan(tables, ctx, q_lens, heads, kv_heads, block_size=4, prompt_lens=None, launch=DEFAULT_LAUNCH,
                      slack=None, spikes=1.0):
    """Plain paged attention's output, the caches with this step's keys written, and the plan.
    `slack` [S]: the plan takes each sequence's start that many positions later (the longest case of
    a step launched before a drafted one syncs, rollout.engine.overlap; `tables` must cover it)."""
    q, k, v, k_cache, v_cache, meta = build(tables, ctx, q_lens, heads, kv_heads, block_size=block_size, spikes=spikes)
    want = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.25)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    starts = [c - n + e for c, n, e in zip(ctx, q_lens, slack or [0] * len(ctx), strict=True)]
    planner = SharedPrefixPlanner(block_size, heads // kv_heads, kv_heads, launch, ANY)  # cases below SHARE_RULE
    host = planner.plan(meta.block_tables.numpy(), starts, q_lens, prompt_lens or starts)
    assert host is not None, "the case must share something"
    to = lambda x: x.to(DEVICE)  # noqa: E731
    return to(q), to(want), to(k_cache), to(v_cache), meta, plan_to_device(host, DEVICE), host


def _with_duplicates():
    """Two sequences at the same position holding the same blocks, the last one part-filled:
    the shared range ends inside it (only synthetic: the block manager shares full blocks only)."""
    tables = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5, 6]]
    return tables, [15, 15, 14], [1, 1, 1]


CASES = {
    # name: (layout, heads, kv_heads, block_size)
    "group of 8 beside sequences alone": (
        lambda: joined(layout(1, 8, 6, [0, 2, 5, 9, 1, 14, 3, 7]), layout(3, 1, 2, [4, 11, 6], tag="b")),
        8, 2, 4),
    "nested: system prompt, then prompts": (lambda: layout(2, 3, 4, [1, 6, 3], system_blocks=2), 4, 2, 4),
    "verify rows beside a prefill chunk": (_verify_beside_prefill, 4, 2, 4),
    "shared range ending mid-block": (_with_duplicates, 4, 2, 4),
    "chunked prefix": (lambda: layout(1, 2, 40, [2, 20], block_size=16), 4, 2, 16),
    "GQA 3: a tile boundary inside a token": (lambda: layout(1, 8, 4, [0, 1, 2, 5], q_len=3), 6, 2, 4),
    "no grouping (1 query head per KV head)": (lambda: layout(2, 3, 5, [2, 7]), 2, 2, 4),
    "4 KV heads (all-heads lone tiles of 4 keys x 4 KV heads)": (
        lambda: joined(layout(1, 8, 6, [0, 2, 5, 9, 1, 14, 3, 7]), layout(2, 1, 3, [9, 4], tag="b")), 8, 4, 4),
    "32 query heads on 8 KV heads (Qwen3-8B's grouping)": (
        lambda: joined(layout(1, 4, 5, [0, 6, 21, 3]), layout(1, 1, 2, [19], tag="b")), 32, 8, 4),
}


@pytest.mark.parametrize("launch", list(LAUNCHES))
@pytest.mark.parametrize("name", list(CASES))
def test_reference_equals_plain_attention(name, launch):
    make, heads, kv_heads, block_size = CASES[name]
    q, want, k_cache, v_cache, meta, plan, _ = expected_and_plan(*make(), heads, kv_heads, block_size,
                                                                 launch=LAUNCHES[launch])
    got = shared_prefix_attention_reference(q, k_cache, v_cache, meta.block_tables.to(DEVICE),
                                            meta.positions.to(DEVICE), plan, 0.25)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("name, launch", [(n, c) for n in CASES for c in LAUNCHES
                                          if (n, c) != ("chunked prefix", "tiny tiles")])  # 640 keys in 16s: slow
def test_kernel_equals_plain_attention(name, launch):
    make, heads, kv_heads, block_size = CASES[name]
    q, want, k_cache, v_cache, meta, plan, _ = expected_and_plan(*make(), heads, kv_heads, block_size,
                                                                 launch=LAUNCHES[launch])
    for _layer in range(2):  # a second layer reuses the step's buffers: its counters must be reset
        for partial in plan.buffers(q)[:2]:
            partial.fill_(float("nan"))  # every partial result a layer reads is its own
        out = torch.full_like(q, float("nan"))  # every row must be written
        got = tpa.shared_prefix_attention_triton(q, k_cache, v_cache, meta.block_tables.to(DEVICE),
                                                 meta.positions.to(DEVICE), plan, 0.25, out=out)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


SLACK = [3, 0, 2, 3, 1, 0, 3, 2]  # drafts each sample's step in flight may still accept
POISON_CASES = {  # blocks of 8 keys: lone ranges start at, and inside, a block
    "group of 8 beside sequences alone": lambda: joined(layout(1, 8, 3, [0, 2, 5, 9, 1, 14, 3, 7], block_size=8),
                                                        layout(3, 1, 2, [4, 11, 6], block_size=8, tag="b")),
    "own ranges starting mid-block": lambda: ([[1, 2, 3]] * 4, [21] * 4, [1] * 4),  # shared: positions 0 .. 19
}


@needs_triton
@pytest.mark.parametrize("launch", ["lone heads", "lone heads, merge kernel", "lone pass"])
@pytest.mark.parametrize("name", list(POISON_CASES))
@pytest.mark.parametrize("slack", [False, True], ids=["", "planned for longer contexts"])
def test_no_slot_outside_a_sequence_reaches_its_sum(name, launch, slack):
    """Every cache slot no sequence holds is NaN (a stale slot of a reused block could be anything):
    the kernels mask the keys past an item's range, values included, and still give plain
    attention's output, also for a plan made for longer contexts than the true ones."""
    tables, ctx, q_lens = POISON_CASES[name]()
    extra = [SLACK[i % len(SLACK)] if slack else 0 for i in range(len(ctx))]
    tables = [t + [("slack", i, j) for j in range(1 + e // 8)] for i, (t, e) in enumerate(zip(tables, extra))]
    q, want, k_cache, v_cache, meta, plan, _ = expected_and_plan(tables, ctx, q_lens, 8, 2, block_size=8,
                                                                 launch=LAUNCHES[launch], slack=extra)
    held = torch.zeros(k_cache.shape[:2], dtype=torch.bool)  # [blocks, slots]
    for row, length in zip(meta.block_tables.tolist(), np.add(ctx, extra).tolist()):
        for pos in range(length):
            held[row[pos // 8], pos % 8] = True
    for cache in (k_cache, v_cache):
        cache[~held.to(cache.device)] = float("nan")
    got = tpa.shared_prefix_attention_triton(q, k_cache, v_cache, meta.block_tables.to(DEVICE),
                                             meta.positions.to(DEVICE), plan, 0.25,
                                             out=torch.full_like(q, float("nan")))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=needs_triton)], ids=["reference", "kernel"])
@pytest.mark.parametrize("q_len, launch", [(1, "lone heads"), (1, "lone pass"), (4, "fused")])
def test_a_plan_for_the_longest_contexts_gives_the_true_attention(kernel, q_len, launch):
    """A step launched before a drafted step syncs is planned for each sample's longest context (its
    host start + the drafts it may accept) while its positions are the true ones, moved on the
    device: the keys in the slack past a query's position (stale or never written) stay masked."""
    gen = [0, 2, 5, 9, 1, 14, 3, 7]
    tables, long_ctx, q_lens = layout(1, 8, 6, [g + e for g, e in zip(gen, SLACK)], q_len=q_len)
    ctx = [c - e for c, e in zip(long_ctx, SLACK)]
    q, want, k_cache, v_cache, meta, plan, _ = expected_and_plan(tables, ctx, q_lens, 8, 2, launch=LAUNCHES[launch],
                                                                 slack=SLACK)
    args = (q, k_cache, v_cache, meta.block_tables.to(DEVICE), meta.positions.to(DEVICE), plan, 0.25)
    if kernel:
        got = tpa.shared_prefix_attention_triton(*args, out=torch.full_like(q, float("nan")))
    else:
        got = shared_prefix_attention_reference(*args)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def _plans(launch):
    return {name: expected_and_plan(*make(), heads, kv_heads, block_size, launch=LAUNCHES[launch])[-1]
            for name, (make, heads, kv_heads, block_size) in CASES.items()}


def test_the_cases_reach_what_they_are_named_for():
    """Guards the case table. Suffixes alone: nesting gives 3 partial rows a token, the
    duplicates a range ending mid-block, the long prefix several chunks, GQA 3 a straddled token,
    the sequences alone are written directly. Fused: a single-level group's members are written
    directly, nested ones merge 2 partial rows. Tiny tiles: chunk boundaries inside the fused
    segments and a segment in two row tiles. Lone heads: the 4-KV-head case has lone units cut in
    chunks."""
    alone, fused, tiny = _plans("suffixes alone"), _plans("fused"), _plans("tiny tiles")
    four = _plans("lone heads")["4 KV heads (all-heads lone tiles of 4 keys x 4 KV heads)"].items
    assert (four[four[:, F["indirect"]] == 0][:, F["chunks"]] > 1).any()
    assert 1 in alone["group of 8 beside sequences alone"].part_count.tolist()
    assert set(alone["nested: system prompt, then prompts"].part_count.tolist()) == {3}
    mid = alone["shared range ending mid-block"].items
    shared = mid[mid[:, F["indirect"]] == 1]
    assert ((shared[:, F["key_lo"]] + shared[:, F["range_len"]]) % 4 != 0).any()  # a shared range ends mid-block
    assert alone["chunked prefix"].part_count.max() >= 3
    gqa = alone["GQA 3: a tile boundary inside a token"].items
    assert (gqa[gqa[:, F["indirect"]] == 1][:, F["row0"]] % 3 != 0).any()  # a tile starting mid-token
    assert alone["verify rows beside a prefill chunk"].part_count.tolist() == [2] * 20 + [1] * 70
    assert set(fused["group of 8 beside sequences alone"].part_count.tolist()) == {1}
    assert set(fused["nested: system prompt, then prompts"].part_count.tolist()) == {2}
    assert fused["group of 8 beside sequences alone"].segments.shape[0] == 8
    items = np.concatenate([p.items for p in tiny.values()])
    inside = (items[:, F["seg_count"]] > 0) & (items[:, F["v_lo"]] > items[:, F["range_len"]])
    assert inside.any()  # a chunk starting among the segments
    segs = tiny["GQA 3: a tile boundary inside a token"].segments
    assert len(np.unique(segs[:, 1])) < len(segs)  # a sequence's segment in two row tiles


def test_a_wrong_shared_key_breaks_the_comparison():
    """Negative control: corrupting one key of the shared prompt changes the reference output."""
    q, want, k_cache, v_cache, meta, plan, host = expected_and_plan(*layout(1, 4, 4, [1, 2]), 4, 2)
    k_cache[int(meta.block_tables[0, 1]), 2] += 5.0  # key 6, in every sample's prompt
    got = shared_prefix_attention_reference(q, k_cache, v_cache, meta.block_tables.to(DEVICE),
                                            meta.positions.to(DEVICE), plan, 0.25)
    assert not torch.allclose(got, want, atol=1e-3)


@needs_triton
def test_padded_graph_rows_get_zero_and_real_rows_their_attention():
    """The plan replayed from a CUDA graph's static buffers, for a token count padded past the
    step's: real rows as without padding, padded rows 0 (finite: see test_graphs.py)."""
    q, want, k_cache, v_cache, meta, plan, host = expected_and_plan(*layout(1, 3, 5, [1, 4, 2]), 4, 2)
    planner = SharedPrefixPlanner(4, 2, 2)
    static = StaticSharedPrefix(planner, max_tokens=8, device=DEVICE)
    static.part_count.fill_(7)  # stale values of a longer earlier step
    static.load(plan, padded_tokens=4)
    q_pad = torch.cat([q, torch.randn(1, *q.shape[1:], device=DEVICE)])
    positions = torch.cat([meta.positions, torch.zeros(1, dtype=torch.int64)]).to(DEVICE)
    got = tpa.shared_prefix_attention_triton(q_pad, k_cache, v_cache, meta.block_tables.to(DEVICE), positions,
                                             static.plan(4, 1), 0.25, out=torch.full_like(q_pad, float("nan")))
    torch.testing.assert_close(got[:3], want, atol=2e-5, rtol=1e-5)
    assert not got[3].any()


@needs_triton
@pytest.mark.parametrize("samples", [SHARE_RULE.decode[0].min_members - 1, SHARE_RULE.decode[0].min_members])
def test_the_output_does_not_depend_on_the_path_the_rule_takes(samples):
    """A decode group holding SHARE_RULE's least shared keys: one member short of the rule, the
    engine's planner sends the step to the plain kernel (no plan); at it, to the shared-prefix
    kernel. Both kernels give the same rows either way."""
    rule = SHARE_RULE.decode[0]  # the most members, the fewest keys
    tables, ctx, q_lens = layout(1, samples, rule.min_keys // 4, [0, 5, 2, 9])
    q, k, v, k_cache, v_cache, meta = build(tables, ctx, q_lens, 4, 2)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    starts = [c - 1 for c in ctx]
    args = (meta.block_tables.numpy(), starts, q_lens, starts)
    assert (SharedPrefixPlanner(4, 2, 2).plan(*args) is not None) == (samples >= rule.min_members)
    to = lambda x: x.to(DEVICE)  # noqa: E731
    tables_dev = to(meta.block_tables)
    plain = paged_attention_triton(to(q), to(k_cache), to(v_cache), tables_dev, to(meta.context_lens),
                                   to(meta.cu_seqlens_q), 1, meta.max_context_len, 0.25)
    shared_plan = plan_to_device(SharedPrefixPlanner(4, 2, 2, rule=ANY).plan(*args), DEVICE)
    shared = tpa.shared_prefix_attention_triton(to(q), to(k_cache), to(v_cache), tables_dev, to(meta.positions),
                                                shared_plan, 0.25)
    torch.testing.assert_close(shared, plain, atol=2e-5, rtol=1e-5)


GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = list(range(40, 62))  # 22 tokens: 5 full blocks of 4 shared by the samples


def _count_shared_calls(monkeypatch) -> list[int]:
    calls = [0]
    original = tpa.shared_prefix_attention_triton

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(tpa, "shared_prefix_attention_triton", counting)
    return calls


@pytest.fixture(scope="module")
def torch_greedy(tiny_random_qwen3, random_drafters):
    """Greedy outputs of the torch backend (no shared-prefix path), which the Triton backend's
    plain kernel equals (test_triton_attention.py): the reference for both backends' paths."""
    return {spec: _generate(tiny_random_qwen3, [PROMPT], GREEDY, n=8, spec=spec, draft=random_drafters.get(spec),
                            block=4 if spec != "none" else None, kernel_backend="torch")[0]
            for spec in ("none", "dflash")}


@needs_triton
@pytest.mark.skipif(DEVICE.type == "cuda", reason="float32 CPU engine through the interpreter")
@pytest.mark.parametrize("spec, graphs, rule", [("none", False, ANY), ("dflash", True, ANY),
                                                ("none", False, SHARE_RULE)])
def test_engine_greedy_outputs_do_not_depend_on_shared_prefix_attention(tiny_random_qwen3, random_drafters,
                                                                        torch_greedy, monkeypatch, spec, graphs,
                                                                        rule):
    """Samples of one prompt share its 5 blocks in every decode / verify step (the tiny prompt is
    far below SHARE_RULE: the planner takes ANY): eagerly (n=8), and through the static-buffer
    replay of CUDA graphs (eager on CPU; n=6, padded to the bucket 8). With the engine's own rule
    every step runs the plain kernel, with the same outputs."""
    calls = _count_shared_calls(monkeypatch)
    _, eng = _generate(tiny_random_qwen3, [[1]], SamplingParams(max_tokens=1), spec=spec,
                       draft=random_drafters.get(spec), block=4 if spec != "none" else None, kernel_backend="triton")
    assert eng.prefix_planner.rule == SHARE_RULE
    eng.prefix_planner = replace(eng.prefix_planner, rule=rule)
    if graphs:
        eng.graphs = eng.make_step_graphs(capture=False)
    n = 6 if graphs else 8
    eng.add_request("g", [PROMPT], GREEDY, n=n)
    got = []
    while eng.has_unfinished():
        got += eng.step()
    got.sort(key=lambda o: o.sample_index)
    assert calls[0] >= 2 * 3 if rule == ANY else calls[0] == 0  # 2 layers x the steps after the prompt's
    if graphs:
        assert any(key[3] for key in eng.graphs.graphs)
    assert [o.token_ids for o in got] == [o.token_ids for o in torch_greedy[spec][:n]]
    for a, b in zip(got, torch_greedy[spec], strict=False):
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-4)


@needs_triton
@pytest.mark.skipif(DEVICE.type == "cuda", reason="a CPU engine with the Triton backend needs the interpreter")
def test_the_flag_keeps_the_plain_kernel(tiny_random_qwen3):
    off = build_engine(EngineConfig(model=str(tiny_random_qwen3), kernel_backend="triton",
                                 shared_prefix_attention=False))
    assert off.prefix_planner is None
    on = build_engine(EngineConfig(model=str(tiny_random_qwen3), kernel_backend="triton"))
    assert on.prefix_planner == SharedPrefixPlanner(16, 2, 2)


def test_the_flag_reaches_the_engine_config():
    parser = build_parser()
    on = parser.parse_args(["serve"])
    off = parser.parse_args(["serve", "--no-shared-prefix-attention"])
    assert on.shared_prefix_attention is True and off.shared_prefix_attention is False
    assert engine_factory(off).args[0].shared_prefix_attention is False
